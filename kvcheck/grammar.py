"""The exhaustive mode's one enumerator: every sequence of plan events a property's rules
allow, fed exactly so many tokens (``kvcheck.plan_events``; the bounded-exhaustive mode,
docs/exhaustive.md).

A property states its rules as ``moves(state, left)``: from where a sequence stands, each
run of events that may come next (one event, or a few back to back: a draft and its verdict,
a truncate then a reorder), the state it leaves and the tokens it feeds, at most ``left``;
and ``ends(state)``: whether a sequence may stop there. ``sentences`` walks them depth first.
Every run of events that feeds nothing must lead to one that does (an edit is followed by a
feed), so that every sequence is finite.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

S = TypeVar("S")  # what a property's rules know of a sequence so far

Moves = Callable[[S, int], Iterable[tuple[tuple, S, int]]]


def sentences(
    tokens: int, start: S, moves: Moves, ends: Callable[[S], bool], *, at_most: bool = False
) -> Iterator[tuple]:
    """Every sequence of events from ``start`` that feeds exactly ``tokens`` tokens (with
    ``at_most``, up to ``tokens``) and stops where ``ends`` allows: ``moves(state, left)``
    gives each run of events that may come next, with the state it leaves and the tokens it
    feeds (at most ``left``). Depth first: a sequence before those that go on from it."""

    def extend(state: S, left: int) -> Iterator[tuple]:
        if (at_most or not left) and ends(state):
            yield ()
        for run, after, fed in moves(state, left):
            for rest in extend(after, left - fed):
                yield (*run, *rest)

    yield from extend(start, tokens)
