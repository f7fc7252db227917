"""The session engine: every property that runs the model drives its caches through it.

An ``Engine`` holds one reference model, the factory under test and the requests alive on
it (``kvcheck.session.request``). A plan is a sequence of events, each a unit of its own in
``kvcheck.session.events``: the calls it makes on the caches, what the engine's books (the
oracle) learn from it, and what must hold after it (``kvcheck.session.events.base``). The
engine starts requests, runs events (``apply``; each event also has a method of its own
name, which builds it and runs it; ``play`` runs a plan's event, ``kvcheck.plan_events``, on
a request), and checks what holds after every event whatever the
plan (``check``, ``finish``):

- every layer's length is the history's;
- the rows every live cache last returned are read again after the others were called,
  since a returned view lives until that cache's own next call (``check_views``);
- where the factory is a ``kvref.BlockPool``, its books are audited (``kvcheck.pool_books``),
  and at the end every block is back.

A property builds its plan out of these events; nothing else calls a cache in a session. A
new event is a new module in ``kvcheck.session.events`` and, for plans that call it by name,
a method here that builds it.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from kvcheck import asserts as kvassert
from kvcheck import devices as kvdevices
from kvcheck import failures, pool_books
from kvcheck import plan_events as plan
from kvcheck import tensors as kvtensors
from kvcheck.harness import assert_views_kept, builder, record
from kvcheck.prefix_books import PrefixBooks
from kvcheck.session import pairs
from kvcheck.session.checks import check_lengths
from kvcheck.session.events.base import Event
from kvcheck.session.events.feed import Feed
from kvcheck.session.events.feed_rows import FeedRows
from kvcheck.session.events.fork import Fork
from kvcheck.session.events.move import Move
from kvcheck.session.events.offload import Offload, Restore
from kvcheck.session.events.prefix import Declare, Lookup
from kvcheck.session.events.reorder import Reorder
from kvcheck.session.events.reset import Drop, Poison, Reset
from kvcheck.session.events.rows import Join, ResetAt, SelectRows, TruncateRows
from kvcheck.session.events.shift import Shift, ShiftRows
from kvcheck.session.events.tree import CommitTree, DraftTree
from kvcheck.session.events.truncate import Truncate
from kvcheck.session.request import Request
from kvref import (
    BlockPool,
    CacheFactory,
    CacheRows,
    PrefixCaching,
    ReferenceTransformer,
    capabilities,
)


class Engine:
    """One model and the requests alive on caches from one factory."""

    def __init__(
        self,
        factory: CacheFactory,
        model: ReferenceTransformer,
        *,
        max_length: int,
        path: str = "append",
        blocks: int = 4096,
        block_hash: Callable | None = None,
        describe: Callable[[], str] = lambda: "",
    ) -> None:
        self.model = model
        self.max_length = max_length
        self.path = path
        self.describe = describe  # the plan so far, for every message
        self.live: dict[str, Request] = {}
        self.blocks = blocks
        # False on every rank of a sharded run but one: their logits are the same numbers.
        self.judges_logits = True
        self.use_factory(factory, block_hash)

    def use_factory(self, factory: CacheFactory, block_hash: Callable | None = None) -> None:
        """Build every later cache from ``factory``: on a pool of its own, so that the books
        can be audited against this engine's caches (keyed by ``block_hash`` where given: a
        prefix-caching pool, section 9.1)."""
        blocks = self.blocks
        self.factory = pool_books.fresh_pool(factory, blocks, block_hash)
        self.pool = self.factory if isinstance(self.factory, BlockPool) else None
        # What each block was last written with, where a pool shares blocks by content.
        prefix = isinstance(self.factory, PrefixCaching)
        self.prefix = PrefixBooks(self.factory.block_size) if prefix else None
        # A fresh pool holds nothing yet; the books compare what this engine's caches hold
        # against what was there before, and its room must be what was asked for.
        self.pool_before = self._pool_counts()
        if self.pool is not None and sum(self.pool_before) != blocks:
            raise failures.DataLoss(
                f"the pool: with_blocks({blocks}) gave a pool with blocks_in_use "
                f"{self.pool_before[0]} + blocks_free {self.pool_before[1]}, not room for "
                f"{blocks} blocks\n  {self.where('before the plan')}"
            )

    # --- the oracle -------------------------------------------------------------------
    @functools.cached_property
    def truth(self) -> ReferenceTransformer:
        """The float64 model: what a half-precision run, or a full-precision run on the
        attend path, is measured against."""
        return kvtensors.build_model(self.model.config, torch.float64)

    def where(self, text: str) -> str:
        plan = self.describe()
        path = f"the model's {self.path} path through the caches"
        return f"{text}\n  {plan}\n  on {path}" if plan else f"{text}\n  on {path}"

    # --- requests and events --------------------------------------------------------------
    def start(self, name: str, batch: int, reuse: Request | None = None) -> Request:
        """A request on fresh caches from the factory, or on the reset caches of ``reuse``."""
        if reuse is None:
            built = self.model.new_caches(
                builder(self.factory), batch=batch, max_length=self.max_length
            )
            caches = record(built, self.model.config, self.path)
        else:
            caches, reuse.caches = reuse.caches, None
            self.live.pop(reuse.name, None)
            last_event = getattr(reuse, "last_event", None)  # its reset meets what follows
        kvassert.fail_if_not_empty(caches, self.where(f"{name} starts"))
        history = torch.empty(batch, 0, dtype=torch.long, device=kvdevices.current())
        offered = frozenset(capabilities(caches[0].cache))
        request = Request(name, caches, history, offered=offered)
        if reuse is not None:
            request.last_event = last_event
        self.live[name] = request
        return request

    def apply(self, event: Event) -> Any:
        """Run ``event`` on this engine's caches and books (``Event.run``), and note the
        pair of events it completes on its request (``kvcheck.session.pairs``). A request
        left poisoned rows (``Poison``) takes a reset, more poison or its end only: its
        history is over, and the oracle knows nothing of what follows the garbage."""
        request = getattr(event, "request", getattr(event, "parent", None))
        if (
            request is not None
            and request.poisoned
            and not isinstance(event, Reset | Drop | Poison)
        ):
            raise TypeError(
                f"{type(event).__name__} on {request.name}, which holds {request.poisoned} "
                "poisoned rows past its history: only a reset or its end may follow them"
            )
        result = event.run(self)
        pairs.noted(event, self, result)
        return result

    # Each event by its name, as the plans call them; the event's unit says what it does.
    def feed(self, request: Request, new: Tensor, *, compare: bool = True, at: str = "") -> Tensor:
        return self.apply(Feed(request, new, compare=compare, at=at))

    def truncate(self, request: Request, target: int, *, at: str = "") -> bool:
        return self.apply(Truncate(request, target, at=at))

    def reorder(self, request: Request, indices: Tensor, *, at: str = "") -> None:
        self.apply(Reorder(request, indices, at=at))

    def fork(self, parent: Request, name: str, *, at: str = "") -> Request:
        return self.apply(Fork(parent, name, at=at))

    def poison(self, request: Request, kind: str, rows: int) -> None:
        self.apply(Poison(request, kind, rows))

    def reset(self, request: Request) -> None:
        self.apply(Reset(request))

    def drop(self, request: Request) -> None:
        self.apply(Drop(request))

    def shift(self, request: Request, start: int, count: int, *, at: str = "") -> bool:
        return self.apply(Shift(request, start, count, at=at))

    def shift_rows(self, request: Request, starts: list[int], counts: list[int], *, at="") -> bool:
        return self.apply(ShiftRows(request, starts, counts, at=at))

    def feed_rows(
        self, request: Request, new: list[Tensor], *, pad: str = "nan", at: str = ""
    ) -> None:
        self.apply(FeedRows(request, new, pad=pad, at=at))

    def truncate_rows(self, request: Request, keep: list[int], *, at: str = "") -> bool:
        return self.apply(TruncateRows(request, keep, at=at))

    def select_rows(self, request: Request, indices: list[int], *, at: str = "") -> None:
        self.apply(SelectRows(request, indices, at=at))

    def join(self, request: Request, other: Request, *, at: str = "") -> None:
        self.apply(Join(request, other, at=at))

    def reset_at(self, request: Request, firsts: list[int], *, at: str = "") -> None:
        self.apply(ResetAt(request, firsts, at=at))

    def lookup(self, request: Request, tokens: Tensor, *, at: str = "") -> int:
        return self.apply(Lookup(request, tokens, at=at))

    def declare(self, request: Request, tokens: Tensor) -> None:
        self.apply(Declare(request, tokens))

    def offload(self, request: Request, *, at: str = "") -> None:
        self.apply(Offload(request, at=at))

    def restore(self, request: Request, *, at: str = "") -> None:
        self.apply(Restore(request, at=at))

    def move(
        self,
        request: Request,
        factory: CacheFactory,
        *,
        path: str,
        carry: Callable[[CacheRows], CacheRows] = lambda rows: rows,
        at: str = "",
    ) -> None:
        self.apply(Move(request, factory, path, carry=carry, at=at))

    def draft_tree(
        self,
        request: Request,
        parents: tuple[int, ...],
        new: Tensor,
        *,
        poisoned: tuple[tuple[int, ...], ...],
        poison: float,
        accepted: tuple[tuple[int, ...], ...],
        label: str,
    ) -> list[tuple[Tensor, Tensor]]:
        return self.apply(DraftTree(request, parents, new, poisoned, poison, accepted, label))

    def commit_tree(
        self,
        request: Request,
        handed: list[tuple[Tensor, Tensor]],
        new: Tensor,
        accepted: tuple[tuple[int, ...], ...],
        *,
        label: str,
    ) -> None:
        self.apply(CommitTree(request, handed, new, accepted, label))

    # --- a plan's events --------------------------------------------------------------------
    def offers(self, request: Request, event: object) -> bool:
        """Whether ``request``'s caches offer what a plan's ``event`` needs of them
        (``kvcheck.plan_events.NEEDS``; a fork where fork is not offered is fresh caches fed
        the history: offered)."""
        need = plan.NEEDS.get(type(event))
        return need is None or need in request.offered

    def play(
        self,
        request: Request,
        event: plan.Feed
        | plan.Truncate
        | plan.TruncateTo
        | plan.Reorder
        | plan.Shift
        | plan.Fork
        | plan.Reset
        | plan.Poison,
        *,
        new: Tensor | None = None,
        compare: bool = True,
        at: str = "",
    ) -> bool:
        """Run a plan's event on ``request`` (``kvcheck.plan_events``: what ``r0 forgets its
        last 3 tokens`` calls and books) where its caches offer it (``offers``): whether it
        ran (False: not offered, or a truncate or shift a window refused, as section 8.4
        allows), so that an area notes only what ran. A feed brings ``new``, its tokens
        (compared with the oracle's logits unless ``compare`` is False: the caller compares
        them); a fork's child is named ``r<child>``. The one translation every area whose
        plans name requests shares; events that need more than the plan says (a move's
        factory, a tree's tokens) are the area's."""
        if isinstance(event, plan.Feed):
            if new is None or new.shape[1] != event.size:
                raise ValueError(f"{event.describe()}: play needs its {event.size} new tokens")
            self.feed(request, new, compare=compare, at=at)
            return True
        if not self.offers(request, event):
            return False
        if isinstance(event, plan.Truncate | plan.TruncateTo):
            return self.truncate(request, event.target(request.held), at=at)
        if isinstance(event, plan.Shift):
            return self.shift(request, event.start, event.count, at=at)
        if isinstance(event, plan.Reorder):
            self.reorder(request, torch.tensor(event.indices, device=request.history.device), at=at)
            return True
        if isinstance(event, plan.Fork):  # where fork is not offered, fresh caches fed the history
            self.fork(request, f"r{event.child}", at=at)
            return True
        if isinstance(event, plan.Reset):
            self.reset(request)
            return True
        if isinstance(event, plan.Poison):
            self.poison(request, event.kind, event.rows)
            return True
        raise ValueError(f"{event!r} is no event a request plays alone")

    # --- what holds after every event -----------------------------------------------------
    def check(self, event: str) -> None:
        """After an event: every layer of every live request holds its history, the views
        every live cache returned still hold their rows, and the pool's books are right."""
        for request in self.live.values():
            if request.caches is not None:
                check_lengths(self, request, event)
        where = self.where(f"after {event}")
        assert_views_kept(
            {
                f"{request.name}'s layer {layer}": cache
                for request in self.live.values()
                for layer, cache in enumerate(request.caches or ())
            },
            where=where,
        )
        if self.pool is not None:
            pool_books.audit(self.pool, self, where=where)

    def _pool_counts(self) -> tuple[int, int] | None:
        return None if self.pool is None else (self.pool.blocks_in_use, self.pool.blocks_free)

    def finish(self, *, blocks_back: bool = True) -> None:
        """Every request dropped: a pool must then have every block back (``blocks_back``;
        off where the caller may still hold a recorder, as a check looping over steps)."""
        for request in list(self.live.values()):
            self.drop(request)
        if self.pool is not None and blocks_back:
            gc.collect()
            pool_books.all_back(self.pool, self.pool_before, where=self.where("at the end"))
