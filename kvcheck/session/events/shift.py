"""Context shift (contract, section 8.4): discard a span of tokens and move the rest down,
re-rotating their keys, for the whole batch (``Shift``) or for each row its own span
(``ShiftRows``), as ``ReferenceTransformer.shift`` does.

No uncached pass is the oracle after it (``kvcheck.session.shifted``): the books keep the
rows themselves, shifted here in the model's dtype and in float64 as the cache's should be,
and every later feed runs the model over them. What holds right after it: every layer holds
the tokens left and still starts where the plan put it (a shift moves no first position; a
stale one would hide from the logits, RoPE being relative). A window layer may refuse a shift
that would leave it unable to serve the next query (``kvref.may_refuse_shift``), with a
cache's ``ValueError``; the books then stay.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcheck import asserts as kvassert
from kvcheck.session.checks import (
    check_firsts,
    check_lengths,
    check_row_lengths,
    not_row_shifted,
    refusal_allowed,
    windows,
)
from kvcheck.session.events.base import Event, Session
from kvcheck.session.request import Request
from kvcheck.session.shifted import batch_rows, row_rows
from kvref import may_refuse_shift
from kvref.protocol import keys_stored
from kvref.shift_oracle import shifted_rows


def shifted(held: tuple[list, list], start: int, count: int, base: float, stored) -> tuple:
    """Both of an oracle's sets of rows (model dtype, float64) after the shift."""
    return tuple(
        [shifted_rows(keys, values, start, count, base, stored) for keys, values in rows]
        for rows in held
    )


@dataclass
class Shift(Event):
    """``request`` discards its tokens of indices ``start`` to ``start + count - 1``; the
    result is False where refused."""

    request: Request
    start: int
    count: int
    at: str = ""

    def before(self, engine: Session) -> None:
        not_row_shifted(self.request, "a whole-batch shift")
        self.held, self.what = self.request.held, f"shift({self.start}, {self.count}){self.at}"

    def apply(self, engine: Session) -> Exception | None:
        caches = self.request.caches
        return kvassert.raised_by(lambda: engine.model.shift(caches, self.start, self.count))

    def refused(self, engine: Session, error: Exception) -> None:
        may_refuse = may_refuse_shift(windows(engine.model), self.held, self.start, self.count)
        refusal_allowed(engine, self.request, error, may_refuse, self.what)

    def update(self, engine: Session) -> None:
        request, start, count = self.request, self.start, self.count
        stored = keys_stored(request.caches[0])
        if request.shifted is None:  # the uncached pass's rows: what the caches held so far
            request.shifted = batch_rows(engine, request)
        base = engine.model.config.rope_base
        request.shifted = shifted(request.shifted, start, count, base, stored)
        kept = [*range(start), *range(start + count, self.held)]
        request.history = request.history[:, kept]
        if request.rows is not None:
            request.rows = [row[kept] for row in request.rows]

    def verify(self, engine: Session) -> None:
        check_lengths(engine, self.request, self.what)
        check_firsts(engine, self.request, self.what)

    def result(self) -> bool:
        return True


@dataclass
class ShiftRows(Event):
    """Row b of ``request`` discards its tokens of indices ``starts[b]`` to
    ``starts[b] + counts[b] - 1``; each row's oracle, alone at batch 1, does the same. The
    result is False where refused for some row."""

    request: Request
    starts: list[int]
    counts: list[int]
    at: str = ""

    def before(self, engine: Session) -> None:
        request = self.request
        self.rows = request.own_rows()
        self.what = f"shift({tuple(self.starts)}, {tuple(self.counts)}){self.at}"
        if request.shifted is not None:
            raise TypeError(f"a shift per row of {request.name} after a whole-batch shift")

    def apply(self, engine: Session) -> Exception | None:
        caches, starts, counts = self.request.caches, tuple(self.starts), tuple(self.counts)
        return kvassert.raised_by(lambda: engine.model.shift(caches, starts, counts))

    def refused(self, engine: Session, error: Exception) -> None:
        spans = zip(self.rows, self.starts, self.counts, strict=True)
        may_refuse = any(
            may_refuse_shift(windows(engine.model), len(row), start, count)
            for row, start, count in spans
            if count
        )
        refusal_allowed(engine, self.request, error, may_refuse, self.what)

    def update(self, engine: Session) -> None:
        request, rows = self.request, self.rows
        if request.row_shifted is None:
            request.row_shifted = [row_rows(engine, request, b) for b in range(len(rows))]
        stored, base = keys_stored(request.caches[0]), engine.model.config.rope_base
        for b, (start, count) in enumerate(zip(self.starts, self.counts, strict=True)):
            if not count:
                continue
            request.row_shifted[b] = shifted(request.row_shifted[b], start, count, base, stored)
            request.rows[b] = torch.cat((rows[b][:start], rows[b][start + count :]))

    def verify(self, engine: Session) -> None:
        check_row_lengths(engine, self.request, self.what)
        check_firsts(engine, self.request, self.what)

    def result(self) -> bool:
        return True
