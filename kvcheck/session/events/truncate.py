"""Truncate: every position from ``target`` on is forgotten (a rejected speculative draft, a
regenerated answer), in every layer, the widest window first.

What holds after it: every layer holds the ``target`` tokens left, and the next feed's logits
are the uncached model's over them. A window layer may refuse a truncate that would leave it
unable to serve the next query (contract, section 4: ``kvref.may_refuse_truncate``); only a
cache's ``ValueError`` counts as that refusal, the history then stays as it was and every
layer must still hold it. Any other refusal is a crash on valid input.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcheck import asserts as kvassert
from kvcheck.session.checks import check_lengths, not_row_shifted, refusal_allowed, windows
from kvcheck.session.events.base import Event, Session
from kvcheck.session.request import Request
from kvcheck.session.shifted import follow
from kvref import may_refuse_truncate


@dataclass
class Truncate(Event):
    """``request`` keeps its first ``target`` tokens; the result is False where refused."""

    request: Request
    target: int
    at: str = ""

    def before(self, engine: Session) -> None:
        not_row_shifted(self.request, "truncate")
        self.what = f"truncate to {self.target}{self.at}"

    def apply(self, engine: Session) -> Exception | None:
        return kvassert.raised_by(lambda: engine.model.truncate(self.request.caches, self.target))

    def refused(self, engine: Session, error: Exception) -> None:
        may_refuse = may_refuse_truncate(windows(engine.model), self.request.held, self.target)
        refusal_allowed(engine, self.request, error, may_refuse, self.what)

    def update(self, engine: Session) -> None:
        self.request.history = self.request.history[:, : self.target]
        follow(self.request, lambda rows: rows[:, :, : self.target])

    def verify(self, engine: Session) -> None:
        check_lengths(engine, self.request, self.what)

    def result(self) -> bool:
        return True
