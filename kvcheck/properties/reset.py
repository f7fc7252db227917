"""Reset: nothing from before a reset, or from a cache's earlier life, comes back.

- ``reset``: a session after one that left rows of nan, inf or huge values behind, on reset
  or fresh caches, matches the model (through the model, on both paths);
- ``stale rows``: one cache, dozens of rounds of poisoned rows, a reset (or a fresh cache),
  clean rows: what it returns (on the attend path, what it attends over) never includes a
  row from before the reset.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hypothesis import strategies as st

from kvcheck import asserts as kvassert
from kvcheck import failures, reach
from kvcheck import sizes as kvsizes
from kvcheck import strategies as kvst
from kvcheck.harness import SPEC_EDGES, assert_served, give, note_spec, recorded, spec_on_path
from kvcheck.kit import KitTests, Property, property_test
from kvcheck.properties.core import POISONED_EDGES, check_logits_match_uncached
from kvcheck.strategies import POISON_VALUES, cache_specs, chunk_plans
from kvref import CacheFactory, CacheSpec


@dataclass(frozen=True)
class StaleRowsPlan:
    """A cache given rows full of ``poison``, then reset (or replaced by a fresh cache from
    the same factory), then given clean rows; all of it ``rounds`` times over (a long-lived
    cache object, reset dozens of times)."""

    spec: CacheSpec
    poisoned: tuple[int, ...]
    how: Literal["reset", "fresh cache"]
    poison: str
    clean: tuple[int, ...]
    rounds: int = 1

    def describe(self) -> str:
        rounds = f"; {self.rounds} rounds of it" if self.rounds > 1 else ""
        return (
            f"appends of {list(self.poisoned)} rows of {self.poison}, a {self.how}, then "
            f"appends of {list(self.clean)} clean rows{rounds}; {self.spec}"
        )

    def summary(self) -> tuple[str, str, str]:
        return self.describe(), "1 cache", str(self.spec.batch)


@st.composite
def stale_rows_plans(draw) -> StaleRowsPlan:
    spec = draw(cache_specs(), label="spec")
    return StaleRowsPlan(
        spec,
        poisoned=tuple(draw(chunk_plans(spec.max_length, min_chunks=1), label="poisoned")),
        how=draw(st.sampled_from(("reset", "fresh cache")), label="how"),
        poison=draw(st.sampled_from(sorted(POISON_VALUES)), label="poison"),
        clean=tuple(draw(chunk_plans(spec.max_length, min_chunks=1), label="clean")),
        rounds=draw(st.integers(9, kvsizes.LONG_LIVED), label="rounds")
        if kvsizes.large(draw, "long-lived cache", kvsizes.LONG_ONE_IN)
        else 1,
    )


def check_stale_rows(factory: CacheFactory, plan: StaleRowsPlan, *, path: str = "append") -> None:
    """Rows given before a reset (or to another cache), even nan, inf or huge ones, never
    come back."""
    spec = spec_on_path(plan.spec, path)
    cache = recorded(factory, spec, path)
    note_spec(spec)
    reach.note(f"a {plan.how} after poisoned rows", f"rows of {plan.poison} before it")
    if plan.rounds > 1:
        reach.note("dozens of resets")
    for round_ in range(plan.rounds):
        if round_:  # room for the poison: the last round's clean rows go the same way
            cache = clear(factory, cache, plan, spec, path, f"the start of round #{round_}")
        for rows in plan.poisoned:
            bad = kvst.poison_rows(spec, rows, plan.poison)
            cache.append(bad, kvst.as_values(spec, bad))
        cache = clear(factory, cache, plan, spec, path, f"round #{round_}")
        for step, rows in enumerate(plan.clean):
            clean = kvst.random_rows(spec, rows, seed=step + round_)
            give(cache, clean, kvst.as_values(spec, clean, 2), seed=step)
            where = f"clean {cache.path} #{step} of round #{round_} of {plan.describe()}"
            assert_served(cache, who="the cache", where=where)


def clear(factory: CacheFactory, cache, plan: StaleRowsPlan, spec, path, when: str):
    """The cache reset, or a fresh one from the factory, as the plan says: empty."""
    if plan.how == "reset":
        cache.reset()
    else:
        cache = recorded(factory, spec, path)
    kvassert.fail_if_not_empty([cache], f"{when} of {plan.describe()}")
    return cache


RESET = Property(
    "reset",
    "after reset() or on fresh caches, a session after a poisoned one matches the model",
    check_logits_match_uncached,
    kvst.scenarios(min_sessions=2, poison=True),
    failures.WRONG_RESULTS,
    paths=True,
    pinned=kvst.PINNED[:1],
    reaches=POISONED_EDGES,
)
STALE_ROWS = Property(
    "stale rows",
    "rows from before a reset (even nan, inf, huge) never come back",
    check_stale_rows,
    stale_rows_plans(),
    failures.DATA_LOSS,
    reaches=(
        *(reach.Edge(name) for name in SPEC_EDGES),
        *(reach.Edge(f"a {how} after poisoned rows") for how in ("reset", "fresh cache")),
        *(reach.Edge(f"rows of {kind} before it") for kind in sorted(POISON_VALUES)),
        reach.Edge("dozens of resets"),
    ),
    paths=True,
    attend_dtypes=kvst.DTYPES,  # attend's output judged at the dtype's tolerance
)


class ResetTests(KitTests):
    """Nothing from before a reset, or from a cache's earlier life, comes back."""

    test_poisoned_session_leaves_no_trace = property_test(RESET)
    test_rows_from_before_a_reset_never_come_back = property_test(STALE_ROWS)
