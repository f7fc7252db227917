"""Hunting a mutant: search each property with Hypothesis until one of them fails.

What counts as a catch:

- an ``AssertionError`` from a check: the property itself is violated;
- a ``kvref.CacheContractError``: the reference model's own guards refused what the cache
  did (same object for two layers, layers of different lengths, ``append`` returning the
  wrong number of rows). These guards are part of the oracle (docs/contract.md, "Calls the
  model refuses itself"), so a mutant they stop is stopped by the suite.

Anything else (a ``TypeError`` in a check, a torch error inside a cache, a ``ValueError`` a
cache raises for valid input) is a crash, not a catch: it stops the hunt with ``Crashed``,
since it says more about the mutant or the suite than about the property under test.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypothesis import Phase, find, settings
from hypothesis.errors import NoSuchExample

from kvcheck import sizes as kvsizes
from kvcheck.kit import Property
from kvcheck.properties import ALL
from kvcheck.properties.core import LOGITS
from kvref import CacheContractError, CacheFactory
from tests import depth
from tests.mutants import Mutant

# The hunt's order: logits first (it catches anything that changes what the model computes),
# then the capability properties (the core ones never call truncate or reorder, so a mutant
# of those would otherwise pay for every core search first), then the rest in ALL's order.
# A property whose examples share a context (the processes of ``sharded runtime``) is not
# hunted: started afresh for every example it would cost a group start each, and ``sharded``
# searches the same plans in one process (tests/test_sharded_runtime.py runs the runtime on
# the shard mutants).
HUNT_ORDER = sorted(
    (prop for prop in ALL if prop.context is None),
    key=lambda prop: (prop is not LOGITS, not prop.requires),
)

# The hunt of tests/test_mutants.py: a first pass of a few examples through every property
# catches most mutants cheaply; only the rest pay for the full search of each in turn.
QUICK_EXAMPLES = 3
EXAMPLES_PER_PROPERTY = 20

# The property that caught each mutant in the last run of that hunt, tried first in full:
# most mutants then cost one search instead of a pass through every property. Written by
# ``python -m tests.mutants.report --first-catches``; a mutant missing from it, or caught
# since by another property, is hunted in the usual order, only slower.
FIRST_CATCHES_FILE = Path(__file__).with_name("first_catches.json")
FIRST_CATCHES: dict[str, str] = (
    json.loads(FIRST_CATCHES_FILE.read_text()) if FIRST_CATCHES_FILE.exists() else {}
)


@dataclass(frozen=True)
class Catch:
    property: str
    example: Any  # what the strategy drew, shrunk when the search shrinks
    error: BaseException

    @property
    def by_model_guard(self) -> bool:
        return not isinstance(self.error, AssertionError)

    def describe(self) -> str:
        guard = " (the reference model's guard)" if self.by_model_guard else ""
        first_line = str(self.error).strip().splitlines()[0]
        return f"{self.property}{guard}: {type(self.error).__name__}: {first_line}"


class Crashed(Exception):
    """A run raised something that is neither a property failure nor a model guard."""


def hunt(
    mutant: Mutant,
    properties: Sequence[Property],
    *,
    max_examples: int,
    shrink: bool = False,
    pinned: bool = True,
    quick: int = 0,
    first: str | None = None,
) -> Catch | None:
    """The first property, in order, under which Hypothesis finds the mutant out, or None
    when none does within ``max_examples`` examples each. With ``quick``, a first pass gives
    each property only that many examples: most mutants fall in it, and the full search
    of every property is paid only by those that need it. ``first`` names a property to
    search in full before any other (the one that caught the mutant last time,
    ``FIRST_CATCHES``): it orders the search and changes nothing else, so a stale name
    costs time, never a catch."""
    passes = [budget for budget in (quick, max_examples) if 0 < budget <= max_examples]
    leading = [(max_examples, prop) for prop in properties if prop.name == first]
    searches = [
        *leading,
        *((budget, prop) for budget in dict.fromkeys(passes) for prop in properties),
    ]
    # The sizes the factory declares, as every run of the kit aims at them.
    with mutant.patch(), kvsizes.aiming_at(kvsizes.declared_by(mutant.factory)):
        for budget, prop in searches:
            if prop.strategy is None:  # a state machine: it draws for itself
                continue
            if prop.not_offered(mutant.factory):
                continue  # as in a run of the kit: "not offered", neither pass nor catch
            catch = search(mutant.factory, prop, max_examples=budget, shrink=shrink, pinned=pinned)
            if catch is not None:
                return catch
    return None


def hunt_as_tested(mutant: Mutant) -> Catch | None:
    """The hunt of tests/test_mutants.py: the last catch first, then the quick pass, then the
    full search."""
    return hunt(
        mutant,
        HUNT_ORDER,
        max_examples=EXAMPLES_PER_PROPERTY,
        quick=QUICK_EXAMPLES,
        first=FIRST_CATCHES.get(mutant.name),
    )


def crashed(prop: Property, error: Exception) -> Crashed:
    """What stops a hunt when a run of ``prop`` raised ``error``, neither a failure nor a
    model guard's refusal: a crash, not a catch."""
    return Crashed(
        f"not a catch: while searching property {prop.name!r}, a run crashed with "
        f"{type(error).__name__}: {error}"
    )


def search(
    factory: CacheFactory,
    prop: Property,
    *,
    max_examples: int,
    shrink: bool = False,
    pinned: bool = True,
) -> Catch | None:
    """Run Hypothesis on one property until it fails; shrink the failure when asked. With
    ``pinned``, the property's pinned inputs are tried first, as every run of the kit does."""
    errors: list[BaseException] = []

    def fails(example: Any) -> bool:
        try:
            prop.check_all_cases(factory, example)
        except (AssertionError, CacheContractError) as error:
            errors.append(error)
            return True
        return False

    # Every run of the kit tries a property's pinned inputs (past catches) first: so does
    # the hunt, and only then searches; those outside the cache's domain are left out.
    for example in prop.pinned if pinned else ():
        try:
            if fails(example):
                return Catch(prop.name, example, errors[-1])
        except kvsizes.OutsideDomain:
            continue
        except Exception as error:  # a pinned input crashes the run as a drawn one does
            raise crashed(prop, error) from error
    # No example database: a catch must come from this run's search, not a replay of an
    # earlier one. Shrinking is off unless asked for: a test only needs to know it failed.
    # Derandomized in the default tier: the same examples under any seed, as in CI, so that
    # a newcomer's run costs what CI's does (random, a size mutant's hunt took up to 28 s);
    # under --soak, the run's seed, so that the soak tier searches anew each time.
    phases = [Phase.explicit, Phase.generate, *([Phase.shrink] if shrink else [])]
    chosen = settings(
        max_examples=max_examples, phases=phases, database=None, derandomize=not depth.SOAK
    )
    try:
        example = find(prop.strategy, fails, settings=chosen)
    except NoSuchExample:
        return None
    except Exception as error:
        raise crashed(prop, error) from error
    return Catch(prop.name, example, errors[-1])  # find's last call is on the example it returns
