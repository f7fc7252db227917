"""A prefix-caching pool (contract, section 9.1): ``Lookup`` declares a request's tokens to
its empty caches and takes the longest prefix the pool already holds; ``Declare`` tells the
caches the tokens they are to be fed next, so that a pool can key the blocks they fill.

A hit skips the feed that would have checked those positions, so the lookup is checked here
against the prefix books (``kvcheck.prefix_books``): a hit is whole blocks, no more tokens
than asked, every layer holds it, and each block it maps was last written full, in that
layer, for this salt and these tokens; and it finds at least the blocks of that prefix a live
request holds, which the pool must have published and cannot have evicted. The books then
take the hit as the request's history.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from kvcheck import asserts as kvassert
from kvcheck import failures
from kvcheck.session.events.base import Event, Session
from kvcheck.session.request import Request
from kvref.protocol import is_count


@dataclass
class Lookup(Event):
    """``request`` looks up ``tokens`` (batch, count); the result is the tokens it found."""

    request: Request
    tokens: Tensor
    at: str = ""

    def before(self, engine: Session) -> None:
        request, tokens = self.request, self.tokens
        self.where = engine.where(
            f"{request.name} looks up its first {tokens.shape[1]} tokens (salt "
            f"{request.salt!r}){self.at}"
        )
        # Before the call: what the live requests hold now is what the pool must find.
        self.least, self.holder = engine.prefix.least_hit(engine, request, tokens)

    def apply(self, engine: Session) -> None:
        raw = [recorder.cache for recorder in self.request.caches]
        hit = engine.pool.lookup_prefix(raw, self.tokens, salt=self.request.salt)
        size = engine.pool.block_size
        # Its form before anything reads it: the books slice the tokens by it.
        if not is_count(hit) or hit > self.tokens.shape[1] or hit % size:
            raise failures.DataLoss(
                f"lookup_prefix returned {hit!r}: a number of tokens from 0 to "
                f"{self.tokens.shape[1]}, in whole blocks of {size}, was due\n  {self.where}"
            )
        self.hit = hit

    def update(self, engine: Session) -> None:
        self.request.history = self.tokens[:, : self.hit].clone()
        self.request.looked_up = self.tokens.shape[1]

    def verify(self, engine: Session) -> None:
        request, tokens, hit, where = self.request, self.tokens, self.hit, self.where
        for layer, cache in enumerate(request.caches):
            who = f"{request.name}'s layer {layer}"
            kvassert.assert_length(cache, hit, who=who, where=where)
        engine.prefix.check_hit(request, tokens, hit, where)
        if hit < self.least:
            raise failures.DataLoss(
                f"lookup_prefix found {hit} tokens, but {self.holder} holds the first "
                f"{self.least} (salt {request.salt!r}) in full blocks written once each, which "
                f"the pool must have published and cannot have evicted: the index lost them "
                f"(or keys them by something that changes)\n  {where}"
            )

    def result(self) -> int:
        return self.hit


@dataclass
class Declare(Event):
    """The tokens ``request`` is to be fed next, declared to every layer before."""

    request: Request
    tokens: Tensor

    def apply(self, engine: Session) -> None:
        for recorder in self.request.caches:
            recorder.views = recorder.rows_returned = None  # a call: its views may go
            recorder.cache.declare_tokens(self.tokens)
