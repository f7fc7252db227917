"""Events on a batch whose rows are requests of their own (contract, sections 8.1 and 8.3),
besides feeding them (``kvcheck.session.events.feed_rows``): each row keeps its own prefix
(``TruncateRows``), finished rows leave (``SelectRows``), another request's rows join
(``Join``), and every row restarts empty at a position of its own (``ResetAt``).

The books keep each row's history and first position; what holds after each is every
layer's ``row_lengths`` against them (and, after ``ResetAt``, its first positions), and the
next feed by row holds each row to the uncached model on that row alone, so a row that
took a neighbour's rows, or kept rows it should have lost, shows there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcheck import asserts as kvassert
from kvcheck import failures
from kvcheck.session.checks import (
    check_firsts,
    check_lengths,
    check_row_lengths,
    refused_by_a_cache,
    windows,
)
from kvcheck.session.events.base import Event, Session
from kvcheck.session.request import Request
from kvcheck.session.shifted import row_rows
from kvref import may_refuse_truncate


@dataclass
class TruncateRows(Event):
    """Row b of ``request`` keeps its first ``keep[b]`` tokens (speculative acceptance per
    row), the widest window first, as ``ReferenceTransformer.truncate`` asks. The result is
    False where a window layer refused as section 4 allows for some row: only the first layer
    called may refuse, so that nothing changed."""

    request: Request
    keep: list[int]
    at: str = ""

    def before(self, engine: Session) -> None:
        self.rows = self.request.own_rows()
        self.what = f"truncate_rows to {self.keep}{self.at}"

    def apply(self, engine: Session) -> Exception | None:
        caches, keep = self.request.caches, tuple(self.keep)
        for done, layer in enumerate(engine.model.widest_window_first()):
            error = kvassert.raised_by(lambda i=layer: caches[i].truncate_rows(keep))
            if error is not None:  # the layers after it are not called
                self.done, self.layer = done, layer
                return error
        return None

    def refused(self, engine: Session, error: Exception) -> None:
        rows = zip(self.rows, self.keep, strict=True)
        if (
            self.done == 0
            and refused_by_a_cache(error)
            and any(may_refuse_truncate(windows(engine.model), len(row), n) for row, n in rows)
        ):
            check_row_lengths(engine, self.request, f"a refused {self.what}")
            return
        raise failures.RefusesValidInput(
            f"{self.request.name}'s layer {self.layer}: {self.what} refused with "
            f"{type(error).__name__}: {error}; no layer may refuse it"
            f"{' after another took it' if self.done else ''}: every position a row's next "
            f"query needs is among those a window keeps\n  at {engine.where(self.what)}"
        ) from error

    def update(self, engine: Session) -> None:
        self.request.rows = [row[:n] for row, n in zip(self.rows, self.keep, strict=True)]
        if (shifted := self.request.row_shifted) is not None:  # each row keeps its head
            for b, n in enumerate(self.keep):
                shifted[b] = tuple(
                    [(keys[:, :, :n], values[:, :, :n]) for keys, values in rows]
                    for rows in shifted[b]
                )

    def verify(self, engine: Session) -> None:
        check_row_lengths(engine, self.request, self.what)

    def result(self) -> bool:
        return True


@dataclass
class SelectRows(Event):
    """The batch becomes rows ``indices`` of ``request``: the others finished and leave."""

    request: Request
    indices: list[int]
    at: str = ""

    def before(self, engine: Session) -> None:
        self.rows = self.request.own_rows()

    def apply(self, engine: Session) -> None:
        chosen = torch.tensor(self.indices, dtype=torch.long, device=engine.model.device)
        for cache in self.request.caches:
            cache.select_rows(chosen)

    def update(self, engine: Session) -> None:
        request, indices = self.request, self.indices
        firsts = request.row_firsts()
        request.rows = [self.rows[b] for b in indices]
        request.firsts = [firsts[b] for b in indices]
        if request.row_shifted is not None:
            request.row_shifted = [request.row_shifted[b] for b in indices]

    def verify(self, engine: Session) -> None:
        check_row_lengths(engine, self.request, f"select_rows {self.indices}{self.at}")


@dataclass
class Join(Event):
    """The rows of ``other`` (its own caches, fed alone) join ``request`` after its last;
    ``other`` ends there."""

    request: Request
    other: Request
    at: str = ""

    def before(self, engine: Session) -> None:
        self.rows, self.theirs = self.request.own_rows(), self.other.own_rows()
        self.firsts = [*self.request.row_firsts(), *self.other.row_firsts()]
        # Where either side was shifted per row, the rows its oracle keeps for every row.
        self.shifted = None
        if self.request.row_shifted is not None or self.other.row_shifted is not None:
            self.shifted = [*held_by_row(engine, self.request), *held_by_row(engine, self.other)]

    def apply(self, engine: Session) -> None:
        for cache, joining in zip(self.request.caches, self.other.caches, strict=True):
            cache.join(joining)

    def update(self, engine: Session) -> None:
        engine.live.pop(self.other.name, None)
        self.other.caches = None
        self.request.rows, self.request.firsts = [*self.rows, *self.theirs], self.firsts
        self.request.row_shifted = self.shifted

    def verify(self, engine: Session) -> None:
        check_row_lengths(engine, self.request, f"{self.other.name} joins{self.at}")


@dataclass
class ResetAt(Event):
    """Every layer of ``request`` empty, row b's next token at position ``firsts[b]``: a
    tuple for a cache with rows of their own, else the one int all rows share."""

    request: Request
    firsts: list[int]
    at: str = ""

    def before(self, engine: Session) -> None:
        self.by_row = "append_rows" in self.request.offered

    def apply(self, engine: Session) -> None:
        firsts = tuple(self.firsts) if self.by_row else self.firsts[0]
        for cache in self.request.caches:
            cache.reset_at(firsts)

    def update(self, engine: Session) -> None:
        request = self.request
        request.history = request.history[:, :0]
        request.firsts, request.steps, request.shifted = list(self.firsts), 0, None
        request.row_shifted = None
        request.rows = [request.history[0]] * len(self.firsts) if self.by_row else None

    def verify(self, engine: Session) -> None:
        if self.by_row:
            check_row_lengths(engine, self.request, f"reset_at {self.firsts}{self.at}")
        else:
            check_lengths(engine, self.request, f"reset_at {self.firsts[0]}{self.at}")
        check_firsts(engine, self.request, f"reset_at {self.firsts}{self.at}")


def held_by_row(engine: Session, request: Request) -> list:
    """What ``request``'s oracle holds for each row, alone at batch 1: the rows a shift per
    row left (``Request.row_shifted``), else the uncached pass over each row's history."""
    if request.row_shifted is not None:
        return list(request.row_shifted)
    return [row_rows(engine, request, b) for b in range(request.batch)]
