"""The end of a history: poison (rows of garbage left behind), reset (every layer emptied, the
caches kept for a later request) and drop (the request and its caches gone).

A poisoned request's history is over: the engine lets only a reset or its end follow.
Their checks come after them, not in them: a reset cache must start the next request empty
(``Engine.start`` holds it to that) and must shed every poisoned row, which the next
request's logits show, a nan or a huge value being far from any tolerance; a dropped request's
blocks must come back to a pool (``Engine.check`` audits the books, ``Engine.finish`` counts
every block back). Poison has no books to update: its history is over.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

from kvcheck import tensors as kvtensors
from kvcheck.session.events.base import Event, Session
from kvcheck.session.request import Request


@dataclass
class Poison(Event):
    """``rows`` rows of nan, inf, -inf or huge values (``kind``) appended to every layer."""

    request: Request
    kind: str
    rows: int

    def apply(self, engine: Session) -> None:
        spec = engine.model.cache_spec(self.request.batch, engine.max_length)
        bad = kvtensors.poison_rows(spec, self.rows, self.kind)
        for cache in self.request.caches:
            cache.append(bad, kvtensors.as_values(spec, bad))

    def update(self, engine: Session) -> None:
        self.request.poisoned += self.rows


@dataclass
class Reset(Event):
    """Every layer of ``request`` emptied, kept for a later ``start(reuse=...)``."""

    request: Request

    def apply(self, engine: Session) -> None:
        for cache in self.request.caches:
            cache.reset()

    def update(self, engine: Session) -> None:
        request = self.request
        request.history = request.history[:, :0]
        request.steps, request.shifted, request.looked_up = 0, None, 0
        request.poisoned = 0


@dataclass
class Drop(Event):
    """``request`` ends: its caches lose their last reference."""

    request: Request

    def apply(self, engine: Session) -> None:
        engine.live.pop(self.request.name, None)
        self.request.caches = None
        if engine.pool is not None:  # so that the pool gets their blocks back now
            gc.collect()
