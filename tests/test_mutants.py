"""The suite's power: every broken cache and broken model in ``tests/mutants`` is caught.

For each mutant, the kit's properties (``kvcheck.properties.ALL``, in ``HUNT_ORDER``) are
searched with Hypothesis (no shrinking, no example database) until one fails; the test
passes when one does, and records which (``caught_by`` in the JUnit XML, and printed:
``pytest -rP`` shows it). What counts as a catch, and why a crash does not, is in
``tests/mutants/hunt.py``. A new property joins the hunt by joining ``ALL``.
"""

import dataclasses

import pytest
import torch

import kvimpl
from kvcheck import failures
from kvcheck import strategies as kvst
from kvcheck.properties.core import LOGITS, check_logits_match_uncached
from kvref import ModelConfig
from tests import depth
from tests import mutants as kvmut
from tests.mutants import sizes as kvsizes_mutants
from tests.mutants.caches import StoresFloat16AsBfloat16, WrapsPast48
from tests.mutants.hunt import (
    EXAMPLES_PER_PROPERTY,
    FIRST_CATCHES,
    HUNT_ORDER,
    hunt,
    hunt_as_tested,
    search,
)

# Built on the kit's device (--kv-device): skipped where this machine lacks it.
pytestmark = pytest.mark.kv_device

# A hunt that flags everything flags the first example, so one a property (after its pinned
# inputs) is control enough; the built-ins' own kit tests search them deeper.
CONTROL_EXAMPLES = 1


@pytest.mark.parametrize("mutant", kvmut.MUTANTS, ids=lambda mutant: mutant.name)
def test_suite_catches_mutant(mutant, record_property):
    catch = hunt_as_tested(mutant)
    assert catch is not None, (
        f"no property caught mutant {mutant.name} ({mutant.bug}) in "
        f"{EXAMPLES_PER_PROPERTY} examples each of {[prop.name for prop in HUNT_ORDER]}: "
        f"the suite cannot see this bug; strengthen kvcheck/strategies.py or add a property"
    )
    record_property("caught_by", catch.describe())
    print(f"{mutant.name} caught by {catch.describe()}\n{catch.example!r}")


def test_every_mutant_has_its_last_catch_on_record():
    # Else the hunt above still catches it, searching every property in turn: slower.
    hunted = [mutant.name for mutant in kvmut.MUTANTS]
    hunted += [variant.__name__ for variant in kvsizes_mutants.SIZE_VARIANTS]
    missing = [name for name in hunted if name not in FIRST_CATCHES]
    gone = sorted(set(FIRST_CATCHES) - set(hunted))
    assert (missing, gone) == ([], []), (
        f"tests/mutants/first_catches.json lacks {missing} and names {gone}, gone from the "
        f"catalogue: run python -m tests.mutants.report --first-catches"
    )


# The hunt's control: in the default run two built-ins that between them offer every
# capability but sinks (every built-in's own kit tests hold it to each property); under
# --soak every built-in.
CONTROLS = list(kvimpl.CACHES) if depth.SOAK else ["preallocated", "paged"]


@pytest.mark.long  # a whole hunt on a correct cache
@pytest.mark.parametrize("name", CONTROLS)
def test_hunt_spares_correct_caches(name):
    # Without this, a hunt that flagged everything would pass every test above.
    catch = hunt(kvmut.Mutant(kvimpl.CACHES[name]), HUNT_ORDER, max_examples=CONTROL_EXAMPLES)
    assert catch is None, (
        f"the hunt flags the correct built-in cache {name!r}: {catch.describe()}\n{catch.example!r}"
    )


@pytest.mark.parametrize(
    "variant", kvsizes_mutants.SIZE_VARIANTS, ids=lambda variant: variant.__name__
)
def test_suite_catches_size_mutants_at_other_thresholds(variant):
    catch = hunt_as_tested(kvmut.Mutant(variant))
    assert catch is not None, (
        f"no property caught {variant.__name__}: the search reaches one threshold only"
    )


def test_the_logits_budget_alone_sees_float16_stored_as_bfloat16():
    # The lengths and contents properties see the changed rows bit for bit; a cache that
    # computes attention itself (attend) returns no rows, so the logits' error budget must
    # see the narrower storage on its own, in float16 scenarios.
    in_float16 = dataclasses.replace(LOGITS, strategy=kvst.scenarios(dtypes=(torch.float16,)))
    catch = search(
        StoresFloat16AsBfloat16, in_float16, max_examples=EXAMPLES_PER_PROPERTY, pinned=False
    )
    assert catch is not None, (
        f"no float16 scenario of the logits property caught StoresFloat16AsBfloat16 in "
        f"{EXAMPLES_PER_PROPERTY} examples: the error budget (kvcheck.asserts.BUDGETS) is too loose"
    )
    print(f"caught by {catch.describe()}")


def test_the_diagnosis_names_the_first_wrong_layer_and_the_positions_of_its_rows():
    # 50 tokens into a cache that wraps past 48: the decode of positions 48 and 49 lands on
    # rows 0 and 1, and rows 48 and 49 are never written. Layer 0 goes wrong first.
    config = ModelConfig(vocab_size=7, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4)
    session = kvst.Session(chunks=(40, 10), token_seed=0, start="fresh")
    scenario = kvst.Scenario(config, batch=1, dtype=torch.float64, sessions=(session,))
    with pytest.raises(failures.WrongResults) as caught:
        check_logits_match_uncached(WrapsPast48, scenario)
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert "layer 0 is the first whose cache returned keys" in notes, notes
    assert "at absolute positions [0, 1, 48, 49] (4 of 50 rows)" in notes, notes
