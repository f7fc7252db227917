"""The bounded-exhaustive enumerations of attention beyond one plain cache (``every_plan`` of
kvcheck/properties/attend.py, shared.py, tree.py and sharded.py: ``attend``, ``latent
attend``, the three ``shared layers`` properties, ``tree drafts``, ``sharded`` and ``sharded
runtime``): each counts what its docstring says, held to a brute force over a simpler
generator (every sequence filtered by the docstring's rules) where it gives no closed form;
fewest tokens first and each plan once; every plan at a few tokens holds on a correct
built-in cache, every path it offers; and a mutant of the catalogue the property catches is
caught by one of them."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import pytest
import torch

import kvimpl
from kvcheck import sizes as kvsizes
from kvcheck.plan_events import Feed, FeedRows, Fork, Reorder, Reset, Truncate
from kvcheck.properties import attend, sharded, shared, tree
from kvcheck.scope import LAYOUTS, Scope
from kvimpl.chunked import ChunkedCache
from kvimpl.latent import LatentCache
from kvimpl.streaming import StreamingCache
from tests import depth
from tests.exhaustive_runs import assert_caught, by_property, run_every

SHARED_MODELS = 3  # the default layouts of 2 layers, each with its one kv_sources, (None, 0)


def fed(plan) -> int:
    """Every token a plan feeds, as its enumerator's docstring counts them."""
    if isinstance(plan, attend.AttendPlan | attend.LatentAttendPlan):
        return sum(size for _, size in plan.calls)
    if isinstance(plan, shared.SharedPlan):
        return sum(plan.chunks)  # the prompt's (fed three ways: the check, not the plan)
    if isinstance(plan, shared.SharedRowsPlan):
        return sum(sum(event.counts) for event in plan.events if isinstance(event, FeedRows))
    if isinstance(plan, shared.SharedTreePlan):
        return sum(plan.prefix) + len(plan.parents) + plan.after
    if isinstance(plan, tree.TreePlan):
        (round_,) = plan.rounds
        return sum(plan.prefix) + len(round_.parents) + round_.fed_after
    return sum(event.size for event in plan.events if isinstance(event, Feed))  # sharded


def plans_of(prop, tokens: int, factory=None) -> list:
    """The plans of ``prop`` to ``tokens`` tokens, in the default scope or, given a factory,
    in its domain (as the runner enumerates them)."""
    if factory is None:
        return list(prop.every_plan(Scope(tokens)))
    with kvsizes.aiming_at(kvsizes.declared_by(factory)):
        return list(prop.every_plan(Scope.within_domain(tokens)))


def splits_of(n: int) -> list[tuple[int, ...]]:
    """Every tuple of positive sizes summing to ``n``, by brute force."""
    return [
        chunks
        for k in range(1, n + 1)
        for chunks in itertools.product(range(1, n + 1), repeat=k)
        if sum(chunks) == n
    ]


def trees_of(nodes: int, most_roots: int = tree.MAX_ROOTS) -> list[tuple[int, ...]]:
    """Every parent tuple of ``nodes`` nodes (each parent an earlier node, or -1 for a root),
    by brute force over every tuple of -1..nodes-1."""
    return [
        parents
        for parents in itertools.product(range(-1, nodes), repeat=nodes)
        if all(parent < node for node, parent in enumerate(parents))
        and parents.count(-1) <= most_roots
    ]


def paths_of(parents: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every path a row may accept: none, or a root down to any node."""

    def up(node: int) -> tuple[int, ...]:
        return () if node == -1 else (*up(parents[node]), node)

    return [(), *(up(node) for node in range(len(parents)))]


# --- attend and latent attend: every sequence of calls ---


def test_every_calls_is_every_sequence_of_calls():
    for tokens in range(1, 7):
        for last in ("attend", "attend_latent"):
            got = list(attend.every_calls(tokens, last))
            brute = {
                tuple(zip(kinds, sizes, strict=True))
                for sizes in splits_of(tokens)
                for kinds in itertools.product(("append", last), repeat=len(sizes))
                if kinds[-1] == last
            }
            assert len(got) == len(set(got)) == 3 ** (tokens - 1), f"{tokens} rows, {last}"
            assert set(got) == brute, f"{tokens} rows ending in {last}: not every sequence"


@pytest.mark.parametrize("tokens", range(1, 6))
def test_attend_plans_count(tokens):
    def closed(n, layout, sinks):
        return 2 * 3 ** (n - 1) * (2 if layout.window and sinks else 1)

    plans = plans_of(attend.ATTEND, tokens)
    assert len(plans) == sum(
        closed(n, layout, False) for n in range(1, tokens + 1) for layout in LAYOUTS
    )
    assert {plan.spec.sinks for plan in plans} == {0}
    # A cache that declares sinks: the window layout's plans again, with its smallest count.
    sinking = plans_of(attend.ATTEND, tokens, StreamingCache)
    with kvsizes.aiming_at(kvsizes.declared_by(StreamingCache)):
        layouts = Scope.within_domain(tokens).layouts
    assert len(sinking) == sum(
        closed(n, layout, True) for n in range(1, tokens + 1) for layout in layouts
    )
    assert {plan.spec.sinks for plan in sinking} == {0, 1}


@pytest.mark.parametrize("tokens", range(1, 6))
def test_latent_attend_plans_count(tokens):
    assert plans_of(attend.LATENT_ATTEND, tokens) == [], "latent plans with no latent declared"
    plans = plans_of(attend.LATENT_ATTEND, tokens, LatentCache)
    with kvsizes.aiming_at(kvsizes.declared_by(LatentCache)):
        layouts = Scope.within_domain(tokens).layouts
        widths = attend.latent_scope_widths()
    assert len(plans) == len(layouts) * sum(3 ** (n - 1) for n in range(1, tokens + 1))
    assert {(p.spec.kv_heads, p.spec.value_dim, p.spec.head_dim) for p in plans} == {(1, *widths)}
    assert {p.heads for p in plans} == {layout.heads // layout.kv_heads for layout in layouts}
    # The no-rope width gives a scale none the cache could derive from what it holds.
    value_dim, rope = widths
    assert all(p.nope + rope not in (value_dim, value_dim + rope) for p in plans)


# --- shared layers: every kv_sources, then feeds ---


def test_every_shared_config_is_each_two_layer_layout_read_once():
    configs = list(shared.every_shared_config(Scope(1)))
    assert len(configs) == SHARED_MODELS
    assert [layout for layout, _ in configs] == [lay for lay in LAYOUTS if lay.layers == 2]
    assert {config.kv_sources for _, config in configs} == {(None, 0)}
    # Brute force: every tuple of sources on 3 and 4 layers of one window, a layer reading
    # an earlier layer that has a cache of its own, one layer reading at least.
    for layers in (3, 4):
        config = dataclasses.replace(LAYOUTS[1].config(), num_layers=layers)
        brute = {
            sources
            for sources in itertools.product((None, *range(layers)), repeat=layers)
            if any(source is not None for source in sources)
            and all(
                s is None or (s < layer and sources[s] is None) for layer, s in enumerate(sources)
            )
        }
        got = list(shared.every_kv_sources(config))
        assert len(got) == len(set(got)), f"{layers} layers: a kv_sources yielded twice"
        assert set(got) == brute, f"{layers} layers: not every kv_sources the rules allow"


@pytest.mark.parametrize("tokens", range(1, 7))
def test_shared_plans_count(tokens):
    plans = plans_of(shared.SHARED_LAYERS, tokens)
    assert len(plans) == SHARED_MODELS * sum(2 ** (n - 1) for n in range(1, tokens + 1))
    for n in range(1, tokens + 1):
        chunks = [p.chunks for p in plans if fed(p) == n]
        assert sorted(chunks) == sorted(splits_of(n) * SHARED_MODELS)


def row_feeds_brute(n: int, batch: int) -> int:
    """Every sequence of calls of ``batch`` counts each, not all 0, feeding ``n`` in all."""
    if n == 0:
        return 1
    return sum(
        row_feeds_brute(n - sum(counts), batch)
        for counts in itertools.product(range(n + 1), repeat=batch)
        if 0 < sum(counts) <= n
    )


@pytest.mark.parametrize("tokens", range(1, 6))
def test_shared_rows_plans_count(tokens):
    per_model = [row_feeds_brute(n, 2) for n in range(1, tokens + 1)]
    assert per_model == [2, 7, 24, 82, 280][:tokens]  # the docstring's c_2(n)
    plans = plans_of(shared.SHARED_ROWS, tokens)
    assert len(plans) == SHARED_MODELS * sum(per_model)
    assert {p.batch for p in plans} == {2}, "a batch of 1 is taken as 2"


@pytest.mark.parametrize("tokens", range(1, 7))
def test_shared_tree_plans_count(tokens):
    def closed(n):
        return sum(
            2 ** (p - 1) * math.factorial(nodes) * (nodes + 1)
            for p in range(1, n)
            for nodes in range(1, min(n - p - 1, shared.TREE_ENUMERATED_NODES) + 1)
        )

    def brute(n):
        return sum(
            len(splits_of(p)) * len(paths_of(parents))
            for p in range(1, n)
            for nodes in range(1, shared.TREE_ENUMERATED_NODES + 1)
            if n - p - nodes >= 1
            for parents in trees_of(nodes)
        )

    plans = plans_of(shared.SHARED_TREE, tokens)
    assert [closed(n) for n in range(1, tokens + 1)] == [brute(n) for n in range(1, tokens + 1)]
    assert len(plans) == SHARED_MODELS * sum(closed(n) for n in range(1, tokens + 1))


# --- tree drafts ---


def test_every_parents_and_acceptance():
    for nodes in range(1, 5):
        got = list(tree.every_parents(nodes))
        assert len(got) == len(set(got))
        assert set(got) == set(trees_of(nodes))
        assert len(got) == math.factorial(nodes) - (nodes > tree.MAX_ROOTS)
        for parents in got:
            for batch in (1, 2):
                accepted = list(tree.every_acceptance(parents, batch))
                assert len(accepted) == len(set(accepted)) == (nodes + 1) ** batch
                assert set(accepted) == set(itertools.product(paths_of(parents), repeat=batch))


def tree_count(n: int, batch: int) -> int:
    """The tree plans of ``n`` tokens on ``batch`` rows, by brute force: a prefix of p tokens
    (one prefill, or none), every tree, every path per row, poisoned or not where some node
    is off a path, every split of the tokens after the commit."""
    total = 0
    for p, nodes in itertools.product(range(n), range(1, tree.ENUMERATED_NODES + 1)):
        after = n - p - nodes
        if after < 1:
            continue
        for parents in trees_of(nodes):
            for accepted in itertools.product(paths_of(parents), repeat=batch):
                off = any(len(path) < nodes for path in accepted)
                total += (1 + off) * len(splits_of(after))
    return total


@pytest.mark.parametrize("tokens", range(1, 6))
def test_tree_plans_count(tokens):
    plans = plans_of(tree.TREE, tokens)
    assert len(plans) == sum(
        tree_count(n, layout.batch) for n in range(1, tokens + 1) for layout in LAYOUTS
    )
    assert {len(plan.prefix) for plan in plans} <= {0, 1}, "the prefix is one prefill, or none"
    for plan in plans:
        (round_,) = plan.rounds
        off = tree.off_the_paths(round_.parents, round_.accepted)
        assert round_.poisoned in (tuple(() for _ in off), off)


# --- sharded: every script ---


@functools.cache
def script_count(tokens: int, batch: int, most: int = 2) -> int:
    """The scripts of exactly ``tokens`` tokens, by brute force: every sequence of events
    (feeds of 1..tokens, truncates of 1..tokens, reorders by each index tuple, resets, forks
    on every request) kept while it follows the docstring's rules."""
    indices = list(itertools.product(range(batch), repeat=batch))
    letters = [
        *(Feed(r, size) for r in range(most) for size in range(1, tokens + 1)),
        *(Truncate(r, back) for r in range(most) for back in range(1, tokens + 1)),
        *(Reorder(r, order) for r in range(most) for order in indices),
        *(Reset(r) for r in range(most)),
        *(Fork(r, child) for r in range(most) for child in range(1, most)),
    ]

    def follows(script: tuple, event, held: list[int]) -> list[int] | None:
        request = event.parent if isinstance(event, Fork) else event.request
        first_feed = isinstance(event, Feed) and event.request == 0
        if request >= len(held) or (not script and not first_feed):
            return None
        if isinstance(event, Feed):
            return [*held[:request], held[request] + event.size, *held[request + 1 :]]
        if not isinstance(script[-1], Feed) or not held[request]:
            return None  # an edit follows a feed, on a request that holds tokens
        if isinstance(event, Truncate) and event.back <= held[request]:
            return [*held[:request], held[request] - event.back, *held[request + 1 :]]
        if isinstance(event, Reorder):
            return held
        if isinstance(event, Reset):
            return [*held[:request], 0, *held[request + 1 :]]
        if isinstance(event, Fork) and event.child == len(held) < most:
            return [*held, held[request]]
        return None

    def extend(script: tuple, held: list[int], left: int) -> int:
        found = int(not left and len(script) > 1 and isinstance(script[-1], Feed))
        for event in letters:
            cost = event.size if isinstance(event, Feed) else 0
            if cost > left:
                continue
            after = follows(script, event, held)
            if after is not None:
                found += extend((*script, event), after, left - cost)
        return found

    return extend((), [0], tokens)


@pytest.mark.parametrize("tokens", range(1, 5))
def test_sharded_plans_count(tokens):
    pairs = list(sharded.every_shard_layout(Scope(tokens)))
    assert len(pairs) == len(set(pairs))
    assert {world for world, _ in pairs} == {2, 4}
    plans = plans_of(sharded.SHARDED, tokens)
    assert len(plans) == sum(
        script_count(n, layout.batch) for n in range(1, tokens + 1) for _, layout in pairs
    )
    for n in range(2, min(tokens, 3) + 1):  # the scripts themselves, not only their count
        for batch in (1, 2):
            got = list(sharded.every_script(n, sharded.EVENTS, batch, 2))
            assert len(got) == len(set(got)) == script_count(n, batch)
    runtime = plans_of(sharded.SHARDED_RUNTIME, tokens)
    assert runtime == plans, "sharded runtime runs the plans of sharded in float64"


def test_sharded_runtime_plans_in_half_precision_are_float32():
    half = dataclasses.replace(Scope(2), dtype=torch.float16)
    plans = list(sharded.every_sharded_runtime_plan(half))
    assert plans
    assert {plan.dtype for plan in plans} == {torch.float32}


# --- Fewest tokens first, each plan once, in float64 ---

ENUMERATED = {
    "attend": (attend.ATTEND, 5, ChunkedCache),
    "latent attend": (attend.LATENT_ATTEND, 5, LatentCache),
    "shared layers": (shared.SHARED_LAYERS, 6, None),
    "shared layers through rows": (shared.SHARED_ROWS, 5, None),
    "shared layers under a tree": (shared.SHARED_TREE, 6, None),
    "tree drafts": (tree.TREE, 5, None),
    "sharded": (sharded.SHARDED, 4, None),
    "sharded runtime": (sharded.SHARDED_RUNTIME, 3, None),
}


@pytest.mark.parametrize("name", ENUMERATED)
def test_fewest_tokens_first_each_plan_once(name):
    prop, tokens, factory = ENUMERATED[name]
    plans = plans_of(prop, tokens, factory)
    assert plans, f"{name}: no plans to {tokens} tokens"
    totals = [fed(plan) for plan in plans]
    assert totals == sorted(totals), f"{name}: plans do not run fewest tokens first"
    assert max(totals) == tokens, f"{name}: no plan of {tokens} tokens"
    keys = [repr(plan) for plan in plans]
    assert len(set(keys)) == len(keys), f"{name}: a plan is yielded twice"
    dtypes = {getattr(plan, "dtype", None) or plan.spec.dtype for plan in plans}
    assert dtypes == {torch.float64}, f"{name}: plans in {dtypes}"


# --- Every plan at a few tokens holds on a correct built-in ---
# (fewer tokens in the default run where the plans cost most; --soak runs the full counts)


HOLDS = [
    (attend.ATTEND, ChunkedCache, depth.pick(4, soak=5)),
    (attend.LATENT_ATTEND, LatentCache, 5),
    (shared.SHARED_LAYERS, kvimpl.ConcatCache, depth.pick(4, soak=5)),
    (shared.SHARED_ROWS, kvimpl.PreallocatedCache, 3),
    (shared.SHARED_TREE, ChunkedCache, depth.pick(4, soak=5)),
    (tree.TREE, ChunkedCache, depth.pick(2, soak=3)),
    (sharded.SHARDED, kvimpl.ConcatCache, 2),
    (sharded.SHARDED_RUNTIME, kvimpl.ConcatCache, 2),
]


@pytest.mark.parametrize(("prop", "factory", "tokens"), **by_property(HOLDS))
def test_every_plan_holds_on_a_correct_cache(prop, factory, tokens):
    assert run_every(prop, factory, tokens) > 0


# --- A mutant the property catches is caught by one of its plans ---

CATCHES = [
    (attend.ATTEND, "MergeForgetsRunningMax", 4),
    (attend.LATENT_ATTEND, "RopeKeyOneSlotBack", 3),
    (shared.SHARED_LAYERS, "reader_after_the_append", 3),
    (shared.SHARED_ROWS, "reader_at_row_zeros_offset", 3),
    (shared.SHARED_TREE, "reader_sees_the_tree_siblings", 4),
    (tree.TREE, "CommitKeepsTheFirstNodes", 3),
    (sharded.SHARDED, "KvHeadOnWrongRank", 2),
    (sharded.SHARDED_RUNTIME, "LastRankSkipsReset", 3),
]


@pytest.mark.parametrize(("prop", "name", "tokens"), **by_property(CATCHES))
def test_a_mutant_is_caught_by_a_plan(prop, name, tokens):
    assert_caught(prop, name, tokens)
