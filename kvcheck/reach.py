"""Reach: which edges of the contract a property's plans actually ran.

A property is only as strong as the cases its draws get to: a cache that gives every joining
row the first one's first position holds every check if no plan ever joins two rows with
different first positions. So each property names the edges it is meant to reach
(``Property.reaches``, each an ``Edge``), and the code that runs a plan says which it ran
(``note``), at the moment it runs them on the cache: what was drawn but left out (an event
the cache does not offer, a plan outside its domain) is not reached.

Each note is also a Hypothesis ``event()``, so ``--hypothesis-show-statistics`` shows how
often each edge was run. The plugin collects the notes of each kit test (``collecting``) into
its verdict entry; the verdict says "reached" beside "pass", and the JSON report lists the
edges reached and those never reached. ``tests/test_reach.py`` (the soak tier) fails where a
property's draws, in the ci profile's examples, never reach an edge it names.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass

from hypothesis import event
from hypothesis.errors import InvalidArgument


@dataclass(frozen=True)
class Edge:
    """A case a property's plans must reach: ``name`` as the notes and reports say it, and
    the capabilities (``kvcheck.kit.offered``'s names) a cache needs for it to be reachable
    at all (a join needs ``join``)."""

    name: str
    needs: tuple[str, ...] = ()

    def reachable_on(self, offered: set[str] | frozenset[str]) -> bool:
        return all(name in offered for name in self.needs)


# The edges run in the kit test running now (None: no test collects, as in a mutant hunt).
_reached: list[set[str]] = []


def note(*names: str) -> None:
    """Say that the plan running now reached each of ``names`` (its property's ``Edge``
    names; a name no running property declares is kept and reported by no one)."""
    if _reached:
        _reached[-1].update(names)
    for name in names:
        with suppress(InvalidArgument):  # outside a Hypothesis test: a plain edge test, say
            event(f"reached: {name}")


@contextmanager
def collecting() -> Iterator[set[str]]:
    """Collect the notes made inside into the set it gives."""
    reached: set[str] = set()
    _reached.append(reached)
    try:
        yield reached
    finally:
        _reached.remove(reached)


def split(declared: tuple[Edge, ...], reached: set[str], offered: set[str] | None = None):
    """``declared``'s names as (reached, never reached), the latter only of those reachable
    on a cache offering ``offered`` (every one where that is None), each in declared order."""
    hit = [edge.name for edge in declared if edge.name in reached]
    missed = [
        edge.name
        for edge in declared
        if edge.name not in reached and (offered is None or edge.reachable_on(offered))
    ]
    return hit, missed
