"""A move between layouts (contract, section 11.2): every layer's rows out of a request's
caches (``export_rows``) and into fresh caches from another factory taking another path
(``import_rows``), where the request goes on; every later cache comes from that factory.

The books do not change: the history is the request's, so its next feed holds the imported
rows to the uncached model as any feed does. What holds at the move itself: each layer's
export is the rows that layer was given (``kvcheck.asserts.assert_exported``), every layer of
the new caches holds the history, and a pool the request left has every block back. That
last needs the request alone on the engine, hence the refusal of a plan with others alive.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass

from kvcheck import asserts as kvassert
from kvcheck import pool_books
from kvcheck.harness import builder, record
from kvcheck.session.checks import check_lengths
from kvcheck.session.events.base import Event, Session
from kvcheck.session.request import Request
from kvref import CacheFactory, CacheRows, capabilities


def exported(request: Request, where: str) -> list:
    """Every layer's ``export_rows()``, each held to the rows that layer was given."""
    rows_out = []
    for layer, recorder in enumerate(request.caches):
        recorder.views = recorder.returned = None  # a call: its views may go
        rows = recorder.cache.export_rows()
        kvassert.assert_exported(recorder, rows, who=f"layer {layer}", where=where)
        rows_out.append(rows)
    return rows_out


@dataclass
class Move(Event):
    """``request`` onto caches from ``factory`` on ``path``; ``carry`` takes each layer's
    rows on their way (through another device, say)."""

    request: Request
    factory: CacheFactory
    path: str
    carry: Callable[[CacheRows], CacheRows] = lambda rows: rows
    at: str = ""

    def before(self, engine: Session) -> None:
        name = self.request.name
        if set(engine.live) != {name}:
            raise TypeError(f"a move of {name} beside other requests: no plan does so")
        self.what = f"{name}, its move{self.at}"

    def apply(self, engine: Session) -> None:
        request = self.request
        rows = exported(request, engine.where(self.what))
        self.left, self.before_move = engine.pool, engine.pool_before
        engine.path = self.path
        engine.use_factory(self.factory)
        built = engine.model.new_caches(
            builder(engine.factory), batch=request.batch, max_length=engine.max_length
        )
        caches = record(built, engine.model.config, self.path)
        for recorder, layer_rows, old in zip(caches, rows, request.caches, strict=True):
            recorder.cache.import_rows(self.carry(layer_rows))
            recorder.take_history(old)
            if callable(getattr(recorder.cache, "take_history", None)):  # the kit's shards
                recorder.cache.take_history(old.cache)
        self.caches = caches

    def update(self, engine: Session) -> None:
        self.request.caches = self.caches
        self.request.offered = frozenset(capabilities(self.caches[0].cache))

    def verify(self, engine: Session) -> None:
        check_lengths(engine, self.request, f"its move{self.at}")
        left = self.left
        if left is not None and left is not engine.pool:  # the caches it left: collected
            gc.collect()
            pool_books.all_back(left, self.before_move, where=engine.where(self.what))
