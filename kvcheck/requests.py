"""Requests served side by side from one factory, as a serving engine's scheduler runs them.

A ``RequestPlan`` is an interleaving of events on one model: requests start (on fresh caches,
or on the reset caches of a finished one), are fed their prompt and decode steps in chunks
of their own, fork (parallel samples that then diverge; a shared prompt that a later request
reuses), are truncated, and finish, by ``reset()`` or by being dropped (``del``, then a
garbage collection, so that a pool gets their blocks back), some after leaving rows of nan,
inf or huge values behind. ``serve`` runs a plan: every step of every request must give the
uncached model's logits for that request's own history.

Where the factory is a ``kvref.BlockPool``, a plan runs on a tight pool of the same kind
(``with_blocks``), sized to what the plan needs at its busiest moment plus a small margin, so
that blocks are freed and taken again all the time: a stale or shared block that a request
should not see shows up in its logits. With ``audit``, the pool's books are checked after
every event (``audit_pool``).
"""

from __future__ import annotations

import gc
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

import torch
from hypothesis import strategies as st
from torch import Tensor

from kvcheck import asserts as kvassert
from kvcheck import devices as kvdevices
from kvcheck import failures
from kvcheck import strategies as kvst
from kvcheck.harness import may_refuse
from kvref import (
    BlockPool,
    BlockTables,
    CacheContractError,
    CacheFactory,
    ModelConfig,
    min_nbytes,
)

MAX_LENGTH = 48  # per request; prompts are drawn around the 16-row boundaries below it
MAX_LIVE = 4  # requests alive at once


@dataclass(frozen=True)
class Start:
    """Request ``request`` starts on fresh caches, or on the reset caches of ``reuse``."""

    request: int
    batch: int
    reuse: int | None = None

    def describe(self) -> str:
        caches = "fresh caches" if self.reuse is None else f"the reset caches of r{self.reuse}"
        return f"r{self.request} starts (batch {self.batch}, {caches})"


@dataclass(frozen=True)
class Feed:
    """``size`` new tokens of request ``request``: its prompt, a chunk of it, or decoding."""

    request: int
    size: int

    def describe(self) -> str:
        return f"r{self.request} is fed {self.size} token{'s' * (self.size > 1)}"


@dataclass(frozen=True)
class Fork:
    """Request ``child`` is a fork of ``parent`` (its caches' ``fork()``; where fork is not
    offered, fresh caches fed the parent's history)."""

    parent: int
    child: int

    def describe(self) -> str:
        return f"r{self.child} = fork of r{self.parent}"


@dataclass(frozen=True)
class Truncate:
    """Request ``request`` forgets its last ``back`` tokens, or all when it holds fewer
    (where truncate is offered)."""

    request: int
    back: int

    def describe(self) -> str:
        return f"r{self.request} forgets its last {self.back} tokens"


@dataclass(frozen=True)
class Finish:
    """Request ``request`` ends: its caches are reset (kept for a later request) or dropped;
    with ``poison``, after ``poison_rows`` rows of nan, inf, -inf or huge values."""

    request: int
    how: Literal["reset", "drop"]
    poison: str | None = None
    poison_rows: int = 0

    def describe(self) -> str:
        poisoned = f" after {self.poison_rows} {self.poison} rows" if self.poison else ""
        return f"r{self.request} finishes: {self.how}{poisoned}"


Event = Start | Feed | Fork | Truncate | Finish


@dataclass(frozen=True)
class RequestPlan:
    config: ModelConfig
    dtype: torch.dtype
    events: tuple[Event, ...]
    token_seed: int
    margin: int = 0  # blocks a tight pool has beyond the plan's busiest moment

    @property
    def max_length(self) -> int:
        return MAX_LENGTH

    def tokens(self, index: int, batch: int) -> Tensor:
        """The tokens of event ``index`` (a Feed), from a seed of their own."""
        size = self.events[index].size
        return kvst.random_tokens(self.config, batch, size, seed=self.token_seed * 1000 + index)

    def describe(self, done: int | None = None) -> str:
        """The model, then the events (those up to ``done`` when given)."""
        events = self.events if done is None else self.events[: done + 1]
        lines = [f"#{index} {event.describe()}" for index, event in enumerate(events)]
        more = "" if done is None else f" (then {len(self.events) - done - 1} more events)"
        return (
            f"model: {kvst.describe_config(self.config)}, "
            f"{str(self.dtype).removeprefix('torch.')}\n  interleaving so far{more}: "
            + "; ".join(lines)
        )

    def blocks_needed(self, block_size: int) -> int:
        """The most blocks of ``block_size`` rows the plan's live caches hold at once when
        nothing is shared: ceil(length / block_size) per batch row of each layer's cache."""
        batch: dict[int, int] = {}
        length: dict[int, int] = {}
        busiest = 0
        for event in self.events:
            if isinstance(event, Start):
                batch[event.request], length[event.request] = event.batch, 0
            elif isinstance(event, Feed):
                length[event.request] += event.size
            elif isinstance(event, Fork):
                batch[event.child] = batch[event.parent]
                length[event.child] = length[event.parent]
            elif isinstance(event, Truncate):
                pass  # a refusal keeps everything; the count after it is no higher
            else:
                length[event.request] += event.poison_rows
            held = sum(batch[r] * math.ceil(length[r] / block_size) for r in length)
            busiest = max(busiest, held * self.config.num_layers)
            if isinstance(event, Finish):
                del length[event.request]
        return busiest


@dataclass
class _Drawing:
    """What the strategy knows while it draws: each live request's batch and length."""

    live: dict[int, list[int]] = field(default_factory=dict)  # request -> [batch, length]
    reusable: dict[int, int] = field(default_factory=dict)  # reset request -> batch
    events: list[Event] = field(default_factory=list)
    next_request: int = 0

    def room(self, request: int) -> int:
        return MAX_LENGTH - self.live[request][1]


@st.composite
def request_plans(
    draw,
    *,
    forks: int = 1,
    truncates: bool = False,
    poison: bool = True,
    max_events: int = 10,
) -> RequestPlan:
    """Interleavings of requests on one model: starts, prompts, decode steps, forks (and
    truncates), finishes by reset or drop, and at the end every request finished. ``forks``
    weighs the fork events (0: none); with ``forks`` above 1 every plan forks at least once."""
    state = _Drawing()
    for _ in range(draw(st.integers(2, max_events), label="events")):
        if not state.live:
            _start(draw, state)
            continue
        kinds = ["feed", "feed", "finish"]
        if len(state.live) < MAX_LIVE:
            kinds.append("start")
            # Parallel samples, and the order that breaks engines: a request finishes,
            # another starts into its freed blocks, then its fork decodes.
            kinds += ["fork", "samples", "handoff"] * forks
        if truncates:
            kinds.append("truncate")
        kind = draw(st.sampled_from(kinds), label="event")
        if kind == "start":
            _start(draw, state)
            continue
        request = draw(st.sampled_from(sorted(state.live)), label="request")
        if kind == "feed":
            _feed(draw, state, request)
        elif kind == "finish":
            _finish(draw, state, request, poison)
        elif kind == "truncate":
            back = draw(st.integers(0, state.live[request][1]), label="back")
            # The length drawn on stays the most the caches may hold (a window cache may
            # refuse), so that no later feed can overflow MAX_LENGTH.
            state.events.append(Truncate(request, back))
        elif kind == "fork":
            child = _fork(state, request)
            if draw(st.booleans(), label="feed the fork"):
                _feed(draw, state, child, decode=True)
        elif kind == "samples":
            for _ in range(draw(st.integers(1, MAX_LIVE - len(state.live)), label="samples")):
                _feed(draw, state, _fork(state, request), decode=True)
        else:
            _handoff(draw, state, request, poison)
    if forks > 1 and not any(isinstance(event, Fork) for event in state.events):
        if len(state.live) == MAX_LIVE:
            _finish(draw, state, max(state.live), poison)
        if not state.live:
            _start(draw, state)
        _handoff(draw, state, min(state.live), poison)
    for request in sorted(state.live):
        _finish(draw, state, request, poison)
    return RequestPlan(
        config=draw(kvst.model_configs(max_layers=2), label="config"),
        dtype=draw(kvst.dtypes_on_device(kvst.DTYPES), label="dtype"),
        events=tuple(state.events),
        token_seed=draw(st.integers(0, 2**16), label="token seed"),
        margin=draw(st.sampled_from((0, 0, 1, 3)), label="spare blocks"),
    )


def _handoff(draw, state: _Drawing, request: int, poison: bool) -> None:
    """Fork ``request``, finish it, start another request (into its freed blocks), then
    decode the fork: a refcount or table bug hands the fork the newcomer's rows."""
    child = _fork(state, request)
    _finish(draw, state, request, poison)
    _start(draw, state)
    _feed(draw, state, child, decode=True)


def _start(draw, state: _Drawing) -> None:
    request, state.next_request = state.next_request, state.next_request + 1
    reuse = None
    if state.reusable and draw(st.booleans(), label="reuse reset caches"):
        reuse = draw(st.sampled_from(sorted(state.reusable)), label="reused")
        batch = state.reusable.pop(reuse)
    else:
        batch = draw(st.integers(1, 3), label="batch")
    state.events.append(Start(request, batch, reuse))
    state.live[request] = [batch, 0]
    _feed(draw, state, request)


def _feed(draw, state: _Drawing, request: int, *, decode: bool = False) -> None:
    if not state.live[request][1] and not decode:
        sizes = kvst.prompt_sizes
    else:
        sizes = st.one_of(st.just(1), st.integers(2, 4), kvst.chunk_sizes)
    size = min(draw(sizes, label="tokens"), state.room(request))
    if size:
        state.events.append(Feed(request, size))
        state.live[request][1] += size


def _fork(state: _Drawing, parent: int) -> int:
    child, state.next_request = state.next_request, state.next_request + 1
    state.events.append(Fork(parent, child))
    state.live[child] = list(state.live[parent])
    return child


def _finish(draw, state: _Drawing, request: int, poison: bool) -> None:
    how = draw(st.sampled_from(("drop", "reset")), label="finish by")
    kind, rows = None, min(draw(st.integers(1, 3), label="poison rows"), state.room(request))
    if poison and rows and draw(st.booleans(), label="poisoned"):
        kind = draw(st.sampled_from(sorted(kvst.POISON_VALUES)), label="poison")
    state.events.append(Finish(request, how, kind, rows if kind else 0))
    batch, _ = state.live.pop(request)
    if how == "reset":
        state.reusable[request] = batch


@dataclass
class Served:
    """A request being served: its caches (one per layer) and every token it was fed."""

    name: str
    caches: list | None
    history: Tensor
    steps: int = 0


def tight_pool(factory: CacheFactory, plan: RequestPlan) -> CacheFactory:
    """The factory a plan runs on: a pool of the same kind with room for the plan's busiest
    moment and ``plan.margin`` blocks more, when the factory is a BlockPool; else itself."""
    if not isinstance(factory, BlockPool):
        return factory
    return factory.with_blocks(plan.blocks_needed(factory.block_size) + plan.margin)


def serve(factory: CacheFactory, plan: RequestPlan, *, audit: bool = False) -> None:
    """Run ``plan`` on caches from ``factory``; every step of every request must give the
    uncached model's logits for its own history. With ``audit`` (a BlockPool factory),
    check the pool's books after every event and that every block is back at the end."""
    with young_objects_only():
        _serve(factory, plan, audit=audit)


@contextmanager
def young_objects_only() -> Iterator[None]:
    """Collections inside look only at objects made inside: a full collection of a test
    process's heap takes some 200 ms, and a plan drops caches many times."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _serve(factory: CacheFactory, plan: RequestPlan, *, audit: bool) -> None:
    model = kvst.build_model(plan.config, plan.dtype)
    served: dict[int, Served] = {}
    reusable: dict[int, list] = {}
    capacity = factory.blocks_in_use + factory.blocks_free if audit else 0
    in_use_before = factory.blocks_in_use if audit else 0
    for index, event in enumerate(plan.events):
        where = f"event #{index} ({event.describe()})\n  {plan.describe(index)}"
        try:
            run_event(model, factory, event, index, served, reusable, plan, where)
        except ValueError as error:
            if isinstance(error, CacheContractError) or not isinstance(factory, BlockPool):
                raise
            raise failures.RefusesValidInput(
                f"the pool refused a step the plan needs: {type(error).__name__}: {error}; "
                f"blocks_in_use {factory.blocks_in_use}, blocks_free {factory.blocks_free}, "
                f"while the caches alive need at most "
                f"{plan.blocks_needed(factory.block_size)} blocks of {factory.block_size} "
                f"rows even unshared: blocks were not given back, or more were taken than "
                f"the rows need\n  at {where}"
            ) from error
        if audit:
            live = [*served.values(), *reusable.values()]
            audit_pool(factory, live, capacity=capacity, where=where)
            live = None
    if audit:
        served.clear()
        reusable.clear()
        gc.collect()
        in_use = factory.blocks_in_use
        if in_use != in_use_before or factory.blocks_free != capacity - in_use_before:
            raise failures.DataLoss(
                f"the pool: every request finished (reset or dropped and collected), yet "
                f"blocks_in_use is {in_use} and blocks_free {factory.blocks_free}, where "
                f"{in_use_before} and {capacity - in_use_before} were before the requests "
                f"started: blocks leaked\n  {plan.describe()}"
            )


def run_event(model, factory, event: Event, index: int, served: dict, reusable: dict, plan, where):
    """One event of the plan. Its own frame holds the caches it touches, so that none of
    them outlives the event here (a dropped request's caches must be collectable)."""
    if isinstance(event, Start):
        served[event.request] = start(model, factory, event, reusable, where)
    elif isinstance(event, Feed):
        request = served[event.request]
        feed(model, request, plan.tokens(index, request.history.shape[0]), plan, index)
    elif isinstance(event, Fork):
        child = fork(model, factory, served[event.parent], f"r{event.child}", plan, index)
        served[event.child] = child
    elif isinstance(event, Truncate):
        truncate(model, served[event.request], event.back, where)
    else:
        finish(served.pop(event.request), event, reusable, plan)


def start(model, factory, event: Start, reusable: dict, where: str) -> Served:
    """A new request on fresh caches, or on the reset caches of a finished one."""
    if event.reuse is None:
        caches = model.new_caches(factory, batch=event.batch, max_length=MAX_LENGTH)
    else:
        caches = reusable.pop(event.reuse).caches
    kvassert.fail_if_not_empty(caches, where)
    history = torch.empty(event.batch, 0, dtype=torch.long, device=kvdevices.current())
    return Served(f"r{event.request}", caches, history)


def feed(model, request: Served, new: Tensor, plan: RequestPlan, index: int) -> None:
    """Feed ``new`` tokens to ``request`` and compare each new position's logits with the
    uncached model's on the request's whole history."""
    start = request.history.shape[1]
    end = start + new.shape[1]
    kind = "prompt" if start == 0 else "decode"
    where = (
        f"request {request.name}, its step #{request.steps} ({kind} of {new.shape[1]} token(s) at "
        f"absolute positions {start}..{end - 1}), event #{index}\n  {plan.describe(index)}"
    )
    with attention_outputs(model) as cached:
        try:
            logits = model(new, caches=request.caches)
        except Exception as error:
            error.add_note(f"  at {where}")
            raise
    request.history = torch.cat((request.history, new), dim=1)
    request.steps += 1
    expected = model(request.history)[:, start:]
    try:
        kvassert.assert_close_at(
            logits,
            expected,
            what="cached and uncached logits",
            where=where,
            position_axis=1,
            first_position=start,
        )
    except failures.WrongResults as error:
        error.add_note(first_wrong_layer(model, request.history, cached, start))
        raise
    for layer, cache in enumerate(request.caches):
        kvassert.assert_length(cache, end, who=f"{request.name}'s layer {layer}", where=where)


@contextmanager
def attention_outputs(model) -> Iterator[list[Tensor]]:
    """Each layer's attention output during the calls inside, in layer order."""
    outputs: list[Tensor] = []
    handles = [
        block.attention.register_forward_hook(lambda _m, _i, out: outputs.append(out[0]))
        for block in model.blocks
    ]
    try:
        yield outputs
    finally:
        for handle in handles:
            handle.remove()


def first_wrong_layer(model, history: Tensor, cached: list[Tensor], start: int) -> str:
    """Which layer's attention first differs from the uncached pass's (later layers inherit
    its error): the layer whose cache to look at."""
    with attention_outputs(model) as uncached:
        model(history)
    for layer, (got, want) in enumerate(zip(cached, uncached, strict=True)):
        want = want[:, start:]
        if not torch.isclose(got, want, **kvassert.TOLERANCES[want.dtype]).all():
            gap = (got - want).abs().nan_to_num(math.inf).max().item()
            return (
                f"  diagnosis: layer {layer} is the first whose attention output differs from "
                f"the uncached pass's (max |diff| {gap:.3g})"
            )
    return "  diagnosis: every layer's attention output matched; the difference is elsewhere"


def fork(model, factory, parent: Served, name: str, plan: RequestPlan, index: int) -> Served:
    """A fork of ``parent``: every layer's ``fork()``, or where the caches offer none, fresh
    caches fed the parent's history as one prompt (an engine without prefix sharing)."""
    where = f"event #{index} ({name} = fork of {parent.name})\n  {plan.describe(index)}"
    history = parent.history.clone()
    if all(callable(getattr(cache, "fork", None)) for cache in parent.caches):
        child = Served(name, [cache.fork() for cache in parent.caches], history)
        for layer, cache in enumerate(child.caches):
            who = f"{name}'s layer {layer}"
            kvassert.assert_length(cache, history.shape[1], who=who, where=where)
        return child
    batch = history.shape[0]
    caches = model.new_caches(factory, batch=batch, max_length=MAX_LENGTH)
    child = Served(name, caches, history[:, :0])
    feed(model, child, history, plan, index)
    return child


def truncate(model, request: Served, back: int, where: str) -> None:
    """Truncate every layer of ``request`` by ``back`` tokens; a window layer may refuse as
    the contract allows (then the history stays), where truncate is offered at all."""
    if not all(callable(getattr(cache, "truncate", None)) for cache in request.caches):
        return
    held = request.history.shape[1]
    target = max(held - back, 0)  # all of them when fewer are held
    error = kvassert.raised_by(lambda: model.truncate(request.caches, target))
    if error is None:
        request.history = request.history[:, :target]
    elif not (isinstance(error, ValueError) and may_refuse(model.config, held, target)):
        raise failures.RefusesValidInput(
            f"{request.name}: truncate from {held} tokens to {target} refused with "
            f"{type(error).__name__}: {error}; no layer may refuse it\n  at {where}"
        ) from error


def finish(request: Served, event: Finish, reusable: dict, plan: RequestPlan) -> None:
    """Poison the request's caches if the plan says so, then reset them (kept for a later
    request) or drop them: the last reference goes, and a collection runs."""
    if event.poison:
        c = plan.config
        shape = (request.history.shape[0], c.num_kv_heads, event.poison_rows, c.head_dim)
        poison = kvst.poison_value(event.poison, plan.dtype)
        bad = torch.full(shape, poison, dtype=plan.dtype, device=kvdevices.current())
        for cache in request.caches:
            cache.append(bad, bad.clone())
    if event.how == "reset":
        for cache in request.caches:
            cache.reset()
        reusable[event.request] = Served(request.name, request.caches, request.history[:, :0])
        request.caches = None
    else:
        request.caches = None
        gc.collect()


def audit_pool(pool: BlockPool, live: list[Served], *, capacity: int, where: str) -> None:
    """The pool's books against the live caches: blocks_in_use + blocks_free is the pool's
    room; blocks_in_use is the number of distinct ids in the live caches' block tables (when
    they show them, else within sound bounds); each row's table has ceil(rows / block_size)
    entries; each cache's nbytes covers what it holds."""
    in_use, free, size = pool.blocks_in_use, pool.blocks_free, pool.block_size
    if in_use + free != capacity:
        raise failures.DataLoss(
            f"the pool: blocks_in_use {in_use} + blocks_free {free} = {in_use + free}, but "
            f"the pool has room for {capacity} blocks\n  after {where}"
        )
    ids: set[int] = set()
    tables_shown = True
    most, least = 0, 0
    for request in live:
        for layer, cache in enumerate(request.caches or ()):
            length = cache.length
            who = f"{request.name}'s layer {layer}"
            spec = getattr(cache, "spec", None)
            window = getattr(spec, "window", None)
            kept = length if window is None else min(length, window - 1)
            most += request.history.shape[0] * math.ceil(length / size)
            least = max(least, math.ceil(kept / size))
            if spec is not None and cache.nbytes < min_nbytes(spec, length):
                raise failures.WrongResults(
                    f"{who}: nbytes is {cache.nbytes} holding {length} tokens, which take at "
                    f"least {min_nbytes(spec, length)} bytes (each cache counts every block "
                    f"it reads, shared ones included)\n  after {where}"
                )
            if not isinstance(cache, BlockTables):
                tables_shown = False
                continue
            for row, table in enumerate(cache.block_tables):
                fewest = math.ceil(kept / size)
                if not fewest <= len(table) <= math.ceil(length / size):
                    count = (
                        f"{fewest}"
                        if fewest == math.ceil(length / size)
                        else f"{fewest} to {math.ceil(length / size)}"
                    )
                    raise failures.DataLoss(
                        f"{who}: batch row {row}'s block table has {len(table)} entries "
                        f"{table} holding {length} tokens in blocks of {size}: it needs "
                        f"{count}\n  after {where}"
                    )
                ids.update(table)
    if tables_shown and in_use != len(ids):
        raise failures.DataLoss(
            f"the pool: blocks_in_use is {in_use}, but the live caches' block tables "
            f"reference {len(ids)} distinct blocks\n  after {where}"
        )
    if not least <= in_use <= most:
        raise failures.DataLoss(
            f"the pool: blocks_in_use is {in_use}; the live caches need at least {least} and "
            f"at most {most} blocks\n  after {where}"
        )


# Pinned plans, tried first on every run: the orders where serving engines broke.
_tiny = ModelConfig(vocab_size=11, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4, seed=3)
PINNED_FORKS = (
    # Parent and fork both write into the partly filled block they share (copy-on-write).
    RequestPlan(
        _tiny,
        torch.float64,
        (
            Start(0, 2),
            Feed(0, 5),
            Fork(0, 1),
            Feed(1, 3),
            Feed(0, 3),
            Feed(1, 1),
            Finish(0, "drop"),
            Finish(1, "drop"),
        ),
        token_seed=1,
    ),
    # A request finishes, another is served into its freed blocks, then its fork decodes
    # (reference counts of shared blocks).
    RequestPlan(
        _tiny,
        torch.float64,
        (
            Start(0, 1),
            Feed(0, 17),
            Fork(0, 1),
            Finish(0, "drop"),
            Start(2, 1),
            Feed(2, 20),
            Feed(1, 1),
            Finish(1, "drop"),
            Finish(2, "drop"),
        ),
        token_seed=2,
    ),
)
PINNED = (
    *PINNED_FORKS,
    # A request's reset caches serve a new request while another holds their old blocks
    # (block tables cleared on reset).
    RequestPlan(
        _tiny,
        torch.float64,
        (
            Start(0, 1),
            Feed(0, 20),
            Finish(0, "reset"),
            Start(1, 1),
            Feed(1, 20),
            Start(2, 1, reuse=0),
            Feed(2, 5),
            Feed(1, 1),
            Finish(1, "drop"),
            Finish(2, "drop"),
        ),
        token_seed=3,
    ),
)
