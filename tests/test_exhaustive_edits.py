"""The bounded-exhaustive enumerations of edits, rows of their own, context shift and sinks
(``every_plan`` of kvcheck/properties/edits.py, rows.py, shift.py and sinks.py): each counts
what its docstring says, fewest tokens first and each plan once; every plan at a few tokens
holds on a correct built-in cache; and a mutant the property catches is caught by one."""

from __future__ import annotations

import functools
import itertools
import math

import pytest

import kvimpl
from kvcheck import sizes as kvsizes
from kvcheck.plan_events import Feed, FeedRows, Shift, TruncateTo
from kvcheck.properties import edits, rows, shift, sinks
from kvcheck.scope import LAYOUTS, Scope
from tests import depth
from tests.exhaustive_runs import assert_caught, run_every


def fed(plan) -> int:
    """Every token a plan feeds, over all its rows, steps and sessions."""
    if isinstance(plan, edits.EditPlan):
        return plan.max_length  # prompt, chunks (no draft and no fork in these plans)
    if isinstance(plan, sinks.SinkPlan):
        return sum(session.length for session in plan.scenario.sessions)
    if isinstance(plan, shift.ShiftPlan):
        return sum(event.size for event in plan.events if isinstance(event, Feed))
    return sum(sum(event.counts) for event in plan.events if isinstance(event, FeedRows))


def with_sizes(factory):
    """The sizes of ``factory`` in force, as the runner does."""
    return kvsizes.aiming_at(kvsizes.declared_on(factory))


def plans_of(prop, tokens: int, factory=None) -> list:
    if factory is None:
        return list(prop.every_plan(Scope(tokens)))
    with with_sizes(factory):
        return list(prop.every_plan(Scope.within_domain(tokens)))


def per_layout(counts_at, tokens: int, layouts=LAYOUTS) -> int:
    """The plans of up to ``tokens`` tokens over ``layouts``, ``counts_at(n, layout)`` each."""
    return sum(counts_at(n, layout) for n in range(1, tokens + 1) for layout in layouts)


def batch_of(layout, least=1) -> int:
    return max(layout.batch, least)


# --- Counts against closed forms (or another count) ---


@pytest.mark.parametrize("tokens", range(1, 6))
def test_truncate_plans_count(tokens):
    def closed(n, layout):
        return 2**n * (n * n + 5 * n + 2) // 8  # 2^(n-3) (n^2 + 5n + 2)

    assert len(plans_of(edits.TRUNCATE, tokens)) == per_layout(closed, tokens)


@pytest.mark.parametrize("tokens", range(1, 6))
def test_reorder_plans_count(tokens):
    def closed(n, layout):
        b = batch_of(layout, 2)
        return b**b * 2**n * (n + 1) // 4

    assert len(plans_of(edits.REORDER, tokens)) == per_layout(closed, tokens)


@pytest.mark.parametrize("tokens", range(1, 5))
def test_mixed_edit_plans_count(tokens):
    def closed(n, layout):
        b = batch_of(layout, 2)
        return b**b * 2**n * (n * n + 5 * n + 2) // 4

    assert len(plans_of(edits.EDITS, tokens)) == per_layout(closed, tokens)


def test_edit_plans_have_one_moment_of_edits_within_the_history():
    for prop in (edits.TRUNCATE, edits.REORDER, edits.EDITS):
        for plan in plans_of(prop, 4):
            held, moments, after_feed = plan.prompt, 0, True
            for step in plan.steps:
                if isinstance(step, Feed):
                    held += step.size
                else:
                    moments += after_feed
                    if isinstance(step, TruncateTo):
                        assert 0 <= step.position <= held
                        held = step.position
                    else:
                        assert len(step.indices) == plan.batch
                after_feed = isinstance(step, Feed)
            assert moments == 1, plan
    # Every index tuple of a batch of 2 at one point, the identity and repeats too.
    reorders = {
        plan.steps[0].indices for plan in plans_of(edits.REORDER, 1) if plan.config.num_layers == 1
    }
    assert reorders == {(0, 0), (0, 1), (1, 0), (1, 1)}


def vector_compositions(n: int, batch: int) -> int:
    """Inclusion-exclusion: k calls of ``batch`` counts summing to n, none all idle."""
    return sum(
        (-1) ** j * math.comb(k, j) * math.comb(n + (k - j) * batch - 1, (k - j) * batch - 1)
        for k in range(1, n + 1)
        for j in range(k + 1)
        if k > j  # C(n - 1, -1): no call of 0 counts feeds n >= 1 tokens
    )


def test_row_feeds_count():
    assert [vector_compositions(n, 2) for n in range(1, 7)] == [2, 7, 24, 82, 280, 956]
    for n in range(3, 8):  # the recurrence of the docstring
        assert vector_compositions(n, 2) == 4 * vector_compositions(
            n - 1, 2
        ) - 2 * vector_compositions(n - 2, 2)
    for batch in (2, 3):
        for n in range(1, 6):
            feeds = list(rows.row_feeds(n, batch))
            assert len(feeds) == len(set(feeds)) == vector_compositions(n, batch)
            for calls in feeds:
                counts = [feed.counts for feed in calls]
                assert sum(map(sum, counts)) == n, calls
                assert all(map(any, counts)), calls


@pytest.mark.parametrize("tokens", range(1, 6))
def test_rows_plans_count(tokens):
    def closed(n, layout):
        return vector_compositions(n, batch_of(layout, 2))

    assert len(plans_of(rows.MIXED_LENGTHS, tokens)) == per_layout(closed, tokens)


def shift_count(n: int, most: int) -> int:
    """Plans of n tokens a layout, counted by the lengths held, not by making them."""

    @functools.cache
    def after_feed(left: int, held: int, shifts: int) -> int:
        if not left:
            return int(shifts > 0)
        total = 0
        for chunk in range(1, left + 1):
            total += after_feed(left - chunk, held + chunk, shifts)
            if shifts < most:
                for start in range(held):
                    for count in range(1, held - start + 1):
                        total += after_feed(left - chunk, held - count + chunk, shifts + 1)
        return total

    return sum(after_feed(n - prompt, prompt, 0) for prompt in range(1, n + 1))


def test_shifted_feeds_count():
    for n in range(1, 8):
        one = len(list(shift.shifted_feeds(n, most=1)))
        assert one == shift_count(n, 1) == 2**n * (n - 1) * n * (n + 1) // 24
    assert [shift_count(n, 2) for n in range(2, 7)] == [1, 9, 62, 388, 2184]


@pytest.mark.parametrize("tokens", range(1, 6))
def test_shift_plans_count(tokens):
    plans = plans_of(shift.CONTEXT_SHIFT, tokens)
    assert len(plans) == per_layout(lambda n, _: shift_count(n, shift.MOST_SHIFTS), tokens)
    for plan in plans:  # every span within what is held, the caches built to the most held
        held = 0
        for event in plan.events:
            if isinstance(event, Shift):
                assert 0 <= event.start < held
                assert 1 <= event.count <= held - event.start
            held += event.size if isinstance(event, Feed) else -event.count
            assert held <= plan.max_length
        assert isinstance(plan.events[-1], Feed)


def row_shift_count(n: int, batch: int) -> int:
    """Plans of n tokens for ``batch`` rows, counted by the lengths held."""

    @functools.cache
    def after_feed(left: int, held: tuple[int, ...], shifts: int) -> int:
        if not left:
            return int(shifts > 0)
        total = 0
        for chunk in range(1, left + 1):
            for counts in rows.row_counts(chunk, batch):
                grown = tuple(h + c for h, c in zip(held, counts, strict=True))
                total += after_feed(left - chunk, grown, shifts)
                if shifts < shift.MOST_ROW_SHIFTS:
                    for kept in itertools.product(*(range(h + 1) for h in held)):
                        # A row keeping k of its h tokens: untouched (k = h), or a span of
                        # h - k tokens from any of the k + 1 starts 0..k.
                        ways = math.prod(
                            1 if k == h else k + 1 for h, k in zip(held, kept, strict=True)
                        )
                        if kept == held:
                            continue  # no row moved
                        after = tuple(k + c for k, c in zip(kept, counts, strict=True))
                        total += ways * after_feed(left - chunk, after, shifts + 1)
        return total

    return sum(
        after_feed(n - prompt, counts, 0)
        for prompt in range(1, n + 1)
        for counts in rows.row_counts(prompt, batch)
    )


@pytest.mark.parametrize("tokens", range(1, 5))
def test_row_shift_plans_count(tokens):
    plans = plans_of(shift.CONTEXT_SHIFT_PER_ROW, tokens)
    want = per_layout(lambda n, layout: row_shift_count(n, batch_of(layout, 2)), tokens)
    assert len(plans) == want
    if tokens == 5 - 1:
        assert [row_shift_count(n, 2) for n in range(1, 6)] == [0, 4, 56, 515, 3928]


@pytest.mark.parametrize("tokens", range(1, 7))
def test_sink_plans_count(tokens):
    factory = kvimpl.StreamingCache
    counts = (1, 2, 4, 8)  # what it declares beside 0

    def closed(n, layout):
        return 2 * 2 ** (n - 1) * sum(n - s for s in counts if s < n)

    plans = plans_of(sinks.ATTENTION_SINKS, tokens, factory)
    with with_sizes(factory):
        layouts = Scope.within_domain(tokens).layouts
        assert kvsizes.domain().sink_counts == (0, *counts)
    assert len(plans) == per_layout(closed, tokens, layouts)
    for plan in plans:
        config = plan.scenario.config
        assert 0 < config.sinks < fed(plan)
        assert 1 <= config.window <= fed(plan) - config.sinks


def test_no_sink_plans_where_no_sinks_are_declared():
    assert plans_of(sinks.ATTENTION_SINKS, 5) == []


# --- Fewest tokens first, each plan once ---

PROPERTIES = {
    "truncate": (edits.TRUNCATE, None),
    "reorder": (edits.REORDER, None),
    "truncate and reorder": (edits.EDITS, None),
    "mixed lengths": (rows.MIXED_LENGTHS, None),
    "context shift": (shift.CONTEXT_SHIFT, None),
    "context shift per row": (shift.CONTEXT_SHIFT_PER_ROW, None),
    "attention sinks": (sinks.ATTENTION_SINKS, kvimpl.StreamingCache),
}


@pytest.mark.parametrize("name", PROPERTIES)
def test_fewest_tokens_first_each_plan_once(name):
    prop, factory = PROPERTIES[name]
    assert prop.every_plan is not None
    assert prop.exhaustive_tokens >= 2
    plans = plans_of(prop, 4, factory)
    tokens = [fed(plan) for plan in plans]
    assert plans
    assert tokens == sorted(tokens)
    assert max(tokens) <= 4
    assert len(set(plans)) == len(plans)
    # Within each count of tokens, the scope's layouts in order.
    for n in set(tokens):
        layers = [plan for plan, t in zip(plans, tokens, strict=True) if t == n]
        order = [layout_index(plan) for plan in layers]
        assert order == sorted(order)
    # The plans of fewer tokens are the first ones of a larger scope, in the same order.
    fewer = plans_of(prop, 3, factory)
    assert plans[: len(fewer)] == fewer


def layout_index(plan) -> int:
    config = plan.scenario.config if isinstance(plan, sinks.SinkPlan) else plan.config
    shape = (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim)
    window = config.window is not None and config.window_layers == "alternate"
    for index, layout in enumerate(LAYOUTS):
        if (layout.layers, layout.heads, layout.kv_heads, layout.head_dim) == shape and (
            window == (layout.window is not None)
        ):
            return index
    raise AssertionError(f"no layout for {config}")


# --- Every plan at a few tokens holds on a correct cache ---
# (fewer tokens in the default run where the plans cost most; --soak runs the full counts)

HOLDS = [
    ("truncate", kvimpl.ConcatCache, depth.pick(2, soak=3)),
    ("truncate", kvimpl.WindowCache, depth.pick(2, soak=3)),
    ("reorder", kvimpl.ConcatCache, depth.pick(2, soak=3)),
    ("truncate and reorder", kvimpl.PreallocatedCache, depth.pick(1, soak=2)),
    ("mixed lengths", kvimpl.PreallocatedCache, depth.pick(2, soak=3)),
    ("context shift", kvimpl.PreallocatedCache, 3),
    ("context shift", kvimpl.UnrotatedCache, 3),
    ("context shift per row", kvimpl.PreallocatedCache, depth.pick(2, soak=3)),
    ("attention sinks", kvimpl.StreamingCache, depth.pick(2, soak=3)),
]


@pytest.mark.parametrize(("name", "factory", "tokens"), HOLDS)
def test_every_plan_holds_on_a_correct_cache(name, factory, tokens):
    assert run_every(PROPERTIES[name][0], factory, tokens) > 0


# --- A mutant the property catches is caught by a plan of the enumeration ---

CAUGHT = [
    ("truncate", "TruncateKeepsRows", 3),
    ("reorder", "ReorderIgnoresRepeats", 3),
    ("truncate and reorder", "TruncateDropsPendingReorder", 2),
    ("mixed lengths", "IdleRowAdvancedByNeighbour", 3),
    ("context shift", "ShiftRotatesByTheWrongDelta", 3),
    ("context shift per row", "RowShiftMovesTheWrongRow", 3),
    ("attention sinks", "SinkEvictedOnWrap", 4),
    ("attention sinks", "SinksMaskedOnceWrapped", 4),  # the attend path alone shows it
]


@pytest.mark.parametrize(("name", "mutant_name", "tokens"), CAUGHT)
def test_a_mutant_is_caught_by_some_plan(name, mutant_name, tokens):
    assert_caught(PROPERTIES[name][0], mutant_name, tokens)
