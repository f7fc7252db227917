"""The bounded-exhaustive enumerations of requests side by side (``every_plan`` of
kvcheck/properties/requests.py and pool.py: ``requests``, ``fork`` and ``pool``): each yields
exactly the event streams that a brute force over every sequence of events, filtered by the
rules ``every_request_plan``'s docstring states, finds (it has no closed form); fewest tokens
first and each plan once; every plan at a few tokens holds on a correct built-in cache; and a
mutant of the catalogue the property catches is caught by one of them."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

import kvimpl
from kvcheck.properties import pool, requests
from kvcheck.properties.requests import Feed, Finish, Fork, Poison, Reorder, Start, Truncate
from kvcheck.scope import LAYOUTS, Scope, first_use_order
from tests import depth
from tests.exhaustive_runs import assert_caught, by_property, run_every

PAGED = kvimpl.CACHES["paged"]
# What each enumeration passes to every_request_plan (its docstring's bounds).
KINDS = {
    "requests": dict(truncates=False, poison=True, specials=1, fork_first=False),
    "fork": dict(truncates=True, poison=False, specials=2, fork_first=True),
}


def fed(plan: requests.RequestPlan) -> int:
    """The tokens a plan feeds, as the docstring counts them: the Feeds' sizes and the rows
    each Poison leaves (a fork feeds none)."""
    return sum(
        event.size if isinstance(event, Feed) else event.rows
        for event in plan.events
        if isinstance(event, Feed | Poison)
    )


# --- The brute force: every sequence of events, filtered by the docstring's rules ---


def alphabet(batch: int, tokens: int, most: int) -> list:
    """Every event a plan of ``tokens`` tokens with ``most`` requests could hold, valid or not."""
    names = range(most)
    maps = list(itertools.product(range(batch), repeat=batch))
    return [
        *(Start(r, batch, reuse) for r in names for reuse in (None, *names)),
        *(Feed(r, size) for r in names for size in range(1, tokens + 1)),
        *(Fork(parent, child) for parent in names for child in names),
        *(Truncate(r, back) for r in names for back in range(tokens + 1)),
        *(Reorder(r, rows) for r in names for rows in maps),
        *(Poison(r, "nan", rows) for r in names for rows in requests.POISON_ROWS),
        *(Finish(r, how) for r in names for how in ("drop", "reset")),
    ]


def replay(events, batch, tokens, most, *, truncates, poison, specials, fork_first=False):
    """Whether ``events`` is a valid beginning of a plan by the docstring's rules: None if not,
    else (requests live, tokens fed)."""
    live: dict[int, int] = {}  # request -> its length
    reusable: list[int] = []  # finished by reset, its caches not taken again yet
    named = used = spent = 0
    identity = tuple(range(batch))
    for index, event in enumerate(events):
        before = events[index - 1] if index else None
        # A start is fed its first chunk at once; a truncate or reorder comes before a feed.
        if isinstance(before, Start | Truncate | Reorder) and event != Feed(
            before.request, getattr(event, "size", 0)
        ):
            return None
        # A poison is its request's last step but its finish.
        if isinstance(before, Poison) and event not in (
            Finish(before.request, "drop"),
            Finish(before.request, "reset"),
        ):
            return None
        if isinstance(event, Start):
            if event.request != named or named == most or event.batch != batch:
                return None
            if event.reuse is not None:
                if event.reuse not in reusable:
                    return None
                reusable.remove(event.reuse)
            live[event.request], named = 0, named + 1
        elif isinstance(event, Feed):
            if event.request not in live or event.size < 1:
                return None
            live[event.request] += event.size
            spent += event.size
        elif isinstance(event, Fork):
            if event.parent not in live or event.child != named or named == most:
                return None
            live[event.child], named, used = live[event.parent], named + 1, used + 1
        elif isinstance(event, Truncate):
            if not truncates or event.request not in live or event.back > live[event.request]:
                return None
            live[event.request] -= event.back
            used += 1
        elif isinstance(event, Reorder):
            if event.request not in live or event.indices == identity:
                return None
            used += 1
        else:  # a poison and its finish, or a finish, right after a step of its own (a
            # feed, a fork it is in)
            step = (before.parent, before.child) if isinstance(before, Fork) else ()
            if isinstance(before, Feed):
                step = (before.request,)
            if isinstance(before, Poison):  # its finish (checked above)
                step = (before.request,)
            if event.request not in live or event.request not in step:
                return None
            if isinstance(event, Poison):
                if not poison:
                    return None
                spent += event.rows
            else:
                used += event.how != "drop" or isinstance(before, Poison)
                del live[event.request]
                if event.how == "reset":
                    reusable.append(event.request)
        if used > specials or spent > tokens:
            return None
    return live, spent


def complete(events, tokens, fork_first) -> bool:
    """A whole plan: every poisoned finish followed by a feed that could read its rows, a
    fork where every plan forks (it ended with no request live, every token fed: checked by
    the caller)."""
    for index, event in enumerate(events):
        read = any(isinstance(later, Feed) for later in events[index + 1 :])
        if isinstance(event, Poison) and not read:
            return False
    return not fork_first or any(isinstance(event, Fork) for event in events)


@functools.cache
def brute_streams(batch: int, tokens: int, most: int, kinds: str) -> frozenset:
    """Every event stream of exactly ``tokens`` tokens, found by extending every valid
    beginning by every event of the alphabet."""
    rules = KINDS[kinds]
    letters = alphabet(batch, tokens, most)
    found, beginnings = set(), [()]
    while beginnings:
        events = beginnings.pop()
        for event in letters:
            longer = (*events, event)
            state = replay(longer, batch, tokens, most, **rules)
            if state is None:
                continue
            beginnings.append(longer)
            live, spent = state
            if not live and spent == tokens and complete(longer, tokens, rules["fork_first"]):
                found.add(longer)
    return frozenset(found)


def enumerate_of(kinds: str, tokens: int) -> list:
    scope = Scope(tokens)
    return list(
        requests.every_requests_plan(scope)
        if kinds == "requests"
        else requests.every_fork_plan(scope)
    )


# --- What they enumerate: the brute force's streams, no more and no fewer ---


@pytest.mark.parametrize("kinds", ["requests", "fork"])
@pytest.mark.parametrize(
    # 4 tokens of fork plans is 10 s of brute force: the soak tier's
    "tokens",
    [1, 2, 3, pytest.param(4, marks=[pytest.mark.soak, pytest.mark.long])],
)
def test_plans_are_every_stream_the_rules_allow(kinds, tokens):
    plans = enumerate_of(kinds, tokens)
    for layout in LAYOUTS:
        for n in range(1, tokens + 1):
            got = [p.events for p in plans if fed(p) == n and p.config == layout.config()]
            # Layouts of one config (none here) would merge: each layout's config is its own.
            want = brute_streams(layout.batch, n, Scope(tokens).requests, kinds)
            wrong = (want - set(got), set(got) - want)
            missing, extra = wrong
            assert wrong == (set(), set()), (
                f"{kinds} at {n} tokens on {layout.describe()}: {len(got)} plans, the rules "
                f"allow {len(want)}; missing e.g. {sorted(map(repr, missing))[:2]}, not allowed "
                f"e.g. {sorted(map(repr, extra))[:2]}"
            )
    brute = sum(
        len(brute_streams(layout.batch, n, 2, kinds))
        for n in range(1, tokens + 1)
        for layout in LAYOUTS
    )
    assert len(plans) == brute


def test_the_counts_measured():
    """The counts of docs/exhaustive-measured.md's table, for the record."""
    assert len(enumerate_of("requests", 4)) == 1026
    assert len(enumerate_of("fork", 4)) == 2300


def test_pool_enumerates_the_plans_of_requests():
    for tokens in range(1, 5):
        assert list(pool.POOL.every_plan(Scope(tokens))) == enumerate_of("requests", tokens)


@pytest.mark.parametrize("kinds", ["requests", "fork"])
def test_plans_run_fewest_tokens_first_each_once(kinds):
    plans = enumerate_of(kinds, 4)
    totals = [fed(plan) for plan in plans]
    assert totals == sorted(totals), f"{kinds}: plans do not run fewest tokens first"
    assert set(totals) == ({1, 2, 3, 4} if kinds == "requests" else {2, 3, 4})
    assert len(set(plans)) == len(plans), f"{kinds}: a plan is yielded twice"
    assert {plan.dtype for plan in plans} == {torch.float64}
    assert {plan.token_seed for plan in plans} == {0}
    assert {plan.margin for plan in plans} == {0}
    for plan in plans:
        named = [
            event.child if isinstance(event, Fork) else event.request
            for event in plan.events
            if isinstance(event, Start | Fork)
        ]
        assert first_use_order(named), f"{kinds}: requests not in first use order: {plan}"
        assert named == sorted(named), (
            f"{kinds}: requests not numbered in the order they start or fork: {plan.events}"
        )
        poisons = {(e.kind, e.rows) for e in plan.events if isinstance(e, Poison)}
        assert poisons <= {("nan", rows) for rows in requests.POISON_ROWS}
        if kinds == "fork":
            assert any(isinstance(event, Fork) for event in plan.events)


# --- Every plan at a few tokens holds on a correct built-in ---
# (fewer tokens in the default run where the plans cost most; --soak runs the full counts)

HOLDS = [
    (requests.REQUESTS, kvimpl.ConcatCache, depth.pick(2, soak=3)),
    (requests.FORK, PAGED, depth.pick(2, soak=3)),
    (pool.POOL, PAGED, depth.pick(2, soak=3)),
]


@pytest.mark.parametrize(("prop", "factory", "tokens"), **by_property(HOLDS))
def test_every_plan_holds_on_a_correct_cache(prop, factory, tokens):
    assert run_every(prop, factory, tokens) > 0


# --- A mutant the property catches is caught by one of its plans ---

CATCHES = [
    (requests.REQUESTS, "ResetKeepsStaleTable", 3),  # a request on reset caches
    (requests.FORK, "ForkWithoutCopyOnWrite", 3),
    (pool.POOL, "DropLeaksBlocks", 3),
]


@pytest.mark.parametrize(("prop", "name", "tokens"), **by_property(CATCHES))
def test_a_mutant_is_caught_by_a_plan(prop, name, tokens):
    assert_caught(prop, name, tokens)
