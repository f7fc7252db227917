"""Requests served side by side from one factory, as a serving engine's scheduler runs them.

A ``RequestPlan`` is an interleaving of events on one model: requests start (on fresh caches,
or on the reset caches of a finished one), are fed their prompt and decode steps in chunks
of their own, fork (parallel samples that then diverge; a shared prompt that a later request
reuses), are truncated and reordered (where offered), and finish, by ``reset()`` or by being
dropped (``del``, then a garbage collection, so that a pool gets their blocks back), some
after leaving rows of nan, inf or huge values behind. Every step of every request must give
the uncached model's logits for that request's own history (the session engine checks it).

Where the factory is a ``kvref.BlockPool``, a plan runs on a tight pool of the same kind
(``with_blocks``), sized to what the plan needs at its busiest moment plus a small margin, so
that blocks are freed and taken again all the time, and the pool's books are audited after
every event (``kvcheck.pool_books``).

- ``requests``: on every factory (forks where offered, else a fresh prefill of the history);
- ``fork``: plans that fork often, with truncates, where ``fork()`` is offered.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Literal

import torch
from hypothesis import strategies as st
from torch import Tensor

from kvcheck import failures, grammar, reach
from kvcheck import scope as kvscope
from kvcheck import sizes as kvsizes
from kvcheck import strategies as kvst
from kvcheck import tensors as kvtensors
from kvcheck.devices import dtype_name
from kvcheck.harness import PATHS, build
from kvcheck.kit import KitTests, Property, on_both_paths, path_for, property_test
from kvcheck.plan_events import (
    Feed,
    Fork,
    Poison,
    Reorder,
    Start,
    Truncate,
    reorder_indices,
    truncate_backs,
)
from kvcheck.reach import Edge
from kvcheck.session import Engine, Request
from kvref import BlockPool, CacheContractError, CacheFactory, ModelConfig, capabilities
from kvref.reprs import short_repr

MAX_LENGTH = 48  # per request; prompts are drawn around the 16-row boundaries below it
MAX_LIVE = 4  # requests alive at once


@dataclass(frozen=True)
class Finish:
    """Request ``request`` ends: its caches are reset (kept for a later request) or dropped,
    some right after it was left rows of garbage (a ``Poison`` before it)."""

    request: int
    how: Literal["reset", "drop"]

    def describe(self) -> str:
        return f"r{self.request} finishes: {self.how}"


Event = Start | Feed | Fork | Truncate | Reorder | Poison | Finish


@short_repr
@dataclass(frozen=True)
class RequestPlan:
    config: ModelConfig
    dtype: torch.dtype
    events: tuple[Event, ...]
    token_seed: int
    margin: int = 0  # blocks a tight pool has beyond the plan's busiest moment
    path: str = "append"  # the model's path through a cache that offers attend

    @property
    def max_length(self) -> int:
        return MAX_LENGTH

    def tokens(self, index: int, batch: int) -> Tensor:
        """The tokens of event ``index`` (a Feed), from a seed of their own."""
        size = self.events[index].size
        return kvtensors.random_tokens(
            self.config, batch, size, seed=self.token_seed * 1000 + index
        )

    def describe(self, done: int | None = None) -> str:
        """The model, then the events (those up to ``done`` when given)."""
        events = self.events if done is None else self.events[: done + 1]
        lines = [f"#{index} {event.describe()}" for index, event in enumerate(events)]
        left = 0 if done is None else len(self.events) - done - 1
        more = f" ({left} of {len(self.events)} events not yet run)" if left else ""
        return (
            f"model: {kvst.describe_config(self.config)}, "
            f"{dtype_name(self.dtype)}\n  interleaving so "
            f"far{more}: " + "; ".join(lines)
        )

    def summary(self) -> tuple[str, str, str]:
        fed = sum(event.size for event in self.events if isinstance(event, Feed))
        events = "; ".join(event.describe() for event in self.events)
        batches = {event.batch for event in self.events if isinstance(event, Start)}
        return f"{fed} ({events})", str(self.config.num_layers), "/".join(map(str, batches))

    def blocks_needed(self, block_size: int, offered: Collection[str] = frozenset()) -> int:
        """The most blocks of ``block_size`` rows the plan's live caches hold at once when
        nothing is shared: ceil(length / block_size) per batch row of each layer's cache.
        The same whatever the caches offer (``offered``): a truncate is counted as shortening
        nothing, and a fork counts the parent's length for the child, which is what fresh
        caches fed the parent's history hold where fork is not offered, the parent live."""
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
            elif isinstance(event, Poison):
                length[event.request] += event.rows
            # (a truncate or a reorder: the count after either is no higher; a refused
            # truncate keeps all)
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
    reorders: bool = True,
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
            if len(state.live) < MAX_LIVE:
                # Speculative decoding on a parallel sample: a draft rejected on a fork,
                # rewriting positions in a block the parent still reads.
                kinds += ["draft on a fork"] * forks
        if reorders:
            kinds.append("reorder")
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
            back = draw(truncate_backs(state.live[request][1]), label="back")
            # The length drawn on stays the most the caches may hold (a window cache may
            # refuse), so that no later feed can overflow MAX_LENGTH.
            state.events.append(Truncate(request, back))
        elif kind == "reorder":
            indices = draw(reorder_indices(state.live[request][0]), label="indices")
            state.events.append(Reorder(request, indices))
        elif kind == "fork":
            child = _fork(state, request)
            if draw(st.booleans(), label="feed the fork"):
                _feed(draw, state, child, decode=True)
        elif kind == "draft on a fork":
            child = _fork(state, request)
            drafting, other = draw(st.permutations((child, request)), label="drafting, other")
            back = draw(st.integers(1, 4), label="rejected")
            state.events.append(Truncate(drafting, back))  # its drawn length stays, as above
            _feed(draw, state, drafting, decode=True)
            if draw(st.booleans(), label="the other decodes"):
                _feed(draw, state, other, decode=True)
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
        path=draw(st.sampled_from(PATHS), label="path"),
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
        batch = draw(kvsizes.batches(small_max=3, room=3), label="batch")
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
    rows = min(draw(st.integers(1, 3), label="poison rows"), state.room(request))
    if poison and rows and draw(st.booleans(), label="poisoned"):
        kind = draw(st.sampled_from(sorted(kvtensors.POISON_VALUES)), label="poison")
        state.events.append(Poison(request, kind, rows))
    state.events.append(Finish(request, how))
    batch, _ = state.live.pop(request)
    if how == "reset":
        state.reusable[request] = batch


# --- the bounded-exhaustive mode (kvcheck.scope) ---------------------------------------------

POISON_ROWS = (1, 2, 3)  # the rows a poisoned finish leaves, as the strategy draws them
POISON = "nan"  # the kind an enumerated plan poisons with (every_request_plan says why)


def every_request_plan(
    scope: kvscope.Scope,
    *,
    forks: bool = True,
    truncates: bool = False,
    reorders: bool = True,
    poison: bool = True,
    specials: int = 1,
    fork_first: bool = False,
) -> Iterator[RequestPlan]:
    """Every ``RequestPlan`` of 1 to ``scope.tokens`` tokens on each model of the scope
    within the bounds below, fewest tokens first, each once. Its tokens are every row it
    feeds: the Feeds' sizes and the rows each Poison leaves (a fork feeds none).

    A plan is a stream of steps, ended whenever no request is live:

    - a request starts (batch: the layout's) and is fed its first chunk at once, as the
      strategy does: every size from 1 up;
    - a live request is fed a chunk of every size from 1 up;
    - a request finishes by drop right after a step of its own (its last feed, or the fork
      it made or was made by): every finish point relative to the other request's steps.

    So every split of each request's tokens into chunks and every interleaving of the
    requests' steps appear. Beside these, up to ``specials`` events of (where the plan has
    them):

    - a ``Fork`` of a live request into a new one, at every point (after each step);
    - a ``Truncate`` of a live request before one of its feeds, every ``back`` from 0 to its
      length; a ``Reorder`` before one of its feeds, by every map of its rows but the
      identity, which moves nothing (batch^batch - 1: none at batch 1, 3 at batch 2);
    - a finish by reset (after which a request that starts may take its reset caches, or
      fresh ones: both), or after poisoned rows (1 to 3 of them, each a token; by drop or
      by reset), where a later feed could read them (a poisoned finish that nothing follows
      shows nothing).

    With ``fork_first`` every plan forks (``fork``'s plans), its fork one of the specials.

    Bounds, so that the plans are finite and few: at most ``scope.requests`` requests in a
    plan, forks and reused caches included (the handoff of the strategy, a fork, its parent
    finished, a newcomer into the freed blocks, then the fork fed, needs 3); ``specials``
    events beyond starts, feeds and finishes by drop. Fixed: token seed 0; margin 0, the
    tightest pool (a leaked or overtaken block shows first there; spare blocks only hide
    it); the append path (``core``'s ``logits`` enumerates the attend path of every chunk
    split); poison ``nan``, the kind no arithmetic hides (0 * nan, a mask added to it, a max
    over it are all nan), so that every stale or freed row read into attention shows; inf,
    -inf and huge show a subset of the same reads.

    Requests are numbered in the order they start or fork (``kvcheck.scope.first_use_order``
    holds for every plan): one representative per renaming, sound because a correct cache
    cannot tell requests apart but by what each is fed, and every request here is built
    alike (the same batch, model and kind of caches). No closed form: the count is held to
    an independent one in tests/test_exhaustive_requests.py.

    Blocks: a plan crosses a block edge where a request holds more rows than the pool's
    ``block_size`` (``factory.block_size``, not the scope's): with the built-in pool's 16-row
    blocks (kvimpl.paged.DEFAULT_BLOCK_SIZE) only from N = 17; a pool of 2-row blocks
    (``kvimpl.PagedPool(2)``) crosses an edge from N = 3, shares a full block with a fork
    from N = 2, and frees one for another request from N = 3.
    """
    for tokens in range(1, scope.tokens + 1):
        for layout in scope.layouts:
            config = layout.config()
            kinds = dict(forks=forks, truncates=truncates, reorders=reorders, poison=poison)
            for events in _request_streams(
                layout.batch, tokens, scope.requests, specials, fork_first, **kinds
            ):
                yield RequestPlan(config, scope.dtype, events, token_seed=0)


def _request_streams(
    batch: int,
    budget: int,
    most: int,
    specials: int,
    fork_first: bool,
    *,
    forks: bool,
    truncates: bool,
    reorders: bool,
    poison: bool,
) -> Iterator[tuple[Event, ...]]:
    """The event streams of exactly ``budget`` tokens (``kvcheck.grammar``), depth first."""
    # Every map of the rows but the identity, which moves nothing (none at batch 1).
    identity = tuple(range(batch))
    maps = [rows for rows in itertools.product(identity, repeat=batch) if rows != identity]
    maps = maps if reorders else []

    def moves(state: _Stream, left: int):
        if left and state.started < most:  # a request starts, fed its first chunk at once
            for reuse in (None, *state.reusable):
                start = Start(state.started, batch, reuse)
                reusable = tuple(r for r in state.reusable if r != reuse)
                after = state.but(reusable=reusable, started=state.started + 1)
                yield from _fed(after, state.started, 0, left, before=(start,))
        for request, length in state.live:
            special = state.spare > 0
            yield from _fed(state, request, length, left)
            if left and special:
                edits: list[Event] = [Reorder(request, rows) for rows in maps]
                if truncates:
                    edits = [Truncate(request, back) for back in range(length + 1)] + edits
                for edit in edits:
                    kept = edit.target(length) if isinstance(edit, Truncate) else length
                    after = state.but(spare=state.spare - 1)
                    yield from _fed(after, request, kept, left, before=(edit,))
            if forks and state.started < most and special:
                child = state.started
                grown = tuple(sorted({**dict(state.live), child: length}.items()))
                fork = Fork(request, child)
                after = state.but(
                    live=grown, started=child + 1, spare=state.spare - 1, last=(request, child)
                )
                yield (fork,), after.but(forked=True), 0
            if request not in state.last:
                continue  # it finishes right after a step of its own
            finishes: list[tuple[Event, ...]] = [(Finish(request, "drop"),)]
            if special:
                finishes.append((Finish(request, "reset"),))
                if poison:
                    finishes += [
                        (Poison(request, POISON, rows), Finish(request, how))
                        for how in ("drop", "reset")
                        for rows in POISON_ROWS
                        if rows <= left
                    ]
            for run in finishes:
                finish, poisoned = run[-1], run[0] if len(run) > 1 else None
                reusable = state.reusable
                if finish.how == "reset":
                    reusable = tuple(sorted((*reusable, request)))
                after = state.but(
                    live=tuple((r, n) for r, n in state.live if r != request),
                    reusable=reusable,
                    spare=state.spare - (run != (Finish(request, "drop"),)),
                    last=(request,),
                )
                unread = state.unread or poisoned is not None
                yield run, after.but(unread=unread), 0 if poisoned is None else poisoned.rows

    def ends(state: _Stream) -> bool:
        return not state.live and not state.unread and (state.forked or not fork_first)

    return grammar.sentences(budget, _Stream(spare=specials), moves, ends)


@dataclass(frozen=True)
class _Stream:
    """What the rules of ``_request_streams`` know of a stream so far."""

    live: tuple[tuple[int, int], ...] = ()  # (request, length) of each live request
    reusable: tuple[int, ...] = ()  # requests finished by reset, their caches not yet reused
    started: int = 0  # requests started or forked so far: the next one's number
    spare: int = 0  # events beyond starts, feeds and finishes by drop still allowed
    last: tuple[int, ...] = ()  # the requests the last event was a step of
    forked: bool = False
    unread: bool = False  # a poisoned finish no feed has come after (it would show nothing)

    def but(self, **changes) -> _Stream:
        return dataclasses.replace(self, **changes)


def _fed(state: _Stream, request: int, length: int, left: int, before: tuple = ()):
    """The moves of ``before`` (a start, an edit) then a feed of ``request``, holding
    ``length``, of each size up to ``left``."""
    others = {r: n for r, n in state.live if r != request}
    for size in range(1, left + 1):
        live = tuple(sorted({**others, request: length + size}.items()))
        after = state.but(live=live, last=(request,), unread=False)
        yield (*before, Feed(request, size)), after, size


def every_requests_plan(scope: kvscope.Scope) -> Iterator[RequestPlan]:
    """The plans of ``requests`` (``request_plans()``): forks, reorders and poisoned
    finishes, no truncates; ``every_request_plan`` says what and how many."""
    return every_request_plan(scope)


def every_fork_plan(scope: kvscope.Scope) -> Iterator[RequestPlan]:
    """The plans of ``fork`` (``request_plans(forks=3, truncates=True, poison=False)``):
    those of ``every_request_plan`` with truncates, no poison, and two specials of which
    one is a fork (every drawn plan of ``forks`` above 1 forks)."""
    return every_request_plan(scope, truncates=True, poison=False, specials=2, fork_first=True)


def serve(factory: CacheFactory, plan: RequestPlan) -> None:
    """Run ``plan`` on caches from ``factory`` (a tight pool of its kind, audited after every
    event, when it is a BlockPool); every step of every request must give the uncached
    model's logits for its own history."""
    served = Served()

    def step(engine: Engine, index: int, at: str) -> None:
        run_event(engine, plan.events[index], index, served, plan, at)

    # The reset caches kept for reuse go before the final count: every block must be back.
    run_plan(factory, plan, step, max_length=MAX_LENGTH, before_finish=served.finished.clear)


def run_plan(
    factory: CacheFactory,
    plan,
    step: Callable[[Engine, int, str], None],
    *,
    max_length: int,
    block_hash: Callable | None = None,
    before_finish: Callable[[], None] = lambda: None,
) -> None:
    """The session engine through ``plan``'s events, ``step(engine, index, at)`` running
    each, on a tight pool of ``factory``'s kind where it is a BlockPool (room for the plan's
    busiest moment, ``plan.blocks_needed``, and its ``margin``; keyed by ``block_hash`` where
    given): after every event the engine's checks, a refusal for want of blocks a crash, and
    at the end (after ``before_finish``) every block back. A plan has ``config``, ``dtype``,
    ``path``, ``events``, ``margin``, ``blocks_needed(block_size, offered)`` and
    ``describe(done)``."""
    pool = isinstance(factory, BlockPool)
    model = kvtensors.build_model(plan.config, plan.dtype)
    blocks = 0
    if pool:
        offered = _offered(factory, model, max_length)
        blocks = plan.blocks_needed(factory.block_size, offered) + plan.margin
    done = [0]
    engine = Engine(
        factory,
        model,
        max_length=max_length,
        path=path_for(plan.path, factory),
        blocks=blocks,
        block_hash=block_hash,
        describe=lambda: plan.describe(done[0]),
    )
    for index, event in enumerate(plan.events):
        done[0] = index
        at = f", event #{index} ({event.describe()})"
        try:
            step(engine, index, at)
        except ValueError as error:
            if isinstance(error, CacheContractError) or engine.pool is None:
                raise
            pool = engine.pool
            raise failures.RefusesValidInput(
                f"the pool refused a step the plan needs: {type(error).__name__}: {error}; "
                f"blocks_in_use {pool.blocks_in_use}, blocks_free {pool.blocks_free}, "
                f"while the caches alive need at most {blocks - plan.margin} blocks of "
                f"{pool.block_size} rows even unshared: blocks were not given back, more "
                f"were taken than the rows need, or cached blocks no cache holds were not "
                f"evicted to make room\n  at {engine.where(at.removeprefix(', '))}"
            ) from error
        engine.check(f"event #{index} ({event.describe()})")
    before_finish()
    engine.finish()


def _offered(factory: CacheFactory, model, max_length: int) -> frozenset[str]:
    """The capabilities of the caches a run builds from ``factory``, read as the engine reads
    them (its first layer's cache, ``Engine.start``): what a plan's events do to the caches,
    and so the room the pool needs, depends on them (a serving rollback is skipped where
    truncate is not offered, and the caches keep every row). The probe is built on the
    factory itself and dropped, so that the run's own pool starts empty."""
    probe = build(factory, model.cache_spec(1, max_length, layer=0))
    return frozenset(capabilities(probe))


# What the plans of requests, fork and pool must reach (kvcheck.reach), noted in run_event.
REQUEST_EDGES = (
    Edge("2 or more requests fed in turns"),
    Edge("a request on the reset caches of a finished one"),
    Edge("a request dropped"),
    Edge("a request finished after poisoned rows"),
    Edge("a request of batch 2 or more"),
    Edge("a fork"),
    Edge("a truncate of a live request", needs=("truncate",)),
    Edge("a reorder of a live request", needs=("reorder",)),
)
FORK_EDGES = (
    Edge("a fork of a fork", needs=("fork",)),
    Edge("a parent fed after its fork", needs=("fork",)),
    Edge("a fork truncated below where it forked", needs=("fork", "truncate")),
    Edge("a parent finished while its fork lives", needs=("fork",)),
)


@dataclass
class Served:
    """What a plan's run keeps beside the engine: the finished requests whose reset caches
    wait to be reused (only these and ``engine.live`` hold caches, so that a dropped
    request's are collectable), and each fork's parent and the length it forked at."""

    finished: dict[int, Request] = field(default_factory=dict)
    parents: dict[str, tuple[str, int]] = field(default_factory=dict)

    def is_parent(self, request: Request, live: dict) -> bool:
        """Whether a fork of ``request`` is alive (in ``live``)."""
        return any(
            parent == request.name and child in live for child, (parent, _) in self.parents.items()
        )


def run_event(engine: Engine, event: Event, index: int, served: Served, plan, at: str) -> None:
    """One event of the plan, noting the edges it reaches."""
    live = engine.live
    if isinstance(event, Start):
        reuse = None if event.reuse is None else served.finished.pop(event.reuse)
        engine.start(f"r{event.request}", event.batch, reuse=reuse)
        if reuse is not None:
            reach.note("a request on the reset caches of a finished one")
        if event.batch >= 2:
            reach.note("a request of batch 2 or more")
        return
    if isinstance(event, Fork):
        parent = live[f"r{event.parent}"]
        engine.play(parent, event, at=at)
        reach.note("a fork", *(("a fork of a fork",) if parent.name in served.parents else ()))
        served.parents[f"r{event.child}"] = (parent.name, parent.held)
        return
    request = live[f"r{event.request}"]
    if isinstance(event, Feed):
        engine.play(request, event, new=plan.tokens(index, request.batch), at=at)
        if len(live) >= 2:
            reach.note("2 or more requests fed in turns")
        if served.is_parent(request, live):
            reach.note("a parent fed after its fork")
    elif isinstance(event, Truncate):
        if engine.play(request, event, at=at):
            reach.note("a truncate of a live request")
            if request.held < served.parents.get(request.name, ("", -1))[1]:
                reach.note("a fork truncated below where it forked")
    elif isinstance(event, Reorder):
        if engine.play(request, event, at=at):
            reach.note("a reorder of a live request")
    elif isinstance(event, Poison):
        engine.play(request, event, at=at)
        reach.note("a request finished after poisoned rows")
    else:
        if served.is_parent(request, live):
            reach.note("a parent finished while its fork lives")
        if event.how == "reset":
            engine.reset(request)
            served.finished[event.request] = request
        else:
            engine.drop(request)
            reach.note("a request dropped")


def check_requests(factory: CacheFactory, plan: RequestPlan) -> None:
    """Requests served side by side from one factory (a tight pool of its kind when it is a
    BlockPool) each get the uncached model's logits for their own history."""
    serve(factory, plan)


# Pinned plans, tried first on every run: the orders where serving engines broke.
_tiny = ModelConfig(vocab_size=11, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4, seed=3)
PINNED_FORKS = (
    # A parent rolls back into the full block it shares with its fork and writes there: the
    # fork's rows must not change (copy-on-write of a block once full, too).
    RequestPlan(
        _tiny,
        torch.float64,
        (
            Start(0, 1),
            Feed(0, 16),
            Fork(0, 1),
            Truncate(0, 3),
            Feed(0, 2),
            Feed(1, 1),
            Finish(0, "drop"),
            Finish(1, "drop"),
        ),
        token_seed=4,
    ),
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


REQUESTS = Property(
    "requests",
    "requests interleaved on one factory (started, forked, reordered, finished, started "
    "again) each match the model on their own history",
    check_requests,
    request_plans(),
    failures.WRONG_RESULTS,
    pinned=on_both_paths(PINNED),
    reaches=REQUEST_EDGES,
    # It runs on every cache under test (a quarter of the profile's examples, after the
    # pinned plans); on a pool, "pool" searches the same plans in full.
    examples_share=0.25,
    every_plan=every_requests_plan,
    exhaustive_tokens=6,
    since="1.0",
    holds=(
        'several requests on one factory as a scheduler interleaves them ([contract.md, "Requests '
        'side by side"](contract.md#requests-side-by-side)): each with its own batch (1 to 3), '
        "prompt and chunks, up to 4 alive at once, started fresh or on a finished request's reset "
        "caches, finished by `reset()` or by being dropped; forks where `fork` is offered. Every "
        "step of every request equals the uncached model on its own history. On a `BlockPool` the "
        "plans run on a tight pool (`with_blocks`)"
    ),
)
FORK = Property(
    "fork",
    "after fork(), parent and child are independent histories, each matching the model",
    check_requests,
    request_plans(forks=3, truncates=True, poison=False),
    failures.WRONG_RESULTS,
    requires=("fork",),
    pinned=on_both_paths(PINNED_FORKS),
    reaches=FORK_EDGES,
    every_plan=every_fork_plan,
    exhaustive_tokens=4,
    since="1.0",
    holds=(
        "request plans heavy on forks, with truncates when offered: forks of forks, forks of "
        "prompts ending inside a block, a parent reset or dropped while its forks decode; each step"
        " of parent and child equals the uncached model on its own history"
    ),
)


class RequestsTests(KitTests):
    """Requests interleaved on one factory, as a serving engine's scheduler runs them."""

    test_interleaved_requests_each_match_the_model = property_test(REQUESTS)


class ForkTests(KitTests):
    """``fork()``, for parallel sampling and shared prompts: run when offered."""

    test_forks_are_independent_histories = property_test(FORK)
