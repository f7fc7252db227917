"""Reorder: batch row b becomes the old row ``indices[b]`` in every layer (beam search keeps
its best beams; a row may be taken twice, another dropped).

The books' history takes the same rows; what holds after it is every layer's length, and the
next feed compares every row's logits with the uncached model's over its new history, so a
cache that moved one layer's rows and not another's, or aliased a row taken twice, shows.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from kvcheck.session.checks import check_lengths, not_row_shifted
from kvcheck.session.events.base import Event, Session
from kvcheck.session.request import Request
from kvcheck.session.shifted import follow


@dataclass
class Reorder(Event):
    """Row b of ``request`` becomes its old row ``indices[b]``."""

    request: Request
    indices: Tensor
    at: str = ""

    def before(self, engine: Session) -> None:
        not_row_shifted(self.request, "reorder")
        self.indices = self.indices.to(engine.model.device)

    def apply(self, engine: Session) -> None:
        engine.model.reorder(self.request.caches, self.indices)

    def update(self, engine: Session) -> None:
        self.request.history = self.request.history[self.indices]
        follow(self.request, lambda rows: rows[self.indices.to(rows.device)])

    def verify(self, engine: Session) -> None:
        check_lengths(engine, self.request, f"reorder by {self.indices.tolist()}{self.at}")
