"""Context shift (docs/contract.md, section 8.4): when its context fills, a session discards
a span of its history and moves what follows down, the cache re-rotating the keys it moves,
as llama.cpp does; the session then runs on past ``max_length``.

A ``ShiftPlan`` is a batch, a first position (set with ``reset_at`` where offered, so that
positions recounted from 0 show) and its events: tokens fed (prompt, decode steps, chunks)
and shifts ``(start, count)``, one before any feed that would overflow the cache, drawn
from index 0 (the oldest tokens) or after a few kept ones (llama.cpp's ``n_keep``), across
the 16-row block edges and the window's, of 1 token to most of the history, at a RoPE base
of a real model (10,000, 500,000, 1,000,000). One plan in ``FAR_ONE_IN`` is far: a cache of
400 rows filled and a shift of 100 tokens or more, on wide heads in half precision often,
where an angle rounded in half precision shows (tests/measure_shift.py). The oracle is
the uncached pass's rows with each span removed and the keys after it rotated in float64,
held in a trusted cache (``kvref.shift_oracle.HeldRows``); every later step's logits are the
model's over those rows (``Engine.shift``). Each shift run notes the edges it reached
(``EDGES``, ``kvcheck.reach``).

- ``context shift``: where ``shift`` is offered.
- ``context shift per row``: a ``RowShiftPlan``, a batch whose rows have lengths of their
  own, each row shifted by a span of its own (``shift(starts, counts)``), every row judged
  alone at batch 1 against its own shifted rows (``Engine.shift_rows``); where a cache
  declares ``shift_per_row``.
- ``bad shift per row``: each bad call of ``kvcheck.badinput.BAD_ROW_SHIFTS``, refused and
  changing nothing, there too.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from kvcheck import asserts as kvassert
from kvcheck import badinput as kvbad
from kvcheck import devices as kvdevices
from kvcheck import failures, grammar, reach
from kvcheck import scope as kvscope
from kvcheck import sizes as kvsizes
from kvcheck import strategies as kvst
from kvcheck import tensors as kvtensors
from kvcheck.devices import dtype_name
from kvcheck.harness import PATHS
from kvcheck.kit import KitTests, Property, on_both_paths, path_for, property_test
from kvcheck.plan_events import Feed, FeedRows, ResetAt, Shift, ShiftRows
from kvcheck.properties.rows import (
    FIRST_POSITIONS,
    RowsRun,
    drawn_rows_plan,
    every_plan_of_rows,
    prompt_counts,
    row_feed_moves,
    rows_engine,
)
from kvcheck.session import Engine
from kvref import CacheFactory, ModelConfig
from kvref.reprs import short_repr
from kvref.rope import ROPE_TABLE_POSITIONS

EDGE = kvst.EDGE
CAPACITIES = (EDGE, EDGE + 1, 2 * EDGE - 1, 2 * EDGE, 2 * EDGE + 1, 48)
# RoPE bases of real models: 10,000 (Llama 2, Mistral, Gemma), 500,000 (Llama 3), 1,000,000
# (Qwen 2, Code Llama); a cache that re-rotates with 10,000 written in shows only off it.
ROPE_BASES = (10_000.0, 10_000.0, 500_000.0, 1_000_000.0)
# Far shifts: one plan in FAR_ONE_IN fills a cache of FAR_LENGTH (within the domain's) and
# discards FAR_SHIFT tokens or more at once, as llama.cpp's half of a full context does. Only
# there does an angle rounded in half precision leave the budget (tests/measure_shift.py).
FAR_ONE_IN = 8
FAR_LENGTH = 25 * EDGE  # 400: room for shifts past 256, the last count bfloat16 holds exactly
FAR_SHIFT = 100


@short_repr
@dataclass(frozen=True)
class ShiftPlan:
    """One batch, fed as one request (``r0``), and its events: ``Feed`` and ``Shift``."""

    config: ModelConfig
    dtype: torch.dtype
    batch: int
    max_length: int
    events: tuple[Feed | Shift, ...]
    token_seed: int
    first: int = 0  # the position of the first token (reset_at), where offered
    path: str = "append"  # the model's path through the caches (attend where offered)

    def describe(self) -> str:
        events = "; ".join(event.describe() for event in self.events)
        first = f", first position {self.first}" if self.first else ""
        base = "" if self.config.rope_base == 10_000 else f", RoPE base {self.config.rope_base:g}"
        return (
            f"shift plan: batch {self.batch}, {dtype_name(self.dtype)}, max_length "
            f"{self.max_length}{first}, {self.path} path, events: {events}\n  model: "
            f"{kvst.describe_config(self.config)}{base}"
        )

    def summary(self) -> tuple[str, str, str]:
        fed = sum(event.size for event in self.events if isinstance(event, Feed))
        shifts = sum(isinstance(event, Shift) for event in self.events)
        return f"{fed} ({shifts} shifts)", str(self.config.num_layers), str(self.batch)


@st.composite
def spans(draw, held: int, window: int | None) -> tuple[int, int]:
    """A span of ``held`` tokens to discard: from 0, after a few kept, at the window's edge
    (what the next query sees changes), or anywhere; 1 token, a block's worth around its
    edge, half the rest (llama.cpp's choice), or any."""
    keep = draw(st.sampled_from((0, 0, 1, 4, "window", "any")), label="tokens kept before it")
    if keep == "window" and window is not None:
        edge = held - window + draw(st.integers(-1, 1), label="around the window's edge")
        start = min(max(0, edge), held - 1)
    elif keep == "any" or keep == "window":
        start = draw(st.integers(0, held - 1), label="start")
    else:
        start = min(keep, held - 1)
    room = held - start
    count = draw(
        st.one_of(
            st.just(1),
            st.sampled_from((EDGE - 1, EDGE, EDGE + 1)),
            st.just(max(1, room // 2)),
            st.integers(1, room),
        ),
        label="count",
    )
    return start, min(count, room)


@st.composite
def configs(draw, max_layers: int, tokens: int) -> ModelConfig:
    """A model for a shift plan, at one of the RoPE bases of real models."""
    config = draw(kvst.model_configs(max_layers=max_layers, tokens=tokens), label="config")
    base = draw(st.sampled_from(ROPE_BASES), label="rope base")
    return dataclasses.replace(config, rope_base=base)


@st.composite
def far_configs(draw, tokens: int) -> ModelConfig:
    """A one-layer model for a far plan, its heads often 64 or 128 wide, where the attention
    budget has room and the cache declares no widths of its own: a half precision angle
    shows on wide heads (tests/measure_shift.py)."""
    config = draw(configs(max_layers=1, tokens=tokens), label="config")
    room = kvsizes.ATTENTION_BUDGET // tokens**2 // config.num_heads - kvsizes.SCORE_COST
    if config.attention == "mla" or kvsizes.domain().head_dims is not None:
        return config
    widths = [config.head_dim, *(width for width in (64, 128) if width <= room)]
    head_dim = draw(st.sampled_from(widths), label="far head_dim")
    if head_dim == config.head_dim:
        return config
    return dataclasses.replace(config, head_dim=head_dim, hidden=config.hidden or 16)


@st.composite
def shift_plans(draw) -> ShiftPlan:
    """A near plan (``near_shift_plans``), or one in ``FAR_ONE_IN`` a far one."""
    far = draw(st.integers(0, FAR_ONE_IN - 1), label="far shift?") == FAR_ONE_IN - 1
    if far and kvsizes.longest(FAR_LENGTH) > 2 * FAR_SHIFT:
        return draw(far_shift_plans(), label="far plan")
    return draw(near_shift_plans(), label="near plan")


@st.composite
def near_shift_plans(draw) -> ShiftPlan:
    """A prompt, then decode steps and chunks, a shift before any feed that would overflow
    and shifts drawn anywhere, ending with a decode step after the last shift."""
    max_length = draw(st.sampled_from(CAPACITIES), label="max_length")
    config = draw(configs(max_layers=2, tokens=max_length + 8), label="config")
    held = draw(st.integers(1, max_length), label="prompt")
    events: list[Feed | Shift] = [Feed(0, held)]
    for _ in range(draw(st.integers(1, 8), label="events")):
        kind = draw(st.sampled_from(("decode", "chunk", "shift")), label="event")
        if kind == "shift" and held:
            span = draw(spans(held, config.window), label="span")
            events.append(Shift(0, *span))
            held -= span[1]
            continue
        size = 1 if kind == "decode" else draw(kvst.chunk_sizes, label="chunk")
        size = min(size, max_length)
        if held + size > max_length:  # full: make room as an engine would (held >= 1 here)
            start = min(draw(st.sampled_from((0, 4)), label="tokens kept"), held - 1)
            count = max(held + size - max_length, (held - start) // 2)
            start = min(start, held - count)  # keeping fewer where the overflow needs it
            events.append(Shift(0, start, count))
            held -= count
        events.append(Feed(0, size))
        held += size
    if not any(isinstance(event, Shift) for event in events):
        span = draw(spans(held, config.window), label="span")
        events.append(Shift(0, *span))
        held -= span[1]
    if isinstance(events[-1], Shift):
        if held == max_length:
            events.append(Shift(0, 0, 1))
            held -= 1
        events.append(Feed(0, 1))
    first = draw(st.sampled_from((0, *FIRST_POSITIONS)), label="first position")
    return ShiftPlan(
        config=config,
        dtype=draw(kvst.dtypes_on_device(kvst.WITH_HALF), label="dtype"),
        batch=draw(kvsizes.batches(small_max=3), label="batch"),
        max_length=max_length,
        events=tuple(events),
        token_seed=draw(st.integers(0, 2**16), label="token seed"),
        first=first,
        path=draw(st.sampled_from(PATHS), label="path"),
    )


@st.composite
def far_shift_plans(draw) -> ShiftPlan:
    """A cache of up to ``FAR_LENGTH`` filled to within a block, a shift of ``FAR_SHIFT``
    tokens or more after 0 or 4 kept (llama.cpp's half of the rest, or any), a decode step
    and a chunk: one layer, a batch of one or two, half precision half the time, where an
    angle rounded in the storage dtype shows."""
    max_length = kvsizes.longest(FAR_LENGTH)
    config = draw(far_configs(tokens=max_length + 8), label="config")
    held = draw(st.integers(max_length - EDGE, max_length), label="prompt")
    start = draw(st.sampled_from((0, 4)), label="tokens kept")
    half = (held - start) // 2
    count = draw(st.one_of(st.just(half), st.integers(FAR_SHIFT, held - start)), label="count")
    count = max(count, FAR_SHIFT)
    chunk = min(draw(kvst.chunk_sizes, label="chunk"), max_length - (held - count) - 1)
    events = (Feed(0, held), Shift(0, start, count), Feed(0, 1), Feed(0, chunk))
    return ShiftPlan(
        config=config,
        dtype=draw(kvst.dtypes_on_device((*kvst.HALF_DTYPES, *kvst.DTYPES)), label="dtype"),
        batch=draw(kvsizes.batches(small_max=2, room=2), label="batch"),
        max_length=max_length,
        events=events,
        token_seed=draw(st.integers(0, 2**16), label="token seed"),
        first=draw(st.sampled_from((0, *FIRST_POSITIONS)), label="first position"),
        path=draw(st.sampled_from(PATHS), label="path"),
    )


def check_context_shift(factory: CacheFactory, plan: ShiftPlan) -> None:
    """Every step's logits, before and after each shift, equal the model's over the rows the
    caches should hold, and every append returns them (re-rotated keys within rounding)."""
    model = kvtensors.build_model(plan.config, plan.dtype)
    path = path_for(plan.path, factory)
    engine = Engine(factory, model, max_length=plan.max_length, path=path, describe=plan.describe)
    generator = torch.Generator().manual_seed(plan.token_seed)
    request = engine.start("the session", plan.batch)
    first = 0
    if plan.first and callable(getattr(request.caches[0].cache, "reset_at", None)):
        engine.reset_at(request, [plan.first] * plan.batch)
        first = plan.first
    fed = shifts = 0
    for index, event in enumerate(plan.events):
        at = f" (event #{index})"
        if isinstance(event, Feed):
            drawn = torch.randint(
                0, plan.config.vocab_size, (plan.batch, event.size), generator=generator
            )
            engine.feed(request, drawn.to(kvdevices.current()), at=at)
            fed += event.size
            if shifts and fed > plan.max_length:
                reach.note(PAST_MAX_LENGTH)
        else:
            held, span = request.held, (event.start, event.count)
            if not engine.shift(request, *span, at=at):
                break  # a window refused as it may: the rest was drawn for the shifted history
            shifts += 1
            reach.note(*shift_edges(plan, first, held, *span, repeated=shifts > 1))
        engine.check(f"event #{index}")
    engine.finish()


# The edges of section 8.4 the plans must reach, each noted as a shift runs on the cache.
FROM_ZERO = "shift from index 0"
AFTER_KEPT = "shift after 1 to 4 kept tokens (n_keep)"
ONE_TOKEN = "shift of 1 token"
MOST = "shift of most of the history"
ACROSS_BLOCK = "shift across a 16-row block edge"
AT_WINDOW = "shift at a window's edge"
REPEATED = "repeated shifts"
PAST_MAX_LENGTH = "session past max_length after shifts"
OWN_FIRST = "shift with a first position of its own (reset_at)"
THOUSANDS = "shift at positions in the thousands"
OTHER_BASE = "shift at a RoPE base other than 10,000"
FAR = f"shift of {FAR_SHIFT}+ tokens"
FAR_HALF_WIDE = f"shift of {FAR_SHIFT}+ tokens in half precision, head_dim 64+"
PAST_BFLOAT16 = "shift of an odd count past 256 in bfloat16 (a count it cannot hold)"
EDGES = tuple(
    reach.Edge(name, needs=("shift",))
    for name in (
        FROM_ZERO, AFTER_KEPT, ONE_TOKEN, MOST, ACROSS_BLOCK, AT_WINDOW, REPEATED,
        PAST_MAX_LENGTH, OWN_FIRST, THOUSANDS, OTHER_BASE, FAR, FAR_HALF_WIDE, PAST_BFLOAT16,
    )
)  # fmt: skip


def shift_edges(
    plan: ShiftPlan, first: int, held: int, start: int, count: int, *, repeated: bool
) -> list[str]:
    """The edges a shift of ``count`` from ``start`` of ``held`` tokens ran, on a session
    whose first token sits at ``first``."""
    config, window = plan.config, plan.config.window
    wide = config.rope_dim if config.attention == "mla" else config.head_dim
    cases = {
        FROM_ZERO: start == 0,
        AFTER_KEPT: 1 <= start <= 4,
        ONE_TOKEN: count == 1,
        MOST: 2 * count > held,
        ACROSS_BLOCK: start // EDGE != (start + count - 1) // EDGE,
        AT_WINDOW: window is not None and abs(start - (held - window)) <= 1,
        REPEATED: repeated,
        OWN_FIRST: first > 0,
        THOUSANDS: first + held >= 1000,
        OTHER_BASE: config.rope_base != 10_000,
        FAR: count >= FAR_SHIFT,
        FAR_HALF_WIDE: count >= FAR_SHIFT and plan.dtype in kvst.HALF_DTYPES and wide >= 64,
        PAST_BFLOAT16: count > 256 and count % 2 == 1 and plan.dtype == torch.bfloat16,
    }
    return [name for name, reached in cases.items() if reached]


# --- Every plan within a scope (kvcheck.scope), for the bounded-exhaustive mode ---
#
# Shifts go between feeds only, never last: what a shift left is read back by the feed after
# it, as in every drawn plan. At most ``MOST_SHIFTS`` a plan (the second a repeated shift:
# more make the plans explode). The first position is 0 and the path append (positions
# elsewhere and the attend path are the search's); the RoPE base is the layout's, 10,000:
# on heads 2 wide a rotation has one frequency, 1 whatever the base, so another base would
# change nothing (a base written in is the search's, OTHER_BASE).
MOST_SHIFTS = 2


def spans_of(held: int) -> Iterator[tuple[int, int]]:
    """Every span ``(start, count)`` of ``held`` tokens: held (held + 1) / 2 of them."""
    for start in range(held):
        for count in range(1, held - start + 1):
            yield start, count


def shifted_feeds(tokens: int, most: int = MOST_SHIFTS) -> Iterator[tuple[Feed | Shift, ...]]:
    """Every sequence of feeds of ``tokens`` tokens in all with 1 to ``most`` shifts, each
    after a feed and before another, of every span of the tokens then held."""

    def feeds(held: int, left: int):
        return ((Feed(0, size), held + size, size) for size in range(1, left + 1))

    def shifts(held: int):
        return ((Shift(0, start, count), held - count) for start, count in spans_of(held))

    return interleaved_shifts(tokens, 0, feeds, shifts, most)


def interleaved_shifts(tokens: int, empty, feeds, shifts, most: int) -> Iterator[tuple]:
    """The grammar's sentences (``kvcheck.grammar``) of feeds of ``tokens`` tokens in all,
    ``feeds(held, left)`` each feed with the lengths it leaves and the tokens it brings, with
    1 to ``most`` shifts, ``shifts(held)`` each shift with the lengths it leaves, every shift
    after a feed and before another (what it left is read back); from ``empty`` lengths."""

    def moves(state, left: int):
        held, shifted, after_feed = state
        for feed, fed, size in feeds(held, left):
            yield (feed,), (fed, shifted, True), size
        if after_feed and shifted < most and left:
            for shift, kept in shifts(held):
                yield (shift,), (kept, shifted + 1, False), 0

    def ends(state) -> bool:
        _, shifted, after_feed = state
        return shifted > 0 and after_feed

    return grammar.sentences(tokens, (empty, 0, False), moves, ends)


def most_held(events) -> int:
    """The most tokens a plan's events hold at once: the caches' max_length (their exact
    end: a shift makes room in a full cache, and the session runs on past it)."""
    held = most = 0
    for event in events:
        held += event.size if isinstance(event, Feed) else -event.count
        most = max(most, held)
    return most


def every_shift_plan(scope: kvscope.Scope) -> Iterator[ShiftPlan]:
    """Every plan of chunks of 1 to ``scope.tokens`` tokens with 1 to ``MOST_SHIFTS`` shifts
    between them (``shifted_feeds``), each of every span of the tokens held: fewest tokens
    first, then the scope's layouts. With one shift, at n tokens 2^(n-2) (n - 1) n (n + 1)
    / 6 plans a layout (the shift after a tokens: 2^(a-1) splits before, a (a + 1) / 2
    spans, 2^(n-a-1) splits after); with two, 0, 1, 9, 62, 388, 2184 at 1 to 6 tokens
    (tests/test_exhaustive_edits.py counts them another way)."""
    for tokens in range(1, scope.tokens + 1):
        for layout in scope.layouts:
            config = layout.config()
            for events in shifted_feeds(tokens):
                yield ShiftPlan(
                    config=config,
                    dtype=scope.dtype,
                    batch=layout.batch,
                    max_length=most_held(events),
                    events=events,
                    token_seed=0,
                )


# Tried first on every run: a session started at 255, shifted from index 0 across a block
# edge, then past n_keep 4 by one token, with decode steps and a chunk after each, on a model
# whose even layers have a window of 5 (a shift that moves what the window sees), the last
# shift at the window's edge (7 held: from index 2).
PINNED = (
    ShiftPlan(
        config=ModelConfig(
            vocab_size=23, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, window=5,
            window_layers="alternate",
        ),
        dtype=torch.float64,
        batch=2,
        max_length=2 * EDGE,
        events=(
            Feed(0, EDGE + 3),
            Shift(0, 0, EDGE + 1),
            Feed(0, 1),
            Feed(0, 9),
            Shift(0, 4, 1),
            Feed(0, 1),
            Shift(0, 1, 6),
            Feed(0, 2),
            Shift(0, 2, 1),
            Feed(0, 1),
        ),
        token_seed=5,
        first=255,
    ),
)  # fmt: skip

# And a far shift, on the append path only (a long one): a bfloat16 session started at 4096
# on Llama 3's RoPE base fills 390 of 400 rows and discards 259 after n_keep 4 (an odd count
# past 256, which bfloat16 cannot hold), on heads 64 wide, where an angle rounded in bfloat16
# leaves the budget (tests/measure_shift.py) and a base of 10,000 written in leaves it by far;
# then runs past max_length (403 tokens fed).
FAR_PINNED = ShiftPlan(
    config=ModelConfig(
        vocab_size=23, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=64, hidden=16,
        rope_base=500_000.0,
    ),
    dtype=torch.bfloat16,
    batch=1,
    max_length=FAR_LENGTH,
    events=(Feed(0, 390), Shift(0, 4, 259), Feed(0, 1), Feed(0, 12)),
    token_seed=7,
    first=4096,
)  # fmt: skip

CONTEXT_SHIFT = Property(
    "context shift",
    "after a context shift discards a span and re-rotates what follows, every step equals "
    "the model over the rows left at their new positions",
    check_context_shift,
    shift_plans(),
    failures.WRONG_RESULTS,
    requires=("shift",),
    pinned=(*on_both_paths(PINNED), FAR_PINNED),
    since="1.2",
    reaches=EDGES,
    every_plan=every_shift_plan,
    exhaustive_tokens=4,
    holds=(
        "a session that discards spans of its history (`shift(start, count)`: from index 0, after 1"
        " or 4 kept tokens or anywhere; 1 token, a block's worth around its edge, half the rest, "
        "any) before any feed that would overflow and anywhere else, repeated, with decode steps "
        "and chunks after, from a first position of its own where `reset_at` is offered: every "
        "step's logits equal the model's over the uncached pass's rows with the spans removed and "
        "the keys after them re-rotated in float64 (`kvref.shift_oracle.HeldRows`), and every "
        "`append` "
        "returns the rows given, the moved keys within the rounding of a re-rotation in their dtype"
        " (`kvcheck.asserts.shift_rounding`: 4 roundings of the dtype per shift, and the angle's, "
        "`count` roundings of float32) (contract, section 8.4; where `shift` is offered)"
    ),
)


# --- Shifts per row (contract, section 8.4): ``shift(starts, counts)`` with a tuple each ---
ROW_MAX_LENGTH = 2 * EDGE + 1  # per row: prompts and shifts drawn around the block edges below
ROW_SPANS = ("untouched", "untouched", "from 0", "after kept", "whole tail", "any")


@short_repr
@dataclass(frozen=True)
class RowShiftPlan:
    """One batch with rows of their own and its events: ``FeedRows`` and ``ShiftRows``."""

    config: ModelConfig
    dtype: torch.dtype
    batch: int
    events: tuple[FeedRows | ShiftRows, ...]
    token_seed: int
    firsts: tuple[int, ...] | None = None  # each row's first position (reset_at), else 0
    pad: str = "nan"  # what the pad slots' keys and values hold (kvtensors.POISON_VALUES)

    def describe(self) -> str:
        events = "; ".join(event.describe() for event in self.events)
        firsts = "" if self.firsts is None else f", first positions {list(self.firsts)}"
        base = "" if self.config.rope_base == 10_000 else f", RoPE base {self.config.rope_base:g}"
        return (
            f"shift per row plan: batch {self.batch}, {dtype_name(self.dtype)}, max_length "
            f"{ROW_MAX_LENGTH}, pads of {self.pad}{firsts}, events: {events}\n  model: "
            f"{kvst.describe_config(self.config)}{base}"
        )

    def summary(self) -> tuple[str, str, str]:
        fed = sum(sum(event.counts) for event in self.events if isinstance(event, FeedRows))
        shifts = sum(isinstance(event, ShiftRows) for event in self.events)
        return f"{fed} ({shifts} shifts per row)", str(self.config.num_layers), str(self.batch)


@st.composite
def row_span(draw, held: int) -> tuple[int, int]:
    """One row's part of a shift per row: untouched (count 0), from index 0, after a few
    kept, its whole tail from some index, or anywhere."""
    how = draw(st.sampled_from(ROW_SPANS), label="row's span")
    if how == "untouched" or not held:
        return 0, 0
    if how == "from 0":
        return 0, draw(st.integers(1, held), label="count")
    if how == "after kept":
        start = min(draw(st.integers(1, 4), label="kept"), held - 1)
        return start, draw(st.integers(1, held - start), label="count")
    start = draw(st.integers(0, held - 1), label="start")
    count = held - start if how == "whole tail" else draw(st.integers(1, held - start))
    return start, count


@st.composite
def row_shifts(draw, lengths: list[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A shift per row of rows holding ``lengths``, some row moved (its longest, from 0, by
    one token where the draws moved none; none where every row is empty)."""
    spans = [draw(row_span(held), label="span") for held in lengths]
    if not any(count for _, count in spans) and max(lengths):
        spans[lengths.index(max(lengths))] = (0, 1)
    starts, counts = zip(*spans, strict=True)
    return tuple(starts), tuple(counts)


def overflow_shift(lengths: list[int], counts: tuple[int, ...]):
    """Before a feed of ``counts`` a row would overflow: each such row discards half its
    history after 4 kept (llama.cpp's), or as much as the feed needs; the others untouched."""
    starts, discarded = [], []
    for held, count in zip(lengths, counts, strict=True):
        over = held + count - ROW_MAX_LENGTH
        if over <= 0:
            starts.append(0)
            discarded.append(0)
            continue
        start = min(4, held - over)
        starts.append(start)
        discarded.append(max(over, (held - start) // 2))
    return tuple(starts), tuple(discarded)


@st.composite
def row_shift_plans(draw) -> RowShiftPlan:
    """A batch of 2 or 3 rows: prompts of lengths of their own, decode steps and chunks
    (some rows idle), shifts per row anywhere and before any feed that would overflow a
    row, ending with a decode step after the last shift."""
    batch = draw(kvsizes.batches(low=2, small_max=3), label="batch")
    lengths = list(draw(prompt_counts(batch, ROW_MAX_LENGTH), label="prompts"))
    events: list[FeedRows | ShiftRows] = [FeedRows(tuple(lengths))]
    for _ in range(draw(st.integers(1, 6), label="events")):
        kind = draw(st.sampled_from(("decode", "chunk", "shift", "shift")), label="event")
        if kind == "shift":
            shift = draw(row_shifts(lengths), label="shift per row")
        else:
            most = 1 if kind == "decode" else 9
            counts = tuple(draw(st.integers(0, most), label="new tokens") for _ in lengths)
            shift = overflow_shift(lengths, counts)
        if any(shift[1]):
            events.append(ShiftRows(*shift))
            lengths = [n - count for n, count in zip(lengths, shift[1], strict=True)]
        if kind != "shift" and any(counts):
            events.append(FeedRows(counts))
            lengths = [n + count for n, count in zip(lengths, counts, strict=True)]
    if not any(isinstance(event, ShiftRows) for event in events):
        if not max(lengths):  # shifts emptied every row: one token each to shift
            events.append(FeedRows((1,) * batch))
            lengths = [1] * batch
        shift = draw(row_shifts(lengths), label="shift per row")
        events.append(ShiftRows(*shift))
        lengths = [n - count for n, count in zip(lengths, shift[1], strict=True)]
    if isinstance(events[-1], ShiftRows):  # what the last shift left is read back
        events.append(FeedRows(tuple(int(n < ROW_MAX_LENGTH) for n in lengths)))
    models = configs(max_layers=2, tokens=ROW_MAX_LENGTH + 8)
    return drawn_rows_plan(draw, RowShiftPlan, models, batch=batch, events=events)


def check_row_shifts(factory: CacheFactory, plan: RowShiftPlan) -> None:
    """Every row's new logits, before and after each shift per row, equal the model's over
    that row's rows alone, at batch 1, as its own shifts left them; and every append_rows
    returns them (re-rotated keys within rounding)."""
    engine, tokens = rows_engine(factory, plan, ROW_MAX_LENGTH)
    run = RowsRun(engine, engine.start("the batch", plan.batch), tokens, plan.pad)
    if plan.firsts is not None and run.offers("reset_at"):
        run.event(ResetAt(plan.firsts), "")
    shifts = 0
    for index, event in enumerate(plan.events):
        held = run.batch.row_lengths()
        if not run.event(event, f" (event #{index})"):
            break  # a window refused as it may: the rest was drawn for the shifted rows
        if isinstance(event, ShiftRows):
            shifts += 1
            firsts = run.batch.row_firsts()
            edges = row_shift_edges(held, firsts, event.starts, event.counts, repeated=shifts > 1)
            reach.note(*edges)
        engine.check(f"event #{index}")
    engine.finish()


# The edges of the shift per row (section 8.4) the plans must reach, each noted as it runs.
ROW_UNTOUCHED = "a row untouched (count 0) beside a shifted one"
ROWS_OWN_COUNTS = "every row shifted by a different count"
ROW_WHOLE_TAIL = "a shift of a row's whole tail"
ROW_FULL = "a row full at max_length shifted"
ROW_ACROSS_TABLE = "a row shifted across the end of the model's rotation table"
ROW_OWN_FIRSTS = "shifts per row on rows with first positions of their own (reset_at)"
ROW_REPEATED = "repeated shifts per row"
ROW_EDGES = (
    *(reach.Edge(name, needs=("shift per row",)) for name in (
        ROW_UNTOUCHED, ROWS_OWN_COUNTS, ROW_WHOLE_TAIL, ROW_FULL, ROW_ACROSS_TABLE, ROW_REPEATED,
    )),
    reach.Edge(ROW_OWN_FIRSTS, needs=("shift per row", "reset_at")),
)  # fmt: skip


def row_shift_edges(
    held: list[int], firsts: list[int], starts, counts, *, repeated: bool
) -> list[str]:
    """The edges a shift per row of ``counts`` from ``starts`` ran on rows holding ``held``
    tokens from positions ``firsts``."""
    spans = list(zip(held, firsts, starts, counts, strict=True))
    shifted = [(n, first, start, count) for n, first, start, count in spans if count]
    cases = {
        ROW_UNTOUCHED: any(n and not count for n, _, _, count in spans),
        ROWS_OWN_COUNTS: len(shifted) == len(spans) and len(set(counts)) == len(counts),
        ROW_WHOLE_TAIL: any(start + count == n for n, _, start, count in shifted),
        ROW_FULL: any(n == ROW_MAX_LENGTH for n, _, _, _ in shifted),
        ROW_ACROSS_TABLE: any(
            first + start < ROPE_TABLE_POSITIONS <= first + n - 1 for n, first, start, _ in shifted
        ),
        ROW_OWN_FIRSTS: len(set(firsts)) > 1,
        ROW_REPEATED: repeated,
    }
    return [name for name, reached in cases.items() if reached]


# Shifts per row: as above, at most ``MOST_ROW_SHIFTS`` a plan (rows multiply the spans).
MOST_ROW_SHIFTS = 1


def row_spans(held: int) -> Iterator[tuple[int, int]]:
    """A row's part of a shift per row: untouched ``(0, 0)``, or every span of its tokens."""
    yield 0, 0
    yield from spans_of(held)


def row_shifted_feeds(
    tokens: int, batch: int, most: int = MOST_ROW_SHIFTS
) -> Iterator[tuple[FeedRows | ShiftRows, ...]]:
    """Every sequence of calls with a count per row (``rows.row_feed_moves``) of ``tokens``
    tokens over all ``batch`` rows, with 1 to ``most`` shifts per row, each after a call and
    before another, of every span per row of the rows then held (one row moved at least)."""

    def feeds(held: tuple[int, ...], left: int):
        return ((feed, fed, size) for (feed,), fed, size in row_feed_moves(held, left))

    def shifts(held: tuple[int, ...]):
        for spans in itertools.product(*(row_spans(n) for n in held)):
            if not any(count for _, count in spans):
                continue  # no row moved: no shift
            starts, discarded = zip(*spans, strict=True)
            kept = tuple(n - gone for n, gone in zip(held, discarded, strict=True))
            yield ShiftRows(starts, discarded), kept

    return interleaved_shifts(tokens, (0,) * batch, feeds, shifts, most)


def every_row_shift_plan(scope: kvscope.Scope) -> Iterator[RowShiftPlan]:
    """Every plan of calls with a count per row (``rows.row_feed_moves``) of 1 to
    ``scope.tokens`` tokens over all rows, with a shift per row between two of them of every
    span per row (``row_shifted_feeds``): fewest tokens first, then the scope's layouts (a
    batch of 1 taken as 2: rows of their own need two). For 2 rows, 0, 4, 56, 515, 3928
    plans a layout at 1 to 5 tokens (tests/test_exhaustive_edits.py counts them another
    way).
    Fixed as for ``every_shift_plan``, and the rows start at 0 and pads are nan (as
    ``rows.every_rows_plan``)."""
    return every_plan_of_rows(scope, RowShiftPlan, row_shifted_feeds)


# Tried first on every run: three rows from positions 8180, 0 and 255 (row 0 across the end
# of the rotation table), row 1 full; row 0 and 1 shifted by counts of their own beside row 2
# untouched, a decode step, then every row's whole tail from an index of its own by a
# different count, and decode steps after.
ROW_PINNED = RowShiftPlan(
    config=ModelConfig(
        vocab_size=23, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
        rope_base=500_000.0,
    ),
    dtype=torch.float64,
    batch=3,
    events=(
        FeedRows((20, ROW_MAX_LENGTH, 7)),
        ShiftRows((4, 0, 0), (9, EDGE, 0)),
        FeedRows((1, 1, 1)),
        ShiftRows((2, 10, 5), (10, 8, 3)),
        FeedRows((3, 0, 1)),
        FeedRows((1, 1, 1)),
    ),
    token_seed=11,
    firsts=(8180, 0, 255),
)  # fmt: skip

CONTEXT_SHIFT_PER_ROW = Property(
    "context shift per row",
    "after each row of a batch discards a span of its own and re-rotates what follows, every "
    "row equals the model over its own rows left, alone",
    check_row_shifts,
    row_shift_plans(),
    failures.WRONG_RESULTS,
    requires=("shift per row",),
    pinned=(ROW_PINNED,),
    since="1.6",
    reaches=ROW_EDGES,
    every_plan=every_row_shift_plan,
    exhaustive_tokens=4,
    holds=(
        "a batch of 2 or 3 rows of their own (lengths and first positions of their own), fed by "
        "row, each row discarding a span of its own (`shift(starts, counts)`, a tuple each: "
        "untouched, from index 0, after a few kept, its whole tail, anywhere) before any feed that "
        "would overflow it and anywhere else: every row's new logits equal the model's over that "
        "row's rows alone at batch 1, the uncached pass's with its spans removed and the keys after"
        " them re-rotated by its own counts in float64 (`kvref.shift_oracle.HeldRows`), and what "
        "`append_rows` marks valid for each row is the rows given, moved keys within "
        "`kvcheck.asserts.shift_rounding` (contract, section 8.4, shifts per row; where a cache "
        "declares `shift_per_row`)"
    ),
)


# Every bad shift per row is followed by a read-back of one token per row.
BAD_READS = len(kvbad.BAD_ROW_SHIFTS)


@dataclass(frozen=True)
class WarmRows:
    """A batch of rows of their own, each fed ``lengths`` tokens, that bad shifts are sent
    to."""

    config: ModelConfig
    dtype: torch.dtype
    lengths: tuple[int, ...]
    token_seed: int

    def describe(self) -> str:
        return (
            f"rows of their own holding {list(self.lengths)} tokens, "
            f"{dtype_name(self.dtype)}, max_length {ROW_MAX_LENGTH}\n  model: "
            f"{kvst.describe_config(self.config)}"
        )

    def summary(self) -> tuple[str, str, str]:
        """The mutant report's columns: tokens (the rows' prompts), layers, batch."""
        lengths = "+".join(str(n) for n in self.lengths)
        return f"{lengths} (warm rows)", str(self.config.num_layers), str(len(self.lengths))


@st.composite
def warm_rows(draw) -> WarmRows:
    """2 or 3 rows of different lengths, none empty: a row's own length shows in a refusal."""
    batch = draw(kvsizes.batches(low=2, small_max=3), label="batch")
    lengths = draw(
        st.lists(
            st.integers(1, ROW_MAX_LENGTH - BAD_READS), min_size=batch, max_size=batch, unique=True
        ),
        label="row lengths",
    )
    return WarmRows(
        config=draw(kvst.model_configs(max_layers=1, tokens=ROW_MAX_LENGTH + 8), label="config"),
        dtype=draw(kvst.dtypes_on_device(kvst.DTYPES), label="dtype"),
        lengths=tuple(lengths),
        token_seed=draw(st.integers(0, 2**16), label="token seed"),
    )


def check_bad_row_shifts(factory: CacheFactory, state: WarmRows) -> None:
    """Each bad shift per row (``kvcheck.badinput.BAD_ROW_SHIFTS``) sent to a warm batch's
    caches is refused with a clear error, and every row then reads back through append_rows
    as it was (one token more per row: the next case is made for the rows as they are)."""
    model = kvtensors.build_model(state.config, state.dtype)
    engine = Engine(factory, model, max_length=ROW_MAX_LENGTH, describe=state.describe)
    generator = torch.Generator().manual_seed(state.token_seed)

    def tokens(count: int) -> torch.Tensor:
        drawn = torch.randint(0, state.config.vocab_size, (count,), generator=generator)
        return drawn.to(kvdevices.current())

    batch = engine.start("the batch", len(state.lengths))
    engine.feed_rows(batch, [tokens(n) for n in state.lengths], at=" (warming up)")
    for case in kvbad.BAD_ROW_SHIFTS:
        check_bad_row_shift(engine, batch, case, tokens)


def check_bad_row_shift(engine: Engine, batch, case: kvbad.BadInput, tokens) -> None:
    """``case``, made for the rows ``batch`` holds, refused by every layer's cache and
    changing nothing: every row reads back as it was."""
    lengths = tuple(batch.row_lengths())
    bad = case.make(lengths)
    where = engine.where(f"shift{bad} sent to every layer's cache, the rows holding {lengths}")
    # Straight to the caches, past the recorders: a refused call must record nothing.
    errors = [
        kvassert.raised_by(lambda r=recorder: r.cache.shift(*bad)) for recorder in batch.caches
    ]
    for error in errors:
        kvassert.assert_refused(error, case, where=where)
    try:  # whatever the error, a refusal changes nothing: every row reads back as it was
        engine.feed_rows(batch, [tokens(1) for _ in lengths], at=f" (after {case})")
    except (failures.DataLoss, failures.WrongResults) as changed:
        raise failures.RefusalChangedState(
            f'after refusing "{case}", reading every row back: {changed}'
        ) from changed
    for error in errors:
        kvassert.assert_clear_error(error, case, bad, where=where)


def every_warm_rows(scope: kvscope.Scope) -> Iterator[WarmRows]:
    """Every ``WarmRows`` within ``scope``, fewest tokens first, then by layout, then by
    shape: 2 or 3 rows (the strategy's batch) of distinct lengths (the strategy's: a row's
    own length shows in a refusal), in every order (row b is not row c to a cache), summing
    to t; on each layout's model cut to one layer (the strategy's), the scope's dtype,
    token seed 0. The tokens are the rows' warm-up tokens; the one token per row each case's
    read-back feeds is the property's, the same for every plan (``BAD_READS`` x the rows),
    and not counted.

    Per layout, the plans of t tokens number (t - 1 - [t even]) ordered pairs of distinct
    lengths, plus 6 x the partitions of t into 3 distinct parts: 0, 0, 2, 2, 4, 10, 12, 18
    for t = 1..8; 4 up to N = 4, 18 up to N = 6, 48 up to N = 8."""
    most_rows = min(3, kvsizes.domain().max_batch or 3)
    longest = ROW_MAX_LENGTH - BAD_READS
    configs = dict.fromkeys(
        dataclasses.replace(layout, layers=1).config() for layout in scope.layouts
    )
    for total in range(1, scope.tokens + 1):
        for config in configs:
            for rows in range(2, most_rows + 1):
                for lengths in itertools.product(range(1, min(longest, total) + 1), repeat=rows):
                    if sum(lengths) == total and len(set(lengths)) == rows:
                        yield WarmRows(config, scope.dtype, lengths, token_seed=0)


BAD_SHIFT_PER_ROW = Property(
    "bad shift per row",
    "a bad shift per row is refused with a ValueError naming the row and the problem, "
    "changing nothing",
    check_bad_row_shifts,
    warm_rows(),
    failures.ACCEPTS_BAD_INPUT,
    requires=("shift per row",),
    since="1.6",
    every_plan=every_warm_rows,
    exhaustive_tokens=8,
    holds=(
        "each bad shift per row (`kvcheck.badinput.BAD_ROW_SHIFTS`: a tuple one entry short, a "
        "start past a short row's length, a negative count, a count past a short row's end, an int "
        "beside a tuple, every count 0, a float count), each within the longest row, sent to a warm"
        " batch of rows of different lengths: refused with a `ValueError` naming the problem, every"
        " row read back through `append_rows` as it was (contract, section 8.4; where a cache "
        "declares `shift_per_row`)"
    ),
)


class ShiftTests(KitTests):
    """Context shift (``shift``): run when offered."""

    test_after_a_context_shift_each_step_equals_the_model_over_the_rows_left = property_test(
        CONTEXT_SHIFT
    )
    test_after_shifts_per_row_each_row_equals_the_model_over_its_rows_left = property_test(
        CONTEXT_SHIFT_PER_ROW
    )
    test_bad_shift_per_row_is_refused_and_changes_nothing = property_test(BAD_SHIFT_PER_ROW)
