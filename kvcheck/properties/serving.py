"""Serving pools (docs/contract.md, section 9): prefix caching with eviction, and preemption
by swapping (offload) or by recompute.

A ``ServingPlan`` is a stream of requests on one model and one tight pool, as a serving
engine's scheduler runs them. Prompts are drawn over a vocabulary of 2 or 3 tokens from one
or two shared system prompts, so that requests share prefixes all the time; half the
requests belong to a second tenant (another salt) with the same prompts. A request arrives
(its prompt declared and looked up: the pool may hand it blocks another request wrote), is
fed its prompt in chunks while others arrive, write and leave in between, decodes, rolls a
draft back (where truncate is offered), is swapped out and in (where offload is offered) or
preempted and recomputed (reset, looked up and fed again), and leaves. The pool keys blocks
by a hash the plan draws: the pool's own, one under which every block collides, or one of
two values, so that a pool trusting its keys shows.

Every step of every request is the uncached model on its own tokens; every hit's blocks
were last written full, for this request's salt and tokens, and their rows are read back bit
for bit (``kvcheck.prefix_books``); the books balance after every event
(``kvcheck.pool_books``).

- ``prefix caching``: where the factory is a ``kvref.PrefixCaching`` pool;
- ``offload``: plans that swap often, where the caches offer ``offload``.
"""

from __future__ import annotations

import copy
import gc
import math
import random
from dataclasses import dataclass
from typing import Literal

import torch
from hypothesis import strategies as st

from kvcheck import asserts as kvassert
from kvcheck import failures
from kvcheck import strategies as kvst
from kvcheck.devices import dtype_name
from kvcheck.harness import PATHS, build
from kvcheck.kit import KitTests, Property, property_test
from kvcheck.properties.pool import fill
from kvcheck.properties.requests import run_plan
from kvcheck.session import Engine, Request
from kvref import BlockPool, CacheFactory, ModelConfig, PrefixCaching

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
class Feed:
    """Request ``request`` is fed up to ``to`` tokens: its prompt (or a chunk of it), then
    decode steps (declared first). A hit may already hold them."""

    request: int
    to: int

    def describe(self) -> str:
        return f"r{self.request} is fed up to {self.to} tokens"


@dataclass(frozen=True)
class Rollback:
    """Request ``request`` rejects its last ``back`` decoded tokens (where truncate is
    offered) and decodes other ones after."""

    request: int
    back: int

    def describe(self) -> str:
        return f"r{self.request} rolls its last {self.back} tokens back"


@dataclass(frozen=True)
class Swap:
    """Request ``request`` is swapped out (``out``) or back in (where offload is offered)."""

    request: int
    out: bool

    def describe(self) -> str:
        return f"r{self.request} is swapped {'out' if self.out else 'in'}"


@dataclass(frozen=True)
class Sample:
    """Request ``request`` is a parallel sample of ``parent`` (its caches' ``fork()``, the
    hit blocks shared with it), decoding tokens of its own."""

    request: int
    parent: int

    def describe(self) -> str:
        return f"r{self.request} = a parallel sample of r{self.parent}"


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


Event = Arrive | Feed | Rollback | Swap | Sample | Recompute | Leave


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
        said = "; ".join(f"#{index} {event.describe()}" for index, event in enumerate(events))
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

    def blocks_needed(self, block_size: int) -> int:
        """The most blocks the live requests' caches hold at once, nothing shared: each row
        of each layer ceil(length / block_size), a request still in its prompt counted as
        holding all of it (a hit may hand it that much at once), swapped ones included."""
        held: dict[int, list[int]] = {}  # request -> [batch, length, prompt]
        busiest = 0
        for event in self.events:
            if isinstance(event, Arrive):
                held[event.request] = [event.batch, 0, event.prompt]
            elif isinstance(event, Feed):
                held[event.request][1] = event.to
            elif isinstance(event, Rollback):
                held[event.request][1] -= event.back
            elif isinstance(event, Sample):
                held[event.request] = list(held[event.parent])
            rows = sum(
                batch * math.ceil(max(length, prompt) / block_size)
                for batch, length, prompt in held.values()
            )
            busiest = max(busiest, rows * self.config.num_layers)
            if isinstance(event, Leave):
                del held[event.request]
        return busiest


@dataclass
class _Live:
    """What the strategy knows of a live request while it draws."""

    prompt: int
    length: int = 0
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
        own = draw(st.integers(0 if shared else 1, 8), label="own tokens")
        own = max(0 if shared else 1, min(own, MAX_LENGTH - 4 - shared))
        events.append(
            Arrive(
                request,
                draw(st.integers(1, 2), label="batch"),
                draw(st.sampled_from(SALTS), label="salt"),
                system,
                shared,
                own,
                draw(st.integers(0, 2**16), label="token seed"),
                continues,
                before,
            )
        )
        live[request] = histories[request] = _Live(shared + own)
        feed(request)

    def feed(request: int) -> None:
        state = live[request]
        if state.length < state.prompt:  # the prompt, whole or a chunk of it
            to = draw(st.sampled_from((state.prompt, None)), label="whole prompt")
            to = to or draw(st.integers(state.length + 1, state.prompt), label="chunk to")
        else:
            to = min(MAX_LENGTH, state.length + draw(st.integers(1, 4), label="decode"))
        if to > state.length:
            events.append(Feed(request, to))
            state.decoded += max(0, to - max(state.length, state.prompt))
            state.length = to

    for _ in range(draw(st.integers(3, max_events), label="events")):
        if not live:
            arrive()
            continue
        kinds = ["feed", "feed", "leave", "leave", "recompute", "rollback", *["swap"] * swaps]
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
            events.append(Sample(child, request))
            live[child] = histories[child] = _Live(state.prompt, state.length)
            feed(child)
        elif kind == "rollback" and state.decoded:
            back = draw(st.integers(1, state.decoded), label="rejected")
            events.append(Rollback(request, back))
            state.before = state.length
            state.length -= back
            state.decoded -= back
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

    def sample(self, request: int) -> _Served:
        """A parallel sample's tokens: this prompt, decode tokens of its own."""
        twin = copy.copy(self)
        twin.seed, twin.rollbacks = f"{self.seed}/sample {request}", 0
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

    def step(engine: Engine, index: int, at: str) -> None:
        _run(engine, plan.events[index], served, plan, at)

    run_plan(factory, plan, step, max_length=MAX_LENGTH, block_hash=block_hash)


def _run(engine: Engine, event: Event, served: dict, plan: ServingPlan, at: str) -> None:
    _step(engine, event, served, plan, at)
    request = engine.live.get(f"r{event.request}")
    if request is not None:  # what it holds now, for a later turn to continue
        served[event.request].fed = request.history.cpu()


def _step(engine: Engine, event: Event, served: dict, plan: ServingPlan, at: str) -> None:
    name = f"r{event.request}"
    if isinstance(event, Arrive):
        served[event.request] = _Served(plan, event, engine.model.device, served)
        request = engine.start(name, event.batch)
        request.salt = event.salt
        _look_up(engine, request, served[event.request].tokens(0, event.prompt), at)
        return
    if isinstance(event, Sample):
        served[event.request] = served[event.parent].sample(event.request)
        engine.fork(engine.live[f"r{event.parent}"], name, at=at)
        return
    request, tokens = engine.live[name], served[event.request]
    if isinstance(event, Feed):
        if event.to > request.held:
            _feed(engine, request, tokens, event.to, at)
    elif isinstance(event, Rollback):
        if "truncate" in request.offered:
            tokens.before = request.history.cpu()
            engine.truncate(request, request.held - event.back, at=at)
            tokens.rollbacks += 1
    elif isinstance(event, Swap):
        if "offload" in request.offered:
            (engine.offload if event.out else engine.restore)(request, at=at)
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
    if engine.prefix is not None:
        engine.lookup(request, known, at=at)


def _feed(engine: Engine, request: Request, tokens: _Served, to: int, at: str) -> None:
    """Feed ``request`` up to ``to`` tokens; decode tokens are declared first."""
    prompt = len(tokens.prompts[0])
    new = tokens.tokens(request.held, to)
    if engine.prefix is not None and to > max(prompt, request.held):
        engine.declare(request, new[:, max(0, prompt - request.held) :])
    engine.feed(request, new, at=at)


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


def restore_without_room(factory: CacheFactory, plan: ServingPlan) -> None:
    """An offloaded cache of ``plan``'s model (batch 1, two blocks and a bit) is restored
    while a filler holds every block: ``ValueError``, and its length, its ``offloaded`` and
    the pool's counts unchanged; with the filler gone, restored bit for bit."""
    size = factory.block_size
    spec = kvst.build_model(plan.config, plan.dtype).cache_spec(1, 2 * size + 2)
    pool = factory.with_blocks(3)
    cache = build(pool, spec)
    keys = kvst.random_rows(spec, 2 * size + 1, 1)
    values = kvst.random_rows(spec, 2 * size + 1, 2, values=True)
    cache.append(keys.clone(), values.clone())
    cache.offload()
    where = f"a cache holding {2 * size + 1} rows in blocks of {size}, offloaded, of {spec}"
    filler = fill(pool, spec, 0, where)
    before = (cache.length, cache.offloaded, pool.blocks_in_use, pool.blocks_free)
    error = kvassert.raised_by(cache.restore)
    after = (cache.length, cache.offloaded, pool.blocks_in_use, pool.blocks_free)
    said = "(length, offloaded, blocks_in_use, blocks_free)"
    if not isinstance(error, ValueError):
        raise failures.DataLoss(
            f"the pool: restore() with no block free returned {error!r}, not a ValueError: "
            f"the pool overcommits or restored nothing\n  at {where}"
        )
    if after != before:
        raise failures.RefusalChangedState(
            f"the pool: a refused restore() changed {said} from {before} to {after}\n  at {where}"
        )
    del filler
    gc.collect()
    cache.restore()
    returned = cache.append(keys[:, :, :1].clone(), values[:, :, :1].clone())
    for part, got, given in zip(("keys", "values"), returned, (keys, values), strict=True):
        want = torch.cat((given, given[:, :, :1]), dim=2)
        bad = kvassert.differing_rows(got, want) if got.shape == want.shape else ["all"]
        if bad:
            raise failures.DataLoss(
                f"the pool: after a refused restore() and one with room, the cache returned "
                f"{part} unlike the rows it held, at rows {bad[:8]}\n  at {where}"
            )


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
            Feed(0, 40),
            Arrive(2, 1, None, 0, 40, 1, 3),
            Leave(0, "drop"),
            Feed(2, 41),
            Feed(2, 43),
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
            Feed(1, 39),
            Recompute(2),
            Feed(2, 38),
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
            Feed(0, 30),
            Feed(0, 34),
            Rollback(0, 4),
            Feed(0, 33),
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
)
OFFLOAD = Property(
    "offload",
    "a request swapped out of the pool and back in, while others reuse its blocks, holds "
    "its rows bit for bit and decodes as the model",
    check_offload,
    serving_plans(swaps=4),
    failures.DATA_LOSS,
    requires=("offload",),
    since="1.3",
)


class ServingTests(KitTests):
    """Serving pools: prefix caching (a ``kvref.PrefixCaching`` pool) and offload."""

    test_prefix_hits_are_the_rows_written = property_test(PREFIX_CACHING)
    test_offloaded_rows_come_back = property_test(OFFLOAD)
