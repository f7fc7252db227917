"""The bounded-exhaustive enumerations of one cache's reset, isolation, memory and bad input
(``every_plan`` of kvcheck/properties/reset.py, isolation.py, memory.py, rejection.py, and
of the bad-input properties of edits.py, moves.py and shift.py): each counts what its
docstring says (against a count made another way), runs fewest tokens first and yields each
plan once; every plan at a few tokens holds on a correct built-in cache, every case of its
table; and a mutant of the catalogue the property catches is caught by one of them."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import kvimpl
from kvcheck import strategies as kvst
from kvcheck.properties import edits, isolation, memory, moves, rejection, reset, shift
from kvcheck.scope import LAYOUTS, Scope
from kvimpl.chunked import ChunkedCache
from kvimpl.latent import LatentCache
from tests.exhaustive_runs import assert_caught, by_property, run_every

# The cache specs of the default layouts: (1, 1), (2, 2) (twice: query heads are not in a
# spec), and the window layout's two layers (window 2 and global), batch 1, 2 kv heads.
SPECS = 4
LATENT_SPECS = 3  # one kv head each: batch 1, batch 2, batch 1 with the window


def splits_of(n: int, least: int = 1) -> set[tuple[int, ...]]:
    """Every tuple of positive sizes summing to ``n``, made by brute force (the empty one for
    0 where ``least`` is 0)."""
    if n == 0:
        return {()} if least == 0 else set()
    return {
        chunks
        for k in range(max(least, 1), n + 1)
        for chunks in itertools.product(range(1, n + 1), repeat=k)
        if sum(chunks) == n
    }


def c(n: int, least: int = 0) -> int:
    """The splits of ``n`` rows into appends: 2^(n-1), and 1 (no append) for 0."""
    return len(splits_of(n, least))


def fed(prop, plan) -> int:
    """Every token ``plan`` feeds its caches, counted from the plan itself."""
    if isinstance(plan, kvst.Scenario):
        return sum(s.length + s.poison_rows for s in plan.sessions)
    if isinstance(plan, reset.StaleRowsPlan):
        return plan.rounds * (sum(plan.poisoned) + sum(plan.clean))
    if isinstance(plan, isolation.IsolationPlan):
        return sum(map(sum, plan.chunks)) + 2
    if isinstance(plan, kvst.ModelPlan):
        return sum(plan.chunks)
    if isinstance(plan, shift.WarmRows):
        return sum(plan.lengths)
    if prop is rejection.OVERFLOW:  # the overflowing append: the room and new_tokens more
        return plan.spec.max_length + plan.new_tokens
    if prop in (rejection.BAD_APPEND, rejection.BAD_LATENT_ATTEND):
        return plan.warm_length + plan.new_tokens
    return plan.warm_length


ENUMERATED = [
    (reset.RESET, 4),
    (reset.STALE_ROWS, 4),
    (isolation.ISOLATION, 6),
    (memory.MEMORY, 6),
    (rejection.BAD_APPEND, 6),
    (rejection.OVERFLOW, 6),
    (rejection.BAD_MODEL_CALL, 5),
    (rejection.BAD_LATENT_ATTEND, 6),
    (edits.BAD_TRUNCATE, 6),
    (edits.BAD_REORDER, 6),
    (moves.BAD_IMPORT, 6),
    (shift.BAD_SHIFT_PER_ROW, 8),
]


@pytest.mark.parametrize(("prop", "tokens"), **by_property(ENUMERATED))
def test_plans_run_fewest_tokens_first_each_once(prop, tokens):
    plans = list(prop.every_plan(Scope(tokens)))
    totals = [fed(prop, plan) for plan in plans]
    assert totals == sorted(totals), "plans do not run fewest tokens first"
    assert max(totals) <= tokens
    assert len(set(plans)) == len(plans), "a plan is yielded twice"
    dtypes = {getattr(plan, "dtype", None) or plan.spec.dtype for plan in plans}
    assert dtypes == {torch.float64}


# --- Counts against closed forms or counts made another way ---


def poisoned_count(tokens: int) -> int:
    """The reset scenarios per layout, counted by brute force over lengths and poison rows."""
    total = 0
    for count in (2, 3):
        for lengths in itertools.product(range(1, tokens + 1), repeat=count):
            for poisons in itertools.product(range(1, 5), repeat=count - 1):
                if sum(lengths) + sum(poisons) <= tokens:
                    splits = math.prod(c(n) for n in lengths)
                    total += splits * (2 * 4) ** (count - 1)  # start and kind of each later
    return total


@pytest.mark.parametrize("tokens", range(1, 7))
def test_reset_plans_count(tokens):
    plans = list(reset.every_poisoned_scenario(Scope(tokens)))
    assert len(plans) == len(LAYOUTS) * poisoned_count(tokens)
    assert poisoned_count(tokens) == {4: 48, 6: 1152}.get(tokens, poisoned_count(tokens))
    for plan in plans:
        assert plan.sessions[0].start == "fresh"
        assert plan.sessions[-1].poison is None
        assert all(s.poison and 1 <= s.poison_rows <= 4 for s in plan.sessions[:-1])
        assert [s.token_seed for s in plan.sessions] == list(range(len(plan.sessions)))
        assert plan.slack == 0


@pytest.mark.parametrize("tokens", range(1, 9))
def test_stale_rows_plans_count(tokens):
    def closed(t):
        return 8 * sum(
            (m - 1) * 2 ** (m - 2) for r in range(1, t + 1) if t % r == 0 and (m := t // r) >= 2
        )

    plans = list(reset.every_stale_rows_plan(Scope(tokens)))
    assert len(plans) == SPECS * sum(closed(t) for t in range(1, tokens + 1))
    # Another way: every pair of splits, for every number of rounds.
    brute = sum(
        len(splits_of(p)) * len(splits_of(t // r - p)) * 8
        for t in range(1, tokens + 1)
        for r in range(1, t + 1)
        if t % r == 0
        for p in range(1, t // r)
    )
    assert len(plans) == SPECS * brute
    assert all(p.spec.max_length == max(sum(p.poisoned), sum(p.clean)) for p in plans)


@pytest.mark.parametrize("tokens", range(1, 9))
def test_isolation_plans_count(tokens):
    def closed(m):
        k = m - 2
        return 1 if k == 0 else (k + 3) * 2**k // 4

    brute = [sum(c(a) * c(m - 2 - a) for a in range(m - 1)) for m in range(2, tokens + 1)]
    plans = list(isolation.every_isolation_plan(Scope(tokens)))
    assert brute == [closed(m) for m in range(2, tokens + 1)]
    assert len(plans) == SPECS * sum(brute)
    assert all(p.spec.max_length == max(map(sum, p.chunks)) + 1 for p in plans)


@pytest.mark.parametrize("tokens", range(1, 9))
def test_memory_plans_count(tokens):
    plans = list(memory.every_memory_plan(Scope(tokens)))
    assert len(plans) == SPECS * (2**tokens - 1)
    assert all(p.spec.max_length == p.warm_length and p.chunks for p in plans)


@pytest.mark.parametrize("tokens", range(1, 9))
def test_bad_append_plans_count(tokens):
    def closed(t):
        return {1: 1, 2: 2, 3: 4}.get(t) or 7 * 2 ** (t - 4)

    brute = [sum(c(t - n) for n in range(1, min(3, t) + 1)) for t in range(1, tokens + 1)]
    assert brute == [closed(t) for t in range(1, tokens + 1)]
    plans = list(rejection.every_bad_append(Scope(tokens)))
    assert len(plans) == SPECS * sum(brute)
    assert all(p.spec.max_length == p.warm_length + 3 for p in plans)
    latent = list(rejection.every_latent_plan(Scope(tokens)))
    assert len(latent) == LATENT_SPECS * sum(brute)
    assert {(p.spec.kv_heads, p.spec.head_dim, p.spec.value_dim) for p in latent} == {(1, 2, 6)}


@pytest.mark.parametrize("tokens", range(1, 9))
def test_overflow_plans_count(tokens):
    brute = sum(
        c(t - room - new)
        for t in range(1, tokens + 1)
        for room in range(1, t + 1)
        for new in range(1, 4)
        if t - room - new >= 0
    )
    plans = list(rejection.every_overflow(Scope(tokens)))
    assert len(plans) == SPECS * brute
    assert {p.spec.max_length - p.warm_length for p in plans} == set(range(1, tokens))


@pytest.mark.parametrize("tokens", range(0, 9))
def test_refusal_and_import_plans_count(tokens):
    scope = Scope(max(tokens, 1))
    refusals = [p for p in rejection.every_refusal(scope) if p.warm_length <= tokens]
    assert len(refusals) == SPECS * 2**tokens  # 1 + (2^1 - 1) + ... : the empty cache first
    assert refusals[0].chunks == ()
    imports = [p for p in rejection.every_import(scope) if p.warm_length <= tokens]
    assert len(imports) == SPECS * (2**tokens - 1)
    assert all(p.new_tokens == 1 and p.spec.max_length == p.warm_length + 1 for p in refusals)


@pytest.mark.parametrize("tokens", range(1, 7))
def test_model_plans_count(tokens):
    plans = list(rejection.every_model_plan(Scope(tokens)))
    # Every default layout has 2 layers (the 1-layer one raised to 2): 2 x (2^N - 1) each.
    assert len(plans) == len(LAYOUTS) * 2 * (2**tokens - 1)
    assert {p.config.num_layers for p in plans} == {2}
    assert {p.layer for p in plans} == {0, 1}


@pytest.mark.parametrize("tokens", range(1, 11))
def test_warm_rows_count(tokens):
    def brute(t):
        return sum(
            1
            for rows in (2, 3)
            for lengths in itertools.product(range(1, t + 1), repeat=rows)
            if sum(lengths) == t and len(set(lengths)) == rows
        )

    def closed(t):
        pairs = t - 1 - (t % 2 == 0)
        triples = sum(1 for a in range(1, t) for b in range(a + 1, t) if t - a - b > b)
        return max(pairs, 0) + 6 * triples

    plans = list(shift.every_warm_rows(Scope(tokens)))
    assert [brute(t) for t in range(1, tokens + 1)] == [closed(t) for t in range(1, tokens + 1)]
    assert len(plans) == len(LAYOUTS) * sum(closed(t) for t in range(1, tokens + 1))
    assert len(plans) // len(LAYOUTS) == {4: 4, 6: 18, 8: 48}.get(tokens, len(plans) // 4)
    assert {p.config.num_layers for p in plans} <= {1}


# --- Every plan at a few tokens holds on a correct built-in ---

HOLDS = [
    (reset.RESET, ChunkedCache, 3),
    (reset.STALE_ROWS, ChunkedCache, 3),
    (isolation.ISOLATION, ChunkedCache, 4),
    (memory.MEMORY, kvimpl.PreallocatedCache, 4),
    (rejection.BAD_APPEND, kvimpl.ConcatCache, 3),
    (rejection.OVERFLOW, kvimpl.PreallocatedCache, 4),
    (rejection.BAD_MODEL_CALL, kvimpl.ConcatCache, 2),
    (rejection.BAD_LATENT_ATTEND, LatentCache, 3),
    (edits.BAD_TRUNCATE, kvimpl.ConcatCache, 4),
    (edits.BAD_REORDER, kvimpl.ConcatCache, 4),
    (moves.BAD_IMPORT, kvimpl.ConcatCache, 4),
    (shift.BAD_SHIFT_PER_ROW, kvimpl.PreallocatedCache, 4),
]


@pytest.mark.parametrize(("prop", "factory", "tokens"), **by_property(HOLDS))
def test_every_plan_holds_on_a_correct_cache(prop, factory, tokens):
    assert run_every(prop, factory, tokens) > 0


# --- A mutant the property catches is caught by one of its plans ---

CATCHES = [
    (reset.RESET, "StaleRowsAfterReset", 3),
    (reset.STALE_ROWS, "StaleRowsAfterReset", 3),
    (isolation.ISOLATION, "SharedStorage", 3),
    (memory.MEMORY, "CountsKeysOnly", 2),
    (rejection.BAD_APPEND, "VagueErrors", 2),
    (rejection.OVERFLOW, "WrapsAtCapacity", 3),
    (shift.BAD_SHIFT_PER_ROW, "RowShiftChecksAgainstTheLongestRow", 6),
]


@pytest.mark.parametrize(("prop", "name", "tokens"), **by_property(CATCHES))
def test_a_mutant_is_caught_by_a_plan(prop, name, tokens):
    assert_caught(prop, name, tokens)
