"""Reset: nothing from before a reset, or from a cache's earlier life, comes back.

- ``reset``: a session after one that left rows of nan, inf or huge values behind, on reset
  or fresh caches, matches the model (through the model, on both paths);
- ``stale rows``: one cache, dozens of rounds of poisoned rows, a reset (or a fresh cache),
  clean rows: what it returns (on the attend path, what it attends over) never includes a
  row from before the reset.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from hypothesis import strategies as st

from kvcheck import asserts as kvassert
from kvcheck import failures, reach
from kvcheck import scope as kvscope
from kvcheck import sizes as kvsizes
from kvcheck import strategies as kvst
from kvcheck import tensors as kvtensors
from kvcheck.harness import SPEC_EDGES, assert_served, give, note_spec, recorded, spec_on_path
from kvcheck.kit import KitTests, Property, property_test
from kvcheck.properties import core
from kvcheck.properties.core import POISONED_EDGES, check_logits_match_uncached
from kvcheck.properties.rejection import layer_specs, warm_ups
from kvcheck.strategies import cache_specs, chunk_plans
from kvcheck.tensors import POISON_VALUES
from kvref import CacheFactory, CacheSpec
from kvref.reprs import short_repr


@short_repr
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
        # Half the plans: a count of resets kept in a few bits shows only past its 8th reset.
        if kvsizes.large(draw, "long-lived cache", 2)
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
            bad = kvtensors.poison_rows(spec, rows, plan.poison)
            cache.append(bad, kvtensors.as_values(spec, bad))
        cache = clear(factory, cache, plan, spec, path, f"round #{round_}")
        for step, rows in enumerate(plan.clean):
            clean = kvtensors.random_rows(spec, rows, seed=step + round_)
            give(cache, clean, kvtensors.as_values(spec, clean, 2), seed=step)
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


POISON_KINDS = core.POISON_KINDS


def every_poisoned_scenario(scope: kvscope.Scope) -> Iterator[kvst.Scenario]:
    """Every scenario of 2 or 3 sessions (the strategy's most) within ``scope``, fewest
    tokens first, then by layout, then by shape: each session in every split into a prefill
    and decode chunks; the first on fresh caches, each later one on reset or fresh ones;
    every session but the last followed by 1 to 4 rows (the strategy's) of each poison kind
    (nan, inf, -inf, huge: each breaks another masking, so none stands for another). The
    tokens are every session's and every poison row; the buffers end where the longest
    session and its poison do (slack 0). Session i has token seed i: sessions of the same
    tokens would let old rows pass for new ones.

    Per layout, the plans of up to N tokens number the sum, over sessions of lengths
    a, b (, c) >= 1 and poison rows p (, q) in 1..4 within N, of 2^(a-1) 2^(b-1) x 2 x 4
    for two sessions and 2^(a-1) 2^(b-1) 2^(c-1) x 4 x 16 for three: 48 at N = 4, 1,152 at
    N = 6 (the test counts them another way)."""
    for total in range(1, scope.tokens + 1):
        for layout in scope.layouts:
            for count in (2, 3):
                yield from core.sentences_of_sessions(layout, scope, total, count)


def every_stale_rows_plan(scope: kvscope.Scope) -> Iterator[StaleRowsPlan]:
    """Every ``StaleRowsPlan`` within ``scope``, fewest tokens first, then by spec
    (``rejection.layer_specs``), then by shape: P poisoned and C clean rows (each >= 1) in
    every split into appends, a reset or a fresh cache, each poison kind (nan, inf, -inf,
    huge), and every number of rounds R the scope holds; max_length max(P, C), the least
    that holds both. The tokens are R x (P + C): every round feeds its rows again.

    Per spec, the plans of exactly t tokens number 8 x the sum, over R dividing t with
    m = t / R >= 2, of (m - 1) x 2^(m - 2) (the splits of P and of C with P + C = m): 8, 32,
    104, 256, 680 for t = 2..6, so 1,080 up to N = 6 and 144 up to N = 4."""
    specs = layer_specs(scope)
    for total in range(2, scope.tokens + 1):
        for fields in specs:
            for rounds in range(1, total // 2 + 1):
                if total % rounds:
                    continue
                rows = total // rounds
                for poisoned_rows in range(1, rows):
                    clean_rows = rows - poisoned_rows
                    spec = CacheSpec(max_length=max(poisoned_rows, clean_rows), **fields)
                    for poisoned in warm_ups(poisoned_rows, 1):
                        for clean in warm_ups(clean_rows, 1):
                            for how in ("reset", "fresh cache"):
                                for poison in POISON_KINDS:
                                    yield StaleRowsPlan(spec, poisoned, how, poison, clean, rounds)


RESET = Property(
    "reset",
    "after reset() or on fresh caches, a session after a poisoned one matches the model",
    check_logits_match_uncached,
    kvst.scenarios(min_sessions=2, poison=True),
    failures.WRONG_RESULTS,
    paths=True,
    pinned=kvst.PINNED[:1],
    reaches=POISONED_EDGES,
    every_plan=every_poisoned_scenario,
    exhaustive_tokens=6,
    since="1.0",
    holds=(
        "after `reset()` or on fresh caches, a session after one that left nan/inf/-inf/huge rows "
        "matches the uncached model"
    ),
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
    every_plan=every_stale_rows_plan,
    exhaustive_tokens=8,
    since="1.0",
    holds=(
        "rows written before a reset, even poisoned ones, never come back, through one cache "
        "object's many resets"
    ),
)


class ResetTests(KitTests):
    """Nothing from before a reset, or from a cache's earlier life, comes back."""

    test_poisoned_session_leaves_no_trace = property_test(RESET)
    test_rows_from_before_a_reset_never_come_back = property_test(STALE_ROWS)
