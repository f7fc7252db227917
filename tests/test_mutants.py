"""The suite's power: every broken cache and broken model in ``tests/mutants`` is caught.

For each mutant, the properties of ``PROPERTIES`` are searched in order with Hypothesis (no
shrinking, no example database) until one fails; the test passes when one does, and
records which (``caught_by`` in the JUnit XML, and printed: ``pytest -rP`` shows it). What
counts as a catch, and why a crash does not, is in ``tests/mutants/hunt.py``.

Each row of ``PROPERTIES`` is what one ``test_<topic>.py`` module binds: a check
``check(factory, drawn)`` that raises AssertionError when the property fails, and the
strategy that draws its input. To add a property, add a row. The hunt stops at the first
catch, so order matters: every row pays for the same model runs, so the rows that catch
the most come first (logits: anything that changes what the model computes), and the one
that needs two sessions per example comes last.
"""

import pytest
from hypothesis import strategies as st

import kvimpl
from tests import badinput as kvbad
from tests import checks as kvchk
from tests import mutants as kvmut
from tests import scenarios as kvst
from tests.mutants.hunt import Property, hunt

PROPERTIES = (
    Property("logits", kvchk.check_logits_match_uncached, kvst.scenarios()),
    # The cache-level properties need no model, so they cost little to try next.
    Property("memory", kvchk.check_nbytes, kvst.cache_plans(room=0, min_chunks=1)),
    Property(
        "overflow",
        lambda factory, drawn: kvbad.check_overflow(factory, *drawn),
        st.tuples(kvst.cache_plans(), st.integers(1, 3)),
    ),
    Property(
        "bad append",
        lambda factory, drawn: kvbad.check_every_bad_append(factory, *drawn),
        st.tuples(kvst.cache_plans(room=3), st.integers(1, 3)),
    ),
    Property("bad model call", kvbad.check_every_bad_model_call, kvbad.model_plans()),
    Property("lengths", kvchk.check_lengths, kvst.scenarios()),
    Property("contents", kvchk.check_contents, kvst.scenarios()),
    Property(
        "reset",
        kvchk.check_logits_match_uncached,
        kvst.scenarios(min_sessions=2, poison=True),
    ),
)
EXAMPLES_PER_PROPERTY = 20
CONTROL_EXAMPLES = 3  # the built-ins' own property tests search them in full


@pytest.mark.parametrize("mutant", kvmut.MUTANTS, ids=lambda mutant: mutant.name)
def test_suite_catches_mutant(mutant, record_property):
    catch = hunt(mutant, PROPERTIES, max_examples=EXAMPLES_PER_PROPERTY)
    assert catch is not None, (
        f"no property caught mutant {mutant.name} ({mutant.bug}) in "
        f"{EXAMPLES_PER_PROPERTY} examples each of {[prop.name for prop in PROPERTIES]}: "
        f"the suite cannot see this bug; strengthen tests/scenarios.py or add a property"
    )
    record_property("caught_by", catch.describe())
    print(f"{mutant.name} caught by {catch.describe()}\n{catch.example!r}")


@pytest.mark.parametrize("name", list(kvimpl.CACHES))
def test_hunt_spares_correct_caches(name):
    # Without this, a hunt that flagged everything would pass every test above.
    catch = hunt(kvmut.Mutant(kvimpl.CACHES[name]), PROPERTIES, max_examples=CONTROL_EXAMPLES)
    assert catch is None, (
        f"the hunt flags the correct built-in cache {name!r}: {catch.describe()}\n{catch.example!r}"
    )
