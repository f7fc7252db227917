"""Preemption by swapping (contract, section 9.3): ``Offload`` moves a request's rows out of
the pool, ``Restore`` brings them back.

Nothing in the books changes: the request's history is what it was, so the next feed holds
the restored rows to the uncached model bit for bit as any feed does. What holds right after
an offload is each layer's ``offloaded`` flag (read right after that layer's own call, so a
message names the first layer that stayed); after a restore, every layer's length. A
restored request's blocks are others than before: the prefix books take them as twins of
what was written, not new writes.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcheck import failures
from kvcheck.session.checks import check_lengths
from kvcheck.session.events.base import Event, Session
from kvcheck.session.request import Request


@dataclass
class Offload(Event):
    """``request``'s rows out of the pool."""

    request: Request
    at: str = ""

    def apply(self, engine: Session) -> None:
        request = self.request
        for layer, recorder in enumerate(request.caches):
            recorder.views = recorder.rows_returned = None  # a call: its views may go
            recorder.cache.offload()
            if not recorder.cache.offloaded:
                raise failures.DataLoss(
                    f"{request.name}'s layer {layer}: offloaded is False after offload()\n"
                    f"  {engine.where(f'{request.name} is swapped out{self.at}')}"
                )


@dataclass
class Restore(Event):
    """``request``'s rows back in the pool."""

    request: Request
    at: str = ""

    def apply(self, engine: Session) -> None:
        for recorder in self.request.caches:
            recorder.cache.restore()

    def verify(self, engine: Session) -> None:
        check_lengths(engine, self.request, f"its restore{self.at}")

    def record(self, engine: Session) -> None:
        request = self.request
        if engine.prefix is not None and request.looked_up:  # in other blocks now: not new writes
            engine.prefix.wrote(request, 0, request.held, count=False)
