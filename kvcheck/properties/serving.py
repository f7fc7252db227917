"""Serving pools (docs/contract.md, section 9): prefix caching with eviction, and preemption
by swapping (offload) or by recompute.

A ``ServingPlan`` is a stream of requests on one model and one tight pool, as a serving
engine's scheduler runs them. Prompts are drawn over a vocabulary of 2 or 3 tokens from one
or two shared system prompts, so that requests share prefixes all the time; half the
requests belong to a second tenant (another salt) with the same prompts. A request arrives
(its prompt declared and looked up: the pool may hand it blocks another request wrote), is
fed its prompt in chunks while others arrive, write and leave in between, decodes, rolls a
draft back (where truncate is offered), has its two rows reordered as beams (where reorder
is offered), forks a parallel sample, is swapped out and in (where offload is offered) or
preempted and recomputed (reset, looked up and fed again), and leaves. The pool keys blocks
by a hash the plan draws: the pool's own, one under which every block collides, or one of
two values, so that a pool trusting its keys shows.

Every step of every request is the uncached model on its own tokens; every hit's blocks
were last written full, for this request's salt and tokens, and their rows are read back bit
for bit (``kvcheck.prefix_books``); the books balance after every event
(``kvcheck.pool_books``); and after every event a probe looks up the tokens the request was
fed (after any reorder or fork), so that a block published under other tokens than those
written into it shows when it is published.

- ``prefix caching``: where the factory is a ``kvref.PrefixCaching`` pool;
- ``offload``: plans that swap often, where the caches offer ``offload``.
"""

from __future__ import annotations

import copy
import gc
import math
import random
from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal

import torch
from hypothesis import strategies as st

from kvcheck import asserts as kvassert
from kvcheck import failures, reach
from kvcheck import strategies as kvst
from kvcheck import tensors as kvtensors
from kvcheck.devices import dtype_name
from kvcheck.harness import PATHS, Recorder, build
from kvcheck.kit import KitTests, Property, property_test
from kvcheck.plan_events import Feed, Fork, Reorder, Truncate
from kvcheck.prefix_books import PrefixBooks
from kvcheck.properties.pool import fill
from kvcheck.properties.requests import run_plan
from kvcheck.session import Engine, Request
from kvref import BlockPool, CacheFactory, ModelConfig, PrefixCaching, may_refuse_truncate
from kvref.reprs import short_repr

EDGE = kvst.EDGE
MAX_LENGTH = 64  # per request
MAX_LIVE = 4
SALTS = (None, "tenant b")

# The hashes a plan keys the pool's blocks by (``with_blocks(n, block_hash=...)``).
HASHES = {
    "the pool's own": None,
    "one where every block collides": lambda parent, tokens, salt: 0,
    "one of two values": lambda parent, tokens, salt: sum(tokens) % 2,
}


@dataclass(frozen=True)
class Arrive:
    """Request ``request`` arrives on fresh caches: each row's prompt is the first ``shared``
    tokens of system prompt ``system`` (or, with ``continues``, of that request's history, as
    the next turn of a chat: the tokens it holds, or held before its last rollback) and
    ``own`` tokens of its own; the prompt is declared and looked up (where the pool caches
    prefixes)."""

    request: int
    batch: int
    salt: str | None
    system: int
    shared: int
    own: int
    seed: int
    continues: int | None = None
    before_rollback: bool = False

    @property
    def prompt(self) -> int:
        return self.shared + self.own

    def describe(self) -> str:
        tenant = "" if self.salt is None else f", salt {self.salt!r}"
        source = f"system prompt {self.system}"
        if self.continues is not None:
            when = " before its last rollback" if self.before_rollback else ""
            source = f"r{self.continues}'s history{when}"
        return (
            f"r{self.request} arrives (batch {self.batch}{tenant}): a prompt of {self.prompt} "
            f"tokens, the first {self.shared} of {source}"
        )


@dataclass(frozen=True)
class Swap:
    """Request ``request`` is swapped out (``out``) or back in (where offload is offered)."""

    request: int
    out: bool

    def describe(self) -> str:
        return f"r{self.request} is swapped {'out' if self.out else 'in'}"


@dataclass(frozen=True)
class Recompute:
    """Request ``request`` is preempted by recompute: its caches reset, its tokens looked up
    and fed again."""

    request: int

    def describe(self) -> str:
        return f"r{self.request} is preempted and recomputed"


@dataclass(frozen=True)
class Leave:
    """Request ``request`` finishes: its caches reset then dropped, or dropped."""

    request: int
    how: Literal["reset", "drop"]

    def describe(self) -> str:
        return f"r{self.request} leaves ({self.how})"


Event = Arrive | Feed | Truncate | Reorder | Swap | Fork | Recompute | Leave


@short_repr
@dataclass(frozen=True)
class ServingPlan:
    config: ModelConfig
    dtype: torch.dtype
    vocab: int  # tokens 0 .. vocab - 1: prompts share prefixes constantly
    systems: tuple[tuple[int, ...], ...]
    events: tuple[Event, ...]
    block_hash: str = "the pool's own"
    margin: int = 0  # blocks the tight pool has beyond the plan's busiest moment
    path: str = "append"

    def describe(self, done: int | None = None) -> str:
        events = self.events if done is None else self.events[: done + 1]
        planned = planned_lengths(self.events)
        said = "; ".join(
            f"#{index} {event.describe()}"
            + (f" (to {planned[index]})" if isinstance(event, Feed) else "")
            for index, event in enumerate(events)
        )
        left = 0 if done is None else len(self.events) - done - 1
        more = f" ({left} of {len(self.events)} events not yet run)" if left else ""
        systems = ", ".join(
            f"{index}: {''.join(map(str, tokens))}" for index, tokens in enumerate(self.systems)
        )
        return (
            f"serving plan: {dtype_name(self.dtype)}, tokens over a vocabulary of {self.vocab}, "
            f"system prompts {systems}, blocks keyed by {self.block_hash}, {self.margin} "
            f"spare blocks\n  model: {kvst.describe_config(self.config)}\n  events so "
            f"far{more}: {said}"
        )

    def summary(self) -> tuple[str, str, str]:
        arrivals = [event for event in self.events if isinstance(event, Arrive)]
        batches = "/".join(sorted({str(event.batch) for event in arrivals}))
        return self.describe(), str(self.config.num_layers), batches

    def blocks_needed(self, block_size: int, offered: Collection[str] = frozenset()) -> int:
        """The most blocks the live requests' caches hold at once, nothing shared: each row
        of each layer ceil(length / block_size), a request still in its prompt counted as
        holding all of it (a hit may hand it that much at once), swapped ones included.

        The lengths are what the run makes the caches hold, for caches offering ``offered``
        (their capabilities; none known: the most): a rollback shortens a request only where
        truncate is offered and no window layer may refuse it (without truncate the run skips
        the rollback, and a refused one changes nothing: the caches keep every row), and a
        feed never shortens it (the run feeds only past what the caches hold)."""
        windows = [self.config.layer_window(layer) for layer in range(self.config.num_layers)]
        held: dict[int, list[int]] = {}  # request -> [batch, length, prompt]
        planned = planned_lengths(self.events)
        busiest = 0
        for index, event in enumerate(self.events):
            if isinstance(event, Arrive):
                held[event.request] = [event.batch, 0, event.prompt]
            elif isinstance(event, Feed):
                held[event.request][1] = max(held[event.request][1], planned[index])
            elif isinstance(event, Truncate):
                length = held[event.request][1]
                target = length - event.back
                if "truncate" in offered and not may_refuse_truncate(windows, length, target):
                    held[event.request][1] = target
            elif isinstance(event, Fork):
                held[event.request] = list(held[event.parent])
            rows = sum(
                batch * math.ceil(max(length, prompt) / block_size)
                for batch, length, prompt in held.values()
            )
            busiest = max(busiest, rows * self.config.num_layers)
            if isinstance(event, Leave):
                del held[event.request]
        return busiest


def planned_lengths(events: tuple[Event, ...]) -> list[int]:
    """The length the plan means each event to leave its request at (a feed's end, what a
    rollback keeps), whatever the caches did: a feed goes up to its request's planned length
    plus its size, and feeds only past what the caches already hold (a prefix hit, or rows a
    pool without truncate kept through a rollback)."""
    length: dict[int, int] = {}
    after = []
    for event in events:
        if isinstance(event, Arrive):
            length[event.request] = 0
        elif isinstance(event, Feed):
            length[event.request] += event.size
        elif isinstance(event, Truncate):
            length[event.request] = event.target(length[event.request])
        elif isinstance(event, Fork):
            length[event.child] = length[event.parent]
        after.append(length.get(event.request, 0))
    return after


@dataclass
class _Live:
    """What the strategy knows of a live request while it draws."""

    prompt: int
    length: int = 0
    batch: int = 1
    swapped: bool = False
    decoded: int = 0  # tokens decoded since the prompt or the last rollback
    before: int = 0  # its length before its last rollback


@st.composite
def serving_plans(draw, *, swaps: int = 1, max_events: int = 14) -> ServingPlan:
    """Request streams on a tiny vocabulary over shared system prompts; ``swaps`` weighs the
    swap events."""
    vocab = draw(st.sampled_from((2, 3)), label="vocabulary")
    token = st.integers(0, vocab - 1)
    # System prompts of whole 16-token phrases (a common page) and a tail: the same phrase
    # after other ones is the same block under another parent.
    phrases = draw(
        st.lists(st.lists(token, min_size=EDGE, max_size=EDGE), min_size=2, max_size=3),
        label="phrases",
    )
    systems = []
    for _ in range(draw(st.integers(1, 2), label="system prompts")):
        order = draw(
            st.lists(st.integers(0, len(phrases) - 1), min_size=1, max_size=3),
            label="phrases in it",
        )
        tail = draw(st.lists(token, max_size=4), label="tail")
        systems.append(tuple(t for index in order for t in phrases[index]) + tuple(tail))
    if not any(systems):
        systems[0] = tuple(phrases[0])
    live: dict[int, _Live] = {}
    histories: dict[int, _Live] = {}  # every request so far, for a later turn to continue
    events: list[Event] = []
    next_request = 0

    def arrive() -> None:
        nonlocal next_request
        request, next_request = next_request, next_request + 1
        system, continues, before = (
            draw(st.integers(0, len(systems) - 1), label="system"),
            None,
            False,
        )
        whole = len(systems[system])
        earlier = sorted(r for r, state in histories.items() if state.length)
        if earlier and draw(st.booleans(), label="the next turn of a chat"):
            continues = draw(st.sampled_from(earlier), label="continues")
            before = histories[continues].before > 0 and draw(
                st.booleans(), label="before rollback"
            )
            source = histories[continues]
            whole = source.before if before else source.length
        shared = draw(st.one_of(st.just(whole), st.integers(0, whole)), label="shared tokens")
        # Half the prompts end one token short of a block's end, at it or one past it (of
        # every block size dividing EDGE): a lookup's and a publication's boundaries.
        own = draw(st.one_of(st.integers(0, 8), _to_block_end(shared)), label="own tokens")
        own = max(0 if shared else 1, min(own, MAX_LENGTH - 4 - shared))
        batch = draw(st.integers(1, 2), label="batch")
        events.append(
            Arrive(
                request,
                batch,
                draw(st.sampled_from(SALTS), label="salt"),
                system,
                shared,
                own,
                draw(st.integers(0, 2**16), label="token seed"),
                continues,
                before,
            )
        )
        live[request] = histories[request] = _Live(shared + own, batch=batch)
        if batch == 2 and 0 < shared < shared + own and draw(st.booleans(), label="beams"):
            # Fed up to where its rows' tokens part, then reordered: every block written
            # after has a parent both rows share, under which each row's tokens are its own.
            events.extend((Feed(request, shared), Reorder(request, (1, 0))))
            live[request].length = shared
        feed(request)

    def feed(request: int) -> None:
        state = live[request]
        if state.length < state.prompt:  # the prompt, whole or a chunk of it
            to = draw(st.sampled_from((state.prompt, None)), label="whole prompt")
            # A chunk ending one row short of a block's end: a block being written, found
            # by no lookup until its last row is.
            short = [end - 1 for end in range(EDGE, state.prompt + 1, EDGE)]
            short = [end for end in short if state.length < end < state.prompt]
            chunk = st.integers(state.length + 1, state.prompt)
            chunk = st.one_of(chunk, st.sampled_from(short)) if short else chunk
            to = to or draw(chunk, label="chunk to")
        else:
            to = min(MAX_LENGTH, state.length + draw(st.integers(1, 4), label="decode"))
        if to > state.length:
            events.append(Feed(request, to - state.length))
            state.decoded += max(0, to - max(state.length, state.prompt))
            state.length = to

    for _ in range(draw(st.integers(3, max_events), label="events")):
        if not live:
            arrive()
            continue
        kinds = ["feed", "feed", "leave", "leave", "recompute", "rollback", "reorder"]
        kinds += ["swap"] * swaps
        if len(live) < MAX_LIVE:
            kinds += ["arrive", "arrive", "sample"]
        kind = draw(st.sampled_from(kinds), label="event")
        if kind == "arrive":
            arrive()
            continue
        request = draw(st.sampled_from(sorted(live)), label="request")
        state = live[request]
        if state.swapped and kind != "leave":
            events.append(Swap(request, out=False))
            state.swapped = False
        elif kind == "feed":
            feed(request)
        elif kind == "leave":
            how = "drop" if state.swapped else draw(st.sampled_from(("reset", "drop")), label="how")
            events.append(Leave(request, how))
            del live[request]
        elif kind == "recompute":
            events.append(Recompute(request))
        elif kind == "sample":
            child, next_request = next_request, next_request + 1
            events.append(Fork(request, child))
            live[child] = histories[child] = _Live(state.prompt, state.length, state.batch)
            feed(child)
            if draw(st.booleans(), label="the parent decodes too"):
                feed(request)  # both publish blocks after the fork, each of its own tokens
        elif kind == "rollback" and state.decoded:
            back = draw(st.integers(1, state.decoded), label="rejected")
            events.append(Truncate(request, back))
            state.before = state.length
            state.length -= back
            state.decoded -= back
        elif kind == "reorder" and state.batch == 2:
            order = draw(st.sampled_from(((1, 0), (1, 0), (0, 0), (1, 1))), label="order")
            events.append(Reorder(request, order))
            feed(request)  # blocks published after the reorder, keyed by the rows' tokens
        elif kind == "swap":
            events.append(Swap(request, out=True))
            state.swapped = True
    for request in sorted(live):
        events.append(Leave(request, "drop"))
    return ServingPlan(
        config=draw(kvst.model_configs(max_layers=2), label="config"),
        dtype=draw(kvst.dtypes_on_device(kvst.DTYPES), label="dtype"),
        vocab=vocab,
        systems=systems,
        events=tuple(events),
        block_hash=draw(st.sampled_from(sorted(HASHES)), label="block hash"),
        margin=draw(st.sampled_from((0, 0, 1, 2)), label="spare blocks"),
        path=draw(st.sampled_from(PATHS), label="path"),
    )


def _to_block_end(shared: int) -> st.SearchStrategy[int]:
    """Own tokens that end a prompt of ``shared`` tokens and more one short of the next
    multiple of EDGE, at it, or one past it."""
    end = -(-(shared + 1) // EDGE) * EDGE
    return st.sampled_from((-1, 0, 1)).map(lambda offset: end + offset - shared)


class _Served:
    """One request's tokens as the runner hands them out: the prompt, then decode tokens
    that change after every rollback (so that a rewritten block holds other rows)."""

    def __init__(self, plan: ServingPlan, arrival: Arrive, device, served: dict) -> None:
        self.arrival, self.vocab, self.device = arrival, plan.vocab, device
        if arrival.continues is None:
            sources = [list(plan.systems[arrival.system])]
        else:  # the history of an earlier request, as it was then
            source = served[arrival.continues]
            sources = (source.before if arrival.before_rollback else source.fed).tolist()
        self.prompts = []
        for row in range(arrival.batch):
            shared = sources[row % len(sources)][: arrival.shared]
            own = random.Random(f"{arrival.seed}/{row}")
            self.prompts.append(shared + [own.randrange(plan.vocab) for _ in range(arrival.own)])
        self.rollbacks, self.seed = 0, arrival.seed
        # What it has been fed (and held before its last rollback), for a later turn.
        self.fed = self.before = torch.empty(arrival.batch, 0, dtype=torch.long)
        # What the plan did to it that the blocks it publishes next must survive (reach).
        self.since: set[str] = set()  # "reorder", "fork", "truncated into a full block"
        self.kin: set[int] = set()  # the requests it forked from or into
        self.while_out: set[str] = set()  # what others did to the pool while it was out

    def sample(self, request: int) -> _Served:
        """A parallel sample's tokens: this prompt, decode tokens of its own."""
        twin = copy.copy(self)
        twin.seed, twin.rollbacks = f"{self.seed}/sample {request}", 0
        twin.since, twin.kin, twin.while_out = set(), set(), set()
        return twin

    def tokens(self, start: int, end: int) -> torch.Tensor:
        """Each row's tokens at positions ``start`` to ``end`` - 1."""
        rows = []
        for row, prompt in enumerate(self.prompts):
            rows.append(
                [
                    prompt[p]
                    if p < len(prompt)
                    else random.Random(f"{self.seed}/{row}/{p}/{self.rollbacks}").randrange(
                        self.vocab
                    )
                    for p in range(start, end)
                ]
            )
        return torch.tensor(rows, dtype=torch.long, device=self.device)


def serve(factory: CacheFactory, plan: ServingPlan) -> None:
    """Run ``plan`` on a tight pool of ``factory``'s kind (keyed by the plan's hash where it
    caches prefixes): every step of every request is the uncached model's."""
    block_hash = HASHES[plan.block_hash] if isinstance(factory, PrefixCaching) else None
    served: dict[int, _Served] = {}
    planned = planned_lengths(plan.events)

    def step(engine: Engine, index: int, at: str) -> None:
        _run(engine, plan.events[index], planned[index], served, plan, at)

    run_plan(factory, plan, step, max_length=MAX_LENGTH, block_hash=block_hash)


def _run(
    engine: Engine, event: Event, planned: int, served: dict, plan: ServingPlan, at: str
) -> None:
    in_use = engine.pool.blocks_in_use if engine.pool is not None else 0
    _step(engine, event, planned, served, plan, at)
    if engine.pool is not None:  # what the others did to the pool while one was out
        moved = engine.pool.blocks_in_use - in_use
        for index, tokens in served.items():
            out = engine.live.get(f"r{index}")
            if index != event.request and out is not None and _offloaded(out) and moved:
                tokens.while_out.add("took" if moved > 0 else "freed")
    request = engine.live.get(f"r{event.request}")
    if request is not None:  # what it holds now, for a later turn to continue
        served[event.request].fed = request.history.cpu()
        _probe(engine, request, served[event.request], served, at)


def _offloaded(request: Request) -> bool:
    return any(getattr(recorder.cache, "offloaded", False) for recorder in request.caches)


def _probe(engine: Engine, request: Request, tokens: _Served, served: dict, at: str) -> None:
    """A lookup of the tokens ``request`` was fed (the plan's history, after any reorder or
    fork), by fresh caches of its salt, dropped after: every block it finds was written for
    those tokens, and it finds the prompt blocks ``request`` holds. A block published under
    a key other than the tokens fed into it (declared tokens a reorder left behind, a token
    list a fork shares) is found by the tokens it is keyed by and shows here."""
    if engine.prefix is None or not request.looked_up or not request.held or _offloaded(request):
        return
    probe = engine.start(f"{request.name}'s probe", request.batch)
    probe.salt = request.salt
    try:
        engine.lookup(probe, request.history, at=f" (a probe of {request.name}'s blocks){at}")
    finally:
        engine.reset(probe)
        engine.live.pop(probe.name, None)
    if "fed after a reorder" in tokens.since:
        reach.note("blocks published after a reorder of rows of other tokens, probed")
    if "fork" in tokens.since and any("fork" in served[kin].since for kin in tokens.kin):
        reach.note("blocks published by a sample and its parent after the fork, probed")


def _step(
    engine: Engine, event: Event, planned: int, served: dict, plan: ServingPlan, at: str
) -> None:
    """Run ``event``, ``planned`` the length the plan means it to leave its request at."""
    name = f"r{event.request}"
    if isinstance(event, Arrive):
        served[event.request] = _Served(plan, event, engine.model.device, served)
        request = engine.start(name, event.batch)
        request.salt = event.salt
        _look_up(engine, request, served[event.request].tokens(0, event.prompt), at)
        return
    if isinstance(event, Fork):
        parent = served[event.parent]
        served[event.request] = parent.sample(event.request)
        engine.fork(engine.live[f"r{event.parent}"], name, at=at)
        if "fork" in engine.live[name].offered:
            parent.kin.add(event.request)
            served[event.request].kin.add(event.parent)
            parent.since.discard("fork")  # from now on: its blocks after the fork
        return
    request, tokens = engine.live[name], served[event.request]
    if isinstance(event, Feed):
        if planned > request.held:
            _feed(engine, request, tokens, planned, at)
            tokens.since.add("fork")  # (noted only where it has kin: a fork ran)
            if "reorder" in tokens.since:
                tokens.since.add("fed after a reorder")
    elif isinstance(event, Truncate):
        if "truncate" in request.offered:
            tokens.before = request.history.cpu()
            _truncate(engine, request, tokens, event.target(request.held), at)
    elif isinstance(event, Reorder):
        if "reorder" in request.offered:
            # Rows of other tokens, held or declared (a prompt fed up to where they part).
            held = request.history.tolist()
            rows = {(tuple(h), tuple(p)) for h, p in zip(held, tokens.prompts, strict=True)}
            engine.reorder(request, torch.tensor(event.indices), at=at)
            tokens.prompts = [tokens.prompts[row] for row in event.indices]
            if len(rows) > 1 and list(event.indices) != [0, 1]:
                tokens.since.add("reorder")
    elif isinstance(event, Swap):
        if "offload" in request.offered:
            _swap(engine, request, tokens, event.out, at)
    elif isinstance(event, Recompute):
        fed = request.history
        prompt = len(tokens.prompts[0])
        known = fed if fed.shape[1] >= prompt else tokens.tokens(0, prompt)
        engine.reset(request)
        _look_up(engine, request, known, at)
        if fed.shape[1] > request.held:
            engine.feed(request, fed[:, request.held :], at=f" (recompute){at}")
    elif event.how == "reset":
        engine.reset(request)
        engine.drop(request)
    else:
        engine.drop(request)


def _look_up(engine: Engine, request: Request, known: torch.Tensor, at: str) -> None:
    """Declare the tokens ``known`` (the prompt, or all fed before a recompute) and take the
    pool's hit, where it caches prefixes."""
    if engine.prefix is None:
        return
    books, size, length = engine.prefix, engine.pool.block_size, known.shape[1]
    short = _one_row_short(engine, request, known)
    lost = books.lost_prefix(request.salt, known)
    hit = engine.lookup(request, known, at=at)
    whole = length // size
    if whole:
        found = "none" if not hit else "all" if hit // size == whole else "some"
        reach.note(f"a lookup that finds {found} of its prompt's whole blocks")
    edge = {0: "at a block's end", 1: "one token past a block's end"}
    if size > 2:
        edge[size - 1] = "one token short of a block's end"
    if length % size in edge:
        reach.note(f"a lookup of a prompt ending {edge[length % size]}")
    if books.other_tenant_wrote(request.salt, known):
        reach.note("a lookup of a prefix another tenant wrote")
    if lost:
        reach.note("a lookup of a prefix whose cached block was evicted and reused")
    if short:
        reach.note("a lookup of a prefix another request holds one row short of a block")


def _one_row_short(engine: Engine, request: Request, known: torch.Tensor) -> bool:
    """Whether another live request of this salt holds a prefix of ``known`` one row short
    of a block's end: its block is being written, and must not be found yet."""
    size, rows = engine.pool.block_size, [tuple(row) for row in known.tolist()]
    for other in engine.live.values():
        held = other.held
        if other is request or other.salt != request.salt or held % size != size - 1:
            continue
        if held <= known.shape[1] and any(
            tuple(row) == mine[:held] for row in other.history.tolist() for mine in rows
        ):
            return True
    return False


def _truncate(engine: Engine, request: Request, tokens: _Served, target: int, at: str) -> None:
    """A rollback; one back into a block written full (published) is noted when the next
    feed writes into it again."""
    held = request.held
    if engine.truncate(request, target, at=at):
        tokens.rollbacks += 1
        size = engine.pool.block_size if engine.prefix is not None else 0
        if size and target % size and held >= (target // size + 1) * size:
            tokens.since.add("truncated into a full block")


def _swap(engine: Engine, request: Request, tokens: _Served, out: bool, at: str) -> None:
    """Swap ``request`` out or in, noting what the pool around it did meanwhile."""
    if out:
        if engine.pool is not None and _shares_blocks(engine, request):
            reach.note("a swap out of blocks another request holds too")
        tokens.while_out = set()
        engine.offload(request, at=at)
        return
    if engine.prefix is not None:
        # Its rows as one batch (serving plans feed none by row); read nothing of an
        # offloaded cache but its length.
        size = engine.pool.block_size
        needed = len(request.caches) * request.batch * -(-request.held // size)
        if engine.pool.blocks_free - engine.pool.blocks_evictable < needed:
            reach.note("a swap in that must evict cached blocks")
    for what in sorted(tokens.while_out):
        reach.note(f"a swap in after others {what} blocks while it was out")
    engine.restore(request, at=at)


def _shares_blocks(engine: Engine, request: Request) -> bool:
    mine = _block_ids(request)
    return any(
        mine & _block_ids(other)
        for other in engine.live.values()
        if other is not request and other.caches is not None and not _offloaded(other)
    )


def _block_ids(request: Request) -> set[int]:
    return {
        block
        for recorder in request.caches
        for table in getattr(recorder.cache, "block_tables", ())
        for block in table
    }


def _feed(engine: Engine, request: Request, tokens: _Served, to: int, at: str) -> None:
    """Feed ``request`` up to ``to`` tokens; decode tokens are declared first."""
    prompt = len(tokens.prompts[0])
    new = tokens.tokens(request.held, to)
    if engine.prefix is not None and to > max(prompt, request.held):
        engine.declare(request, new[:, max(0, prompt - request.held) :])
    engine.feed(request, new, at=at)
    if "truncated into a full block" in tokens.since:
        tokens.since.discard("truncated into a full block")
        reach.note("a block written full, truncated into and written again")


def check_serving(factory: CacheFactory, plan: ServingPlan) -> None:
    """Requests served from one pool that shares blocks by content (or swaps them out): each
    gets the uncached model's logits for its own tokens."""
    serve(factory, plan)


def check_offload(factory: CacheFactory, plan: ServingPlan) -> None:
    """The plan's swaps, then (on a pool) a restore into a full pool: refused, changing
    nothing, and done once there is room."""
    serve(factory, plan)
    if isinstance(factory, BlockPool):
        restore_without_room(factory, plan)


# The blocks the offloaded cache of ``restore_without_room`` needs back: 2 * size + 1 rows.
RESTORE_NEEDS = 3


def restore_without_room(factory: CacheFactory, plan: ServingPlan) -> None:
    """An offloaded cache of ``plan``'s model (batch 1, two blocks and a bit) is restored
    while fillers leave each number of blocks free from none to the three it needs: short of
    them, ``ValueError``, with its length, its ``offloaded`` and the pool's counts unchanged
    (a restore that takes blocks one at a time must give back those it took), then, the
    fillers gone, restored bit for bit; with exactly three free, restored bit for bit."""
    for free in range(RESTORE_NEEDS + 1):
        _restore_with_free(factory, plan, free)


def _restore_with_free(factory: CacheFactory, plan: ServingPlan, free: int) -> None:
    size = factory.block_size
    spec = kvtensors.build_model(plan.config, plan.dtype).cache_spec(1, 2 * size + 2)
    pool = factory.with_blocks(RESTORE_NEEDS + 1)
    cache = build(pool, spec)
    keys = kvtensors.random_rows(spec, 2 * size + 1, 1)
    values = kvtensors.random_rows(spec, 2 * size + 1, 2, values=True)
    read = cache.append(keys.clone(), values.clone())
    read = tuple(rows.clone() for rows in read)  # the codes it had, where it holds codes
    cache.offload()
    where = (
        f"a cache holding {2 * size + 1} rows in blocks of {size}, offloaded, restored with "
        f"{free} of the pool's {RESTORE_NEEDS + 1} blocks free, of {spec}"
    )
    filler = fill(pool, spec, free, where)
    if free < RESTORE_NEEDS:
        _refused_unchanged(cache, pool, where)
        reach.note(
            "a restore refused with some blocks free, too few"
            if free
            else "a restore refused with no block free"
        )
        del filler
        gc.collect()
    error = kvassert.raised_by(cache.restore)
    if error is not None:
        raise failures.RefusesValidInput(
            f"the pool: restore() with {pool.blocks_free} blocks free, {RESTORE_NEEDS} needed, "
            f"refused with {type(error).__name__}: {error}\n  at {where}"
        ) from error
    if free == RESTORE_NEEDS:
        reach.note("a restore with exactly the blocks it needs free")
    _restored_as_held(cache, (keys, values), read, where)


def _restored_as_held(cache, given: tuple, read: tuple, where: str) -> None:
    """After a restore, an append of the first row again returns the rows it held: the rows
    given (within the declared bound, contract 10.1), and those it held in codes at the
    offload bit for bit as it read them then (the codes it had, not the rows coded again)."""
    recorder = Recorder(cache, None)
    recorder.hold_given(given)
    coded = list(recorder.quantized_below)  # may be in codes at the offload
    if any(coded):
        reach.note(RESTORE_IN_CODES)
    returned = recorder.append(given[0][:, :, :1], given[1][:, :, :1])
    parts = zip(("keys", "values"), returned, given, read, coded, strict=True)
    for part, (name, got, rows, before, below) in enumerate(parts):
        want = torch.cat((rows, rows[:, :, :1]), dim=2)
        bad, beyond = ["all"], ""
        if got.shape == want.shape:
            every = list(range(want.shape[2]))
            bad, beyond = kvassert.rows_not_held(recorder, part, got, want, every)
        if bad:
            raise failures.DataLoss(
                f"the pool: after restore(), the cache returned {name} unlike the rows it "
                f"held, at rows {bad[:8]}{beyond}\n  at {where}"
            )
        # Rows it read back other than given were in codes: a cache may code a row later
        # than it may (a residual coded in batches), never code one twice.
        in_codes = set(kvassert.differing_rows(before[:, :, :below], rows[:, :, :below]))
        changed = set(kvassert.differing_rows(got[:, :, :below], before[:, :, :below]))
        if changed := sorted(changed & in_codes):
            raise failures.DataLoss(
                f"the pool: after restore(), the cache returned {name} rows {changed[:8]} "
                f"unlike it read them before the offload, though they were in codes then "
                f"(declared {recorder.storage[part].describe()}): a restore gives back the "
                f"codes it had, it does not code the rows again\n  at {where}"
            )


def _refused_unchanged(cache, pool, where: str) -> None:
    """A restore without room: ``ValueError``, and nothing the books show changed."""
    before = (cache.length, cache.offloaded, pool.blocks_in_use, pool.blocks_free)
    error = kvassert.raised_by(cache.restore)
    after = (cache.length, cache.offloaded, pool.blocks_in_use, pool.blocks_free)
    said = "(length, offloaded, blocks_in_use, blocks_free)"
    if not isinstance(error, ValueError):
        raise failures.DataLoss(
            f"the pool: restore() with too few blocks free returned {error!r}, not a "
            f"ValueError: the pool overcommits or restored nothing\n  at {where}"
        )
    if after != before:
        raise failures.RefusalChangedState(
            f"the pool: a refused restore() changed {said} from {before} to {after}: blocks "
            f"taken before it ran short were kept\n  at {where}"
        )


FORK_SEED = 1  # a parent whose decode tokens meet its sample's where a shared list shows
_tiny = ModelConfig(vocab_size=5, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4, seed=5)
_system = (0, 1) * 20
PINNED = (
    # r1 arrives while r0's prompt is half written: r0's blocks being written must not be
    # found; then r0 leaves while r1 holds its hit.
    ServingPlan(
        _tiny,
        torch.float64,
        2,
        (_system,),
        (
            Arrive(0, 1, None, 0, 40, 0, 1),
            Feed(0, 20),
            Arrive(1, 1, None, 0, 40, 2, 2),
            Feed(1, 42),
            Feed(0, 20),
            Arrive(2, 1, None, 0, 40, 1, 3),
            Leave(0, "drop"),
            Feed(2, 41),
            Feed(2, 2),
            Leave(1, "drop"),
            Leave(2, "drop"),
        ),
    ),
    # Two tenants, one prompt; then a tight pool evicts and a third request reuses blocks.
    ServingPlan(
        _tiny,
        torch.float64,
        2,
        (_system,),
        (
            Arrive(0, 1, None, 0, 36, 0, 1),
            Feed(0, 36),
            Arrive(1, 1, "tenant b", 0, 36, 0, 1),
            Feed(1, 37),
            Leave(0, "reset"),
            Arrive(2, 2, "tenant b", 0, 33, 3, 4),
            Feed(2, 36),
            Swap(1, out=True),
            Arrive(3, 1, None, 0, 20, 4, 5),
            Feed(3, 24),
            Swap(1, out=False),
            Feed(1, 2),
            Recompute(2),
            Feed(2, 2),
            Leave(1, "drop"),
            Leave(2, "drop"),
            Leave(3, "drop"),
        ),
        block_hash="one where every block collides",
    ),
    # r0's blocks are cached when it leaves, evicted for r1's, and r2 asks for r0's prompt:
    # an evicted block must not be found, whatever it holds now.
    ServingPlan(
        _tiny,
        torch.float64,
        2,
        (_system, (1, 1, 0) * 12),
        (
            Arrive(0, 1, None, 0, 32, 1, 1),
            Feed(0, 33),
            Leave(0, "drop"),
            Arrive(1, 2, None, 1, 36, 0, 2),
            Feed(1, 36),
            Leave(1, "reset"),
            Arrive(2, 1, None, 0, 32, 2, 3),
            Feed(2, 34),
            Leave(2, "drop"),
        ),
    ),
    # r0 decodes past a block's end (published), rolls back into that block and decodes
    # other tokens there; r1 is the next turn of r0's chat as it was before the rollback: the
    # block it may find holds the tokens it is keyed by, or is not found at all.
    ServingPlan(
        _tiny,
        torch.float64,
        2,
        ((0, 1) * 8,),
        (
            Arrive(0, 1, None, 0, 16, 10, 1),
            Feed(0, 26),
            Feed(0, 4),
            Feed(0, 4),
            Truncate(0, 4),
            Feed(0, 3),
            Arrive(1, 1, None, 0, 34, 2, 2, continues=0, before_rollback=True),
            Feed(1, 36),
            Leave(0, "drop"),
            Leave(1, "drop"),
        ),
    ),
    # The same block of tokens under two parents (A then B, C then B), every key colliding:
    # a hit must compare the whole prefix, not the block's own tokens.
    ServingPlan(
        _tiny,
        torch.float64,
        2,
        ((0,) * 16 + (1, 0) * 8, (1,) * 16 + (1, 0) * 8),
        (
            Arrive(0, 1, None, 0, 16, 1, 1),
            Feed(0, 17),
            Arrive(1, 1, None, 1, 32, 1, 2),
            Feed(1, 33),
            Arrive(2, 1, None, 0, 32, 1, 3),
            Feed(2, 33),
            Leave(0, "drop"),
            Leave(1, "drop"),
            Leave(2, "drop"),
        ),
        block_hash="one where every block collides",
    ),
    # r1 looks r0's prompt up while r0 has written all of it but the last row of a block
    # (for every block size dividing 16): that block must not be found yet; r2 looks up a
    # prompt one token short of that block's end.
    ServingPlan(
        _tiny,
        torch.float64,
        2,
        ((0, 1) * 16,),
        (
            Arrive(0, 1, None, 0, 32, 0, 1),
            Feed(0, 31),
            Arrive(1, 1, None, 0, 32, 1, 2),
            Feed(0, 1),
            Feed(1, 33),
            Arrive(2, 1, None, 0, 31, 0, 3),
            Feed(2, 32),
            Leave(0, "drop"),
            Leave(1, "drop"),
            Leave(2, "drop"),
        ),
    ),
    # A batch of two rows with one system prompt and tokens of their own, reordered halfway
    # through the prompt: the blocks it publishes after are keyed by the tokens each row is
    # fed (a probe of each row's tokens, then the next turn of its chat, find them).
    ServingPlan(
        _tiny,
        torch.float64,
        2,
        ((0, 1) * 8,),
        (
            Arrive(0, 2, None, 0, 16, 16, 1),
            Feed(0, 16),
            Reorder(0, (1, 0)),
            Feed(0, 16),
            Feed(0, 2),
            Arrive(1, 2, None, 0, 34, 2, 2, continues=0),
            Feed(1, 36),
            Leave(0, "drop"),
            Leave(1, "drop"),
        ),
    ),
    # A parallel sample forked inside a block, then it and its parent decode in turns: each
    # publishes the block it fills under its own tokens, not its twin's.
    ServingPlan(
        _tiny,
        torch.float64,
        2,
        ((0, 1) * 8 + (1, 1),),
        (
            Arrive(0, 1, None, 0, 18, 0, FORK_SEED),
            Feed(0, 18),
            Fork(0, 1),
            Feed(1, 1),
            Feed(0, 2),
            Feed(1, 2),
            Feed(0, 3),
            Feed(1, 3),
            Arrive(2, 1, None, 0, 24, 1, 3, continues=1),
            Feed(2, 25),
            Leave(0, "drop"),
            Leave(1, "drop"),
            Leave(2, "drop"),
        ),
    ),
)

# r1 is swapped out while it shares r0's prompt blocks; r0 leaves (freeing them to the
# cache), r2 takes blocks, and r1 comes back into a pool whose free blocks are cached ones.
OFFLOAD_PINNED = (
    ServingPlan(
        _tiny,
        torch.float64,
        2,
        (_system, (1, 1, 0) * 12),
        (
            Arrive(0, 1, None, 0, 32, 1, 1),
            Feed(0, 33),
            Arrive(1, 1, None, 0, 32, 0, 2),
            Feed(1, 33),
            Swap(1, out=True),
            Leave(0, "drop"),
            Arrive(2, 1, None, 1, 36, 0, 3),
            Feed(2, 37),
            Swap(1, out=False),
            Feed(1, 2),
            Leave(1, "drop"),
            Leave(2, "drop"),
        ),
    ),
)

# Rows in codes (contract, 10.1): a hit on blocks a coded pool published, a restore of codes.
HIT_IN_CODES = PrefixBooks.HIT_IN_CODES
RESTORE_IN_CODES = "a restore of rows in codes"

_PREFIX_EDGES = tuple(
    reach.Edge(name, needs=("prefix caching", *needs))
    for name, *needs in (
        ("a lookup that finds none of its prompt's whole blocks",),
        ("a lookup that finds some of its prompt's whole blocks",),
        ("a lookup that finds all of its prompt's whole blocks",),
        ("a lookup of a prompt ending at a block's end",),
        ("a lookup of a prompt ending one token past a block's end",),
        ("a lookup of a prompt ending one token short of a block's end",),
        ("a lookup of a prefix another request holds one row short of a block",),
        ("a lookup of a prefix another tenant wrote",),
        ("a cached block evicted and reused for other rows",),
        ("a lookup of a prefix whose cached block was evicted and reused",),
        ("blocks published after a reorder of rows of other tokens, probed", "reorder"),
        ("blocks published by a sample and its parent after the fork, probed", "fork"),
        ("a block written full, truncated into and written again", "truncate"),
        (HIT_IN_CODES, "lossy storage"),
    )
)
_OFFLOAD_EDGES = tuple(
    reach.Edge(name, needs=("offload", pool))
    for name, pool in (
        ("a restore refused with no block free", "block pool"),
        ("a restore refused with some blocks free, too few", "block pool"),
        ("a restore with exactly the blocks it needs free", "block pool"),
        ("a swap out of blocks another request holds too", "block pool"),
        ("a swap in after others took blocks while it was out", "block pool"),
        ("a swap in after others freed blocks while it was out", "block pool"),
        ("a swap in that must evict cached blocks", "prefix caching"),
        (RESTORE_IN_CODES, "lossy storage"),
    )
)

PREFIX_CACHING = Property(
    "prefix caching",
    "a pool that shares blocks by content hands each request only full blocks written for "
    "its own tokens and salt, evicts what no one holds, and every step matches the model",
    check_serving,
    serving_plans(),
    failures.DATA_LOSS,
    requires=("prefix caching",),
    # On the append path, where every hit row is read back bit for bit; the search draws
    # the attend path too.
    pinned=PINNED,
    since="1.3",
    reaches=_PREFIX_EDGES,
    holds=(
        "request streams over a vocabulary of 2 or 3 tokens from shared system prompts, two tenants"
        " (salts) with identical prompts, on a tight pool whose blocks are keyed by the pool's own "
        "hash, one where every block collides or one of two values: prompts of 16-token phrases "
        "under different parents, or the next turn of an earlier request's chat (as it is, or "
        "before its last rollback), declared and looked up (`lookup_prefix`), fed in chunks while "
        "others arrive, write and leave, decode steps declared first, rollbacks, parallel samples "
        "(`fork`), swaps, preemption by recompute. Every hit's blocks were last written full, in "
        "that layer, for that salt and those tokens, their rows read back bit for bit; a hit is no "
        "shorter than a live request's once-written blocks of that prefix; the books "
        "(`blocks_cached`, `blocks_evictable`) balance after every event; every step equals the "
        "uncached model on its own tokens (contract, section 9.1; where the factory is a "
        "`kvref.PrefixCaching` pool)"
    ),
)
OFFLOAD = Property(
    "offload",
    "a request swapped out of the pool and back in, while others reuse its blocks, holds "
    "its rows bit for bit and decodes as the model",
    check_offload,
    serving_plans(swaps=4),
    failures.DATA_LOSS,
    requires=("offload",),
    pinned=OFFLOAD_PINNED,
    since="1.3",
    reaches=_OFFLOAD_EDGES,
    holds=(
        "the same streams, swapping often: a request offloaded while others take, write and free "
        "its blocks, then restored, reads its rows back bit for bit and decodes as the uncached "
        "model; an offloaded cache holds no block; a restore into a full pool is refused, changing "
        "nothing (contract, section 9.3; where `offload` is offered)"
    ),
)


class ServingTests(KitTests):
    """Serving pools: prefix caching (a ``kvref.PrefixCaching`` pool) and offload."""

    test_prefix_hits_are_the_rows_written = property_test(PREFIX_CACHING)
    test_offloaded_rows_come_back = property_test(OFFLOAD)
