"""What a session event is: the calls it makes on the caches under test, what the oracle's
books learn from it, and what must hold after it, each its own step.

An event is built with its arguments (the request, the tokens, the length kept) and run by
the engine (``Engine.apply``), which passes itself: its model, its books, its pool. The
steps run in this order:

- ``before``: the plans the oracle can follow (``TypeError`` for any other: a bug in the
  plan, not in the cache), and what the messages need from the books before the event;
- ``apply``: the calls on the caches. Where the event has a rule for refusals, it returns
  the error a cache refused with, and ``refused`` judges it: allowed where the contract lets
  a window refuse (a truncate or a shift, section 4: the books then stay as they were and the
  event's result is False), else a crash on valid input;
- ``update``: the books the engine trusts (history, rows, first positions, the rows a shift
  left, the live requests), moved as the event says the caches moved;
- ``verify``: what must hold after it, the caches against the books;
- ``record``: what the prefix books (``kvcheck.prefix_books``) learn about blocks the event
  left in a pool, once the caches were found to hold what they should.

A step an event lacks does nothing. ``result`` is what the engine's method returns.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvcheck.session.engine import Engine


class Event:
    """One event; a subclass is a dataclass of its arguments and overrides its steps."""

    def run(self, engine: Engine) -> Any:
        self.before(engine)
        refusal = self.apply(engine)
        if refusal is not None:
            self.refused(engine, refusal)
            return False
        self.update(engine)
        self.verify(engine)
        self.record(engine)
        return self.result()

    def before(self, engine: Engine) -> None:
        pass

    def apply(self, engine: Engine) -> Exception | None:
        raise NotImplementedError

    def refused(self, engine: Engine, error: Exception) -> None:
        raise error  # an event no cache may refuse

    def update(self, engine: Engine) -> None:
        pass

    def verify(self, engine: Engine) -> None:
        pass

    def record(self, engine: Engine) -> None:
        pass

    def result(self) -> Any:
        return None
