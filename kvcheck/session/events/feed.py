"""Feed: new tokens for every row of a batch fed as one, through the model's forward pass.

The event every plan is made of. Its check is the contract's whole point: the new positions'
logits equal the uncached model's over the request's whole history (the oracle), whatever
the plan did to the caches before. On the append path every layer must also have returned
exactly the rows given, so a wrong row names its layer; where the logits differ,
``diagnose`` names the first layer whose cache went wrong. After a context
shift no uncached pass is the oracle: the model over the rows the shifts left is
(``kvcheck.session.shifted``), with the budgets a re-rotation's rounding needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvcheck import asserts as kvassert
from kvcheck import failures
from kvcheck.session.checks import check_returned, not_row_shifted
from kvcheck.session.compare import assert_logits, diagnose, refusal_diagnosis
from kvcheck.session.events.base import Event, Session
from kvcheck.session.request import Request
from kvcheck.session.shifted import after_shift


@dataclass
class Feed(Event):
    """``new`` tokens (batch, count) for ``request``; without ``compare`` the caller
    compares (the core properties hold one uncached pass over a whole session)."""

    request: Request
    new: Tensor
    compare: bool = True
    at: str = ""

    def before(self, engine: Session) -> None:
        request, count = self.request, self.new.shape[1]
        not_row_shifted(request, "feed (the batch as one)")
        self.start, self.end = request.held, request.held + count
        self.first = request.shared_first()
        kind = "prefill" if self.start == 0 else "decode"
        self.where = engine.where(
            f"{request.name}, its step #{request.steps}: {kind} of {count} token"
            f"{'s' * (count > 1)} at absolute positions {self.first + self.start}.."
            f"{self.first + self.end - 1}{self.at}"
        )

    def apply(self, engine: Session) -> None:
        try:
            self.logits = engine.model(self.new, caches=self.request.caches)
        except Exception as error:
            error.add_note(f"  at {self.where}")
            if failures.is_contract_error(error) and (why := refusal_diagnosis(self.request)):
                error.add_note(why)  # the model's guards refused a layer's rows: whose, how
            raise

    def update(self, engine: Session) -> None:
        request, new = self.request, self.new
        request.history = torch.cat((request.history, new), dim=1)
        if engine.prefix is not None and request.looked_up:  # its blocks may be published
            engine.prefix.wrote(request, self.start, self.end)
        if request.rows is not None:  # rows of their own, fed as one batch this time
            fed = zip(request.rows, new, strict=True)
            request.rows = [torch.cat((row, tokens)) for row, tokens in fed]
        request.steps += 1
        self.shifted = request.shifted is not None
        if self.shifted:  # the oracle moves on with every step, compared or not
            self.expected, self.reference = after_shift(engine, request, new)

    def verify(self, engine: Session) -> None:
        if not self.compare:
            return
        request = self.request
        if self.shifted:  # the rows first: a key a shift moved wrongly names its layer and row
            check_returned(request, self.end, self.where)
            assert_logits(
                self.logits,
                self.expected,
                self.reference,
                where=self.where,
                start=self.first + self.start,
                path=request.path,
                what="cached logits and the model's over the rows the shifts left",
                lossy=kvassert.coarsest(request.caches),
                budgets=kvassert.SHIFTED_BUDGETS,
                rows_held=lambda: check_returned(request, self.end, self.where),
            )
            return
        if engine.judges_logits:
            self.compare_with_uncached(engine)
        check_returned(request, self.end, self.where)

    def compare_with_uncached(self, engine: Session) -> None:
        """The new positions' logits against the uncached model's over the whole history."""
        request, first, start = self.request, self.first, self.start
        history = request.history
        expected = engine.model(history, start_position=first)[:, start:]

        def reference() -> Tensor:  # the float64 pass: run only where assert_logits needs it
            return engine.truth(history, start_position=first)[:, start:]

        try:
            assert_logits(
                self.logits, expected, reference, where=self.where, start=first + start,
                path=request.path, lossy=kvassert.coarsest(request.caches),
                budgets=kvassert.budgets_for(request.caches),
                rows_held=lambda: check_returned(request, self.end, self.where),
            )  # fmt: skip
        except failures.WrongResults as error:
            diagnose(error, engine.model, request, first)
            raise

    def result(self) -> Tensor:
        return self.logits
