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

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from torch import Tensor

from kvref import CacheFactory, ReferenceTransformer

if TYPE_CHECKING:
    from kvcheck.prefix_books import PrefixBooks
    from kvcheck.session.request import Request


class Session(Protocol):
    """What an event reads and calls on the engine that runs it (``kvcheck.session.engine``
    has the one implementation): the events are written against this, not the engine, so
    that the engine, which imports every event, is imported by none of them."""

    model: ReferenceTransformer  # the model under the caches, in the plan's dtype
    factory: CacheFactory  # where every cache of the session comes from
    max_length: int  # what every cache is built for
    path: str  # the model's path through the caches: "append" or "attend"
    live: dict[str, Request]  # the requests alive, by name
    pool: Any  # the factory where it is a kvref.BlockPool, else None
    pool_before: tuple[int, int] | None  # the pool's (in use, free) before the plan
    prefix: PrefixBooks | None  # what each block was last written with, on a prefix pool
    judges_logits: bool  # False on every rank of a sharded run but one
    describe: Callable[[], str]  # the plan so far, for every message

    @property
    def truth(self) -> ReferenceTransformer:
        """The float64 model that half precision and the attend path are measured against."""

    def where(self, text: str) -> str:
        """``text`` with the plan so far and the model's path, for a message."""

    def use_factory(self, factory: CacheFactory, block_hash: Callable | None = None) -> None:
        """Build every later cache from ``factory``."""

    def start(self, name: str, batch: int, reuse: Request | None = None) -> Request:
        """A request on fresh caches, or on the reset caches of ``reuse``."""

    def feed(self, request: Request, new: Tensor, *, compare: bool = True, at: str = "") -> Tensor:
        """The ``Feed`` event: new tokens through the model and the request's caches."""


class Event:
    """One event; a subclass is a dataclass of its arguments and overrides its steps."""

    def run(self, engine: Session) -> Any:
        self.before(engine)
        refusal = self.apply(engine)
        if refusal is not None:
            self.refused(engine, refusal)
            return False
        self.update(engine)
        self.verify(engine)
        self.record(engine)
        return self.result()

    def before(self, engine: Session) -> None:
        pass

    def apply(self, engine: Session) -> Exception | None:
        raise NotImplementedError

    def refused(self, engine: Session, error: Exception) -> None:
        raise error  # an event no cache may refuse

    def update(self, engine: Session) -> None:
        pass

    def verify(self, engine: Session) -> None:
        pass

    def record(self, engine: Session) -> None:
        pass

    def result(self) -> Any:
        return None
