"""The exhaustive mode of ``interactions``: every walk of the grammar of events
(``kvcheck.interplay.every_walk``) to N tokens, counted against a closed form (the events
every cache runs) and a recurrence over each event's parameters (all of them); fewest tokens
first; holding on correct caches; failing an interplay bug at a few tokens."""

from __future__ import annotations

import functools
import itertools
import math

import pytest

import kvimpl
from kvcheck import failures, interplay
from kvcheck.properties.interactions import CALLED, INTERACTIONS, Walk, run_exhaustive_walk
from kvcheck.scope import LAYOUTS, Scope
from tests import depth
from tests import interplay as bugs
from tests.exhaustive_runs import run_every
from tests.pytest_run import run_in_process


def pell(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, 2 * b + a
    return a


@pytest.mark.parametrize("tokens", range(1, 8))
@pytest.mark.parametrize("batch", [1, 2])
def test_walks_of_the_events_every_cache_runs_are_pell_numbers(tokens, batch):
    # Sessions of w tokens split 2^(w - 1) ways, between resets of one token each.
    assert len(interplay.every_walk(frozenset(), tokens, batch)) == pell(tokens + 1) - 1


def count_by_recurrence(tokens: int, batch: int) -> int:
    """Walks of every event by their parameters' counts alone, no step built: from ``held``
    tokens with ``left`` to spend, one for each way on, plus stopping there."""

    @functools.cache
    def walks(held: int, left: int) -> int:
        ways = []  # (count of parameter choices, tokens it leaves, what it costs)
        if held == 0:
            ways += [(1, n, n) for n in range(1, tokens + 1)]  # a prefill
        else:
            if held < tokens:
                ways += [(1, n, n - held) for n in range(held + 1, tokens + 1)]  # decode, chunk
            ways += [(1, 0, 1)]  # reset
            ways += [(1, n, 1) for n in range(held)]  # truncate
            ways += [(n + 1, n, 1) for n in range(held)]  # shift: a span at each of n + 1 starts
            if held + 3 <= tokens:
                ways += [(1, held + 1, 3), (1, held + 2, 3)]  # a tree, one or two committed
            ways += [(batch**batch, held, 1)]  # a reorder: every order of the rows
            ways += [(1, held, 1)] * 3  # a fork, an offload and restore, a move
        return 1 + sum(count * walks(n, left - cost) for count, n, cost in ways if cost <= left)

    return walks(0, tokens) - 1


def count_rows_by_recurrence(tokens: int, batch: int) -> int:
    """Walks of the events on rows of their own, from each row's length and the tokens
    left to spend: the lengths each way leaves, what it costs, plus stopping there."""

    @functools.cache
    def walks(rows: tuple[int, ...], left: int) -> int:
        ways = []  # (each row's length it leaves, what it costs)
        for fed in itertools.product(*(range(n, tokens + 1) for n in rows)):
            ways += [(fed, sum(fed) - sum(rows))] if fed != rows else []  # rows fed
        if any(rows):
            ways += [(kept, 1) for kept in itertools.product(*(range(n + 1) for n in rows))]
            ways += [((0,) * batch, 1)] if len(rows) == batch else []  # every row reset
            # A shift per row: row b discards c of its n tokens at any of n - c + 1 starts
            # (nothing, once), one token at least in all.
            for counts in itertools.product(*(range(n + 1) for n in rows)):
                starts = math.prod(n - c + 1 if c else 1 for n, c in zip(rows, counts, strict=True))
                after = tuple(n - c for n, c in zip(rows, counts, strict=True))
                ways += [(after, 1)] * starts if any(counts) else []
        for count in range(1, len(rows) + 1):  # rows kept, in every order
            orders = itertools.permutations(rows, count)
            ways += [(kept, 1) for kept in orders]
        if len(rows) < batch:  # a request of one row joins, with every prompt
            ways += [((*rows, prompt), prompt) for prompt in range(1, tokens + 1)]
        return 1 + sum(walks(after, left - cost) for after, cost in ways if cost <= left)

    return walks((0,) * batch, tokens) - 1


@pytest.mark.parametrize("tokens", range(1, 5))  # to the mode's auto: 4,711 walks at batch 2
@pytest.mark.parametrize("batch", [1, 2])
def test_walks_of_every_event_count_as_their_parameters_say(tokens, batch):
    # The batch's walks and those of rows of their own: from empty caches, one or the other.
    count = count_by_recurrence(tokens, batch) + count_rows_by_recurrence(tokens, batch)
    assert len(interplay.every_walk(CALLED, tokens, batch)) == count


def test_every_walk_runs_fewest_tokens_first_once_each_event_where_it_may():
    tokens = 4
    walks = interplay.every_walk(CALLED, tokens, 2)
    weights = [interplay.walk_weight(walk) for walk in walks]
    assert weights == sorted(weights)
    assert max(weights) == tokens
    assert len(set(walks)) == len(walks)
    for walk in walks:
        held, rows = 0, (0, 0)
        for step in walk:
            kind = interplay.BY_NAME[step.kind]
            if kind.rows:
                assert interplay.rows_state(rows, tokens) in kind.runs_in, walk
                rows = step.rows
            else:
                assert interplay.state_of(held, tokens, tokens) in kind.runs_in, walk
                held = step.length
    plans = list(INTERACTIONS.every_plan(Scope(tokens)))
    assert len(plans) == sum(
        len(interplay.every_walk(CALLED, tokens, lay.batch)) for lay in LAYOUTS
    )


# The paged cache's walks cost twice the preallocated one's: the soak tier runs them.
@pytest.mark.parametrize("name", [pytest.param("paged", marks=pytest.mark.soak), "preallocated"])
def test_every_walk_holds_on_a_correct_cache(name):
    assert run_every(INTERACTIONS, kvimpl.CACHES[name], depth.pick(2, soak=4)) > 0


@pytest.mark.parametrize(
    ("bug", "tokens"),
    [
        # A reset of a slab a fork shares scrubs the fork's rows: reset right after a fork.
        ("ResetScrubsSharedSlab", 3),
        # A joining row takes a live row's slot after a row left: a select, then a join.
        ("JoinReusesLiveSlot", 2),
    ],
)
def test_an_interplay_bug_fails_a_walk_and_its_twin_holds(bug, tokens):
    with pytest.raises(AssertionError):
        run_every(INTERACTIONS, bugs.INTERPLAY_BUGS[bug], tokens)
    assert run_every(INTERACTIONS, bugs.TWINS[bug], tokens) > 0


def test_a_walk_that_calls_what_the_cache_lacks_is_counted_apart():
    layout = LAYOUTS[0]
    steps = next(w for w in interplay.every_walk(CALLED, 2, 1) if w[-1].kind == "fork")
    walk = Walk(layout.config(), layout.batch, Scope(2).dtype, 2, steps)
    with pytest.raises(failures.NotOffered, match="fork"):
        run_exhaustive_walk(kvimpl.PreallocatedCache, walk, "append")


def test_the_verdict_counts_the_walks_a_cache_does_not_offer_apart(pytester):
    (pytester.path / "test_it.py").write_text(
        "from kvcheck import CacheTests\nfrom kvimpl import PreallocatedCache\n\n\n"
        "class TestIt(CacheTests):\n    factory = PreallocatedCache\n"
    )
    result = run_in_process(pytester, "--kv-property", "interactions", "--kv-exhaustive", "2")
    assert result.returncode == 0, result.stdout
    walks = sum(len(interplay.every_walk(CALLED, 2, layout.batch)) for layout in LAYOUTS)
    assert f"every plan holds: interactions {walks}, " in result.stdout, result.stdout
    assert " not offered" in result.stdout, result.stdout
    assert "outside the domain" not in result.stdout, result.stdout
