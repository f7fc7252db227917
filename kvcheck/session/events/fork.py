"""Fork: a new request with its parent's history, on every layer's ``fork()`` (a beam split,
a parallel sample, a shared system prompt). Where the caches offer no ``fork``, the child is
what an engine without prefix sharing does: fresh caches fed the parent's history as one
prompt, held to the oracle as any feed.

The child's books are a copy of the parent's; what holds after it is every layer's length,
and from then on the two are separate requests, each fed and compared on its own, so a fork
that shares storage it should have copied shows in the other's next logits. On a
prefix-caching pool the blocks a fork copied hold the parent's prefixes again: the prefix
books learn of them as twins, not new writes; a block it shares keeps what the books know
was written there, past the fork's end too (a parent that rolled back into a full block).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcheck.session.checks import check_lengths, not_row_shifted
from kvcheck.session.events.base import Event, Session
from kvcheck.session.request import Request


@dataclass
class Fork(Event):
    """A request named ``name`` forked from ``parent``; the result is the child."""

    parent: Request
    name: str
    at: str = ""

    def run(self, engine: Session) -> Request:
        not_row_shifted(self.parent, "fork")
        if "fork" not in self.parent.offered:
            return self.fed_again(engine)
        return super().run(engine)

    def fed_again(self, engine: Session) -> Request:
        """Fresh caches fed the parent's history: the start and the feed check it."""
        parent = self.parent
        child = engine.start(self.name, parent.batch)
        if parent.held:
            engine.feed(child, parent.history, at=f" (a fork of {parent.name}){self.at}")
        return child

    def before(self, engine: Session) -> None:
        if self.name in engine.live:  # drop() goes by name: a second one would lose the first
            raise TypeError(
                f"fork named {self.name!r}, the name of a live request: no plan does so"
            )

    def apply(self, engine: Session) -> None:
        self.caches = [cache.fork() for cache in self.parent.caches]

    def update(self, engine: Session) -> None:
        parent = self.parent
        child = Request(self.name, self.caches, parent.history.clone(), offered=parent.offered)
        child.salt, child.looked_up = parent.salt, parent.looked_up
        child.shifted = parent.shifted  # a shift's oracle: never edited in place, so shared
        engine.live[self.name] = child
        self.child = child

    def verify(self, engine: Session) -> None:
        check_lengths(engine, self.child, f"{self.name} = fork of {self.parent.name}{self.at}")

    def record(self, engine: Session) -> None:
        child = self.child
        if engine.prefix is not None and child.looked_up:  # blocks a fork copied hold twins
            engine.prefix.wrote(child, 0, child.held, count=False)

    def result(self) -> Request:
        return self.child
