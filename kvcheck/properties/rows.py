"""Rows of their own (docs/contract.md, section 8.1): one batched cache whose rows bring
different numbers of new tokens in one call, as batched generation feeds prompts of
different lengths and decodes rows that finished beside rows that did not.

A ``RowsPlan`` is a batch and its events: rows fed a count each (0 allowed: an empty slot),
rolled back by a count each (``truncate_rows``, speculative acceptance per row), a finished
row leaving (``select_rows``), and a request prefilled on caches of its own joining the batch
(``join``), the rows starting at positions of their own where ``reset_at`` is offered
(section 8.3). The oracle is the one of every property: each row's new logits, and the rows
``append_rows`` marks valid, against the uncached model on that row alone, at batch 1, at its
positions, so that no row's result may depend on its neighbours' lengths; pads reach the
caches as nan, inf, -inf or 1e30 (``ReferenceTransformer.forward_rows``).
Events a cache does not offer (it has ``append_rows`` but no ``join``, say) are left out.

- ``mixed lengths``: where ``append_rows`` is offered.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import ClassVar, TypeVar

import torch
from hypothesis import strategies as st

from kvcheck import devices as kvdevices
from kvcheck import failures, grammar, reach
from kvcheck import scope as kvscope
from kvcheck import sizes as kvsizes
from kvcheck import strategies as kvst
from kvcheck import tensors as kvtensors
from kvcheck.devices import dtype_name
from kvcheck.kit import KitTests, Property, property_test
from kvcheck.plan_events import FeedRows, Join, ResetAt, SelectRows, ShiftRows, TruncateRows
from kvcheck.session import Engine
from kvref import CacheFactory, ModelConfig
from kvref.reprs import short_repr
from kvref.rope import ROPE_TABLE_POSITIONS

RowEvent = FeedRows | TruncateRows | SelectRows | Join | ResetAt | ShiftRows

MAX_LENGTH = 48  # per row: prompts and rollbacks drawn around the 16-row boundaries below it
EVENTS = ("feed", "truncate", "select", "join", "restart")  # drawn; "restart" is a ResetAt
FIRST_POSITIONS = (0, 1, 47, 48, 49, 255, 256, 1023, 1025, 4095, 4096, 8191, 8192, 100_003)


@short_repr
@dataclass(frozen=True)
class RowsPlan:
    """One batch and its events (``kvcheck.plan_events``: ``FeedRows``, ``TruncateRows``,
    ``SelectRows``, ``Join``, ``ResetAt``; ``ShiftRows`` in a ``RowShiftPlan``)."""

    TITLE: ClassVar[str] = "rows plan"  # what describe() calls it (a subclass, its own)
    config: ModelConfig
    dtype: torch.dtype
    batch: int
    events: tuple[RowEvent, ...]
    token_seed: int
    firsts: tuple[int, ...] | None = None  # each row's first position (reset_at), else 0
    pad: str = "nan"  # what the pad slots' keys and values hold (kvtensors.POISON_VALUES)

    def describe(self) -> str:
        events = "; ".join(event.describe() for event in self.events)
        firsts = "" if self.firsts is None else f", first positions {list(self.firsts)}"
        return (
            f"{self.TITLE}: batch {self.batch}, {dtype_name(self.dtype)}, pads of {self.pad}"
            f"{firsts}, events: {events}\n  model: {kvst.describe_config(self.config)}"
        )

    def summary(self) -> tuple[str, str, str]:
        fed = sum(sum(event.counts) for event in self.events if isinstance(event, FeedRows))
        joined = (event.joining for event in self.events if isinstance(event, Join))
        fed += sum(prompt for joining in joined for prompt, _ in joining)
        kinds = ", ".join(dict.fromkeys(type(event).__name__ for event in self.events))
        return f"{fed} ({kinds})", str(self.config.num_layers), str(self.batch)


P = TypeVar("P")  # a plan with a RowsPlan's fields (a RowsPlan, a subclass, a RowShiftPlan)


@st.composite
def prompt_counts(draw, batch: int, room: int) -> tuple[int, ...]:
    """Prompts that differ by 0, by 1 or by many tokens, or with one row's slot empty."""
    base = draw(st.integers(1, min(12, room)), label="prompt")
    spread = draw(st.sampled_from(("same", "by one", "by many", "an empty slot")), label="spread")
    if spread == "same":
        return (base,) * batch
    if spread == "by one":
        return tuple(min(room, base + row % 2) for row in range(batch))
    counts = [draw(st.integers(0, room), label="prompt of a row") for _ in range(batch)]
    if spread == "an empty slot":
        counts[draw(st.integers(0, batch - 1), label="empty row")] = 0
    return tuple(counts) if any(counts) else (base, *counts[1:])


@st.composite
def rows_plans(draw) -> RowsPlan:
    """A batch of 2 to 4 rows: prompts, then decode steps (some rows idle), chunks, per-row
    rollbacks, rows leaving and requests joining after them."""
    batch = draw(kvsizes.batches(low=2, small_max=4), label="batch")  # within a domain's
    built = batch  # the rows the batch's caches were built for: a join fits in those
    events = []
    first = draw(prompt_counts(batch, MAX_LENGTH // 2), label="prompts")
    events.append(FeedRows(first))
    lengths = list(first)
    for _ in range(draw(st.integers(1, 6), label="events")):
        kind = draw(st.sampled_from(("decode", "decode", "chunk", *EVENTS[1:])), label="event")
        if kind in ("decode", "chunk"):
            most = 1 if kind == "decode" else 9
            counts = tuple(
                draw(st.integers(0, min(most, MAX_LENGTH - n)), label="new tokens") for n in lengths
            )
            if any(counts):
                events.append(FeedRows(counts))
                lengths = [n + c for n, c in zip(lengths, counts, strict=True)]
        elif kind == "truncate":
            keep = tuple(n - draw(rejected_counts(n), label="rejected") for n in lengths)
            events.append(TruncateRows(keep))
            lengths = list(keep)
        elif kind == "select":
            kept = draw(selections(len(lengths)), label="rows kept")
            events.append(SelectRows(kept))
            lengths = [lengths[row] for row in kept]
        elif kind == "join":
            if len(lengths) == built and len(lengths) > 1:
                # A full batch: rows finish and leave first, so that a request may join.
                kept = draw(leavers(len(lengths)), label="rows kept")
                events.append(SelectRows(kept))
                lengths = [lengths[row] for row in kept]
            if len(lengths) < built:
                prompts = draw(joining_requests(built - len(lengths)), label="joining")
                events.append(Join(prompts))
                lengths += [prompt for prompt, _ in prompts]
        elif kind == "restart" and len(lengths) == built:
            # Every row empty and elsewhere: a new batch on these caches, of the rows they were
            # built for (which batch a reset returns to after rows left is the cache's choice).
            firsts = tuple(draw(st.sampled_from(FIRST_POSITIONS), label="first") for _ in lengths)
            prompts = draw(prompt_counts(len(lengths), MAX_LENGTH // 2), label="prompts")
            events += [ResetAt(firsts), FeedRows(prompts)]
            lengths = list(prompts)
    # Every plan ends with a decode step, so that what the last edit left is read back.
    if not isinstance(events[-1], FeedRows) and any(n < MAX_LENGTH for n in lengths):
        events.append(FeedRows(tuple(int(n < MAX_LENGTH) for n in lengths)))
    configs = kvst.model_configs(max_layers=2, tokens=MAX_LENGTH + 8)
    return drawn_rows_plan(draw, RowsPlan, configs, batch=batch, events=events)


def drawn_rows_plan(
    draw, plan: type[P], configs, *, batch: int, events, config_label: str | None = "config"
) -> P:
    """A plan of ``plan``'s kind (one with a ``RowsPlan``'s fields) for ``batch`` rows and
    their ``events``, the rest drawn in this order: first positions, a model of ``configs``
    (its draw labelled ``config_label``), the dtype, the token seed and the pads. Half the
    plans start their rows elsewhere than 0: near and past powers of two, past max_length,
    and where the reference model's table of rotations ends."""
    firsts = None
    if draw(st.booleans(), label="first positions"):
        firsts = tuple(draw(st.sampled_from(FIRST_POSITIONS), label="first") for _ in range(batch))
    return plan(
        firsts=firsts,
        config=draw(configs, label=config_label),
        dtype=draw(kvst.dtypes_on_device(kvst.WITH_HALF), label="dtype"),
        batch=batch,
        events=tuple(events),
        token_seed=draw(st.integers(0, 2**16), label="token seed"),
        pad=draw(st.sampled_from(sorted(kvtensors.POISON_VALUES)), label="pad"),
    )


def rows_engine(factory: CacheFactory, plan: P, max_length: int) -> tuple[Engine, Callable]:
    """An engine over ``plan``'s model, its caches built for ``max_length`` tokens a row, and
    ``tokens(count)``: the next ``count`` tokens of the plan's seed, on the device."""
    model = kvtensors.build_model(plan.config, plan.dtype)
    engine = Engine(factory, model, max_length=max_length, describe=plan.describe)
    return engine, token_source(plan.config, plan.token_seed)


def token_source(config: ModelConfig, seed: int) -> Callable[[int], torch.Tensor]:
    """``tokens(count)``: the next ``count`` tokens of ``seed``, on the device (every call
    new ones, so that rows a rollback dropped differ from those replacing them)."""
    generator = torch.Generator().manual_seed(seed)
    device = kvdevices.current()

    def tokens(count: int) -> torch.Tensor:
        drawn = torch.randint(0, config.vocab_size, (count,), generator=generator)
        return drawn.to(device)

    return tokens


@st.composite
def rejected_counts(draw, held: int) -> int:
    """A row's rejected draft tokens: none, some (up to 4), or every token it holds."""
    how = draw(st.sampled_from(("some", "some", "none", "all")), label="rollback")
    if how == "none" or not held:
        return 0
    return held if how == "all" else draw(st.integers(1, min(4, held)), label="rejected")


@st.composite
def selections(draw, rows: int) -> tuple[int, ...]:
    """The rows ``select_rows`` keeps: finished rows leave, or every row stays reordered
    (a permutation other than the identity), or both."""
    order = tuple(draw(st.permutations(range(rows)), label="rows in order"))
    how = draw(st.sampled_from(("leave", "reorder", "both")), label="selection")
    if how == "leave" and rows > 1:
        return draw(leavers(rows), label="rows kept")
    if how == "reorder" and rows > 1:
        # The identity is no reorder: a cycle then, whose inverse differs from it from 3 on.
        return order if order != tuple(range(rows)) else (*range(1, rows), 0)
    return order[: draw(st.integers(1, rows), label="rows kept")]


@st.composite
def leavers(draw, rows: int) -> tuple[int, ...]:
    """The rows that stay, in order, when at least one of ``rows`` finishes and leaves."""
    stay = draw(st.integers(1, rows - 1), label="rows staying")
    return tuple(sorted(draw(st.permutations(range(rows)), label="leaving")[:stay]))


@st.composite
def joining_requests(draw, room: int) -> tuple[tuple[int, int], ...]:
    """(prompt, first position) of each row of a request prefilled alone that joins: as many
    rows as the batch has room for, often, each with a first position of its own."""
    joining = room if draw(st.booleans(), label="fill the batch") else draw(st.integers(1, room))
    firsts = draw(
        st.lists(st.sampled_from(FIRST_POSITIONS), min_size=joining, max_size=joining, unique=True),
        label="their first positions",
    )
    prompts = [draw(st.integers(1, 12), label="joining prompt") for _ in firsts]
    return tuple(zip(prompts, firsts, strict=True))


def check_mixed_lengths(factory: CacheFactory, plan: RowsPlan) -> None:
    """Every row's new logits, at every event, equal the uncached model on that row alone."""
    engine, tokens = rows_engine(factory, plan, MAX_LENGTH)
    run = RowsRun(engine, engine.start("the batch", plan.batch), tokens, plan.pad)
    if plan.firsts is not None and run.offers("reset_at"):
        run.event(ResetAt(plan.firsts), "")
    for index, event in enumerate(plan.events):
        if type(event) in NEEDS and not run.offers(NEEDS[type(event)]):
            break  # not offered: the rest of the plan was drawn for the rows it would leave
        run.event(event, f" (event #{index})")
        engine.check(f"event #{index}")
        if any(any(map(any, cache.rows_below or ())) for cache in run.batch.caches):
            reach.note(ROWS_IN_CODES)
    engine.finish()


class RowsRun:
    """A batch whose rows are requests of their own, on an engine, and the one way its events
    run (``mixed lengths``, the shifts per row, the walks of ``interactions``): each event of
    rows of their own (``kvcheck.plan_events``: ``FeedRows``, its pads of ``pad``,
    ``TruncateRows``, ``SelectRows``, ``Join``, ``ResetAt``, ``ShiftRows``) on the session
    engine, noting the edges it reaches (``kvcheck.reach``)."""

    def __init__(self, engine: Engine, batch, tokens: Callable, pad: str) -> None:
        self.engine, self.batch, self.tokens, self.pad = engine, batch, tokens, pad
        # The names, not the cache (a pool must have every block back at the end), asked of
        # the cache itself (an adapter may offer them through __getattr__).
        cache = batch.caches[0].cache
        self.offered = {
            name for name in (*NEEDS.values(), "reset_at") if callable(getattr(cache, name, None))
        }
        self.moved = False  # rows left, were reordered or joined since the batch's last reset

    def offers(self, name: str) -> bool:
        return name in self.offered

    def event(self, event: RowEvent, at: str) -> bool:
        """Run ``event``; False where a window refused it as it may (a truncate or a shift:
        the books stay)."""
        engine, batch = self.engine, self.batch
        held = batch.row_lengths()
        if isinstance(event, FeedRows):
            new = [self.tokens(count) for count in event.counts]
            engine.feed_rows(batch, new, pad=self.pad, at=at)
            note_feed(event.counts, held, batch.row_firsts(), self.pad, engine.max_length)
            note_attention_path(batch.caches[0].rows_returned)
        elif isinstance(event, TruncateRows):
            if not engine.truncate_rows(batch, list(event.keep), at=at):
                return False
            note_rollback(event.keep, held)
        elif isinstance(event, SelectRows):
            engine.select_rows(batch, list(event.kept), at=at)
            note_selection(event.kept, len(held))
            self.moved = True
        elif isinstance(event, ResetAt):
            engine.reset_at(batch, list(event.firsts), at=at)
            note_first_positions(event.firsts)
            if self.moved:
                reach.note(RESTART_AFTER_MOVES)
            self.moved = False
        elif isinstance(event, Join):
            joining = engine.start("a request prefilled alone", len(event.joining))
            if self.offers("reset_at"):
                engine.reset_at(joining, [first for _, first in event.joining], at=at)
            prompts = [self.tokens(prompt) for prompt, _ in event.joining]
            engine.feed_rows(joining, prompts, pad=self.pad, at=at)
            engine.join(batch, joining, at=at)
            note_join(event.joining, with_firsts=self.offers("reset_at"))
            self.moved = True
        elif isinstance(event, ShiftRows):
            return engine.shift_rows(batch, list(event.starts), list(event.counts), at=at)
        else:
            raise ValueError(f"{event!r} is no event of rows of their own")
        return True


# The edges of sections 8.1-8.3 the plans must reach (kvcheck.reach), each noted below when
# it ran on the cache.
SAME_PROMPTS = "prompts of the same length"
PROMPTS_BY_ONE = "prompts that differ by one token"
PROMPTS_BY_MANY = "prompts that differ by many tokens"
EMPTY_SLOT = "an empty slot beside rows fed"
FULL_ROW_IDLE = "a row full at max_length idle while others decode"
PADS = {kind: f"pads of {kind}" for kind in sorted(kvtensors.POISON_VALUES)}
ROLLBACK_OF_NONE = "a rollback of 0 beside a rollback"
ROLLBACK_OF_ALL = "a rollback of a whole row"
ROW_LEAVES = "a finished row leaves while others stay"
PERMUTATION = "select_rows a permutation of every row, not the identity"
JOIN_FIRSTS = "join of 2+ rows with different first positions"
JOIN_LENGTHS = "join of 2+ rows of different lengths"
RESTART_AFTER_MOVES = "reset_at after select_rows or join"
FIRSTS_OF_THEIR_OWN = "rows with different first positions"
BELOW_A_POWER = "a first position one below a power of two"
PAST_MAX_LENGTH = "a first position past max_length"
CROSSES_TABLE_END = "a row fed across the end of the model's rotation table"
ROWS_IN_CODES = "rows of their own held in codes"  # contract, 10.1
# Which path of the model's attended the batch (contract, 8.2).
VARLEN = "a ragged batch attended row by row over its valid slots (varlen)"
ONE_CALL = "a batch with every slot valid attended in one call"

EDGES = (
    reach.Edge(SAME_PROMPTS),
    reach.Edge(PROMPTS_BY_ONE),
    reach.Edge(PROMPTS_BY_MANY),
    reach.Edge(EMPTY_SLOT),
    reach.Edge(FULL_ROW_IDLE),
    *(reach.Edge(name) for name in PADS.values()),
    reach.Edge(ROLLBACK_OF_NONE, needs=("truncate_rows",)),
    reach.Edge(ROLLBACK_OF_ALL, needs=("truncate_rows",)),
    reach.Edge(ROW_LEAVES, needs=("select_rows",)),
    reach.Edge(PERMUTATION, needs=("select_rows",)),
    reach.Edge(JOIN_FIRSTS, needs=("join", "reset_at")),
    reach.Edge(JOIN_LENGTHS, needs=("join",)),
    reach.Edge(RESTART_AFTER_MOVES, needs=("reset_at", "select_rows")),
    reach.Edge(FIRSTS_OF_THEIR_OWN, needs=("reset_at",)),
    reach.Edge(BELOW_A_POWER, needs=("reset_at",)),
    reach.Edge(PAST_MAX_LENGTH, needs=("reset_at",)),
    reach.Edge(CROSSES_TABLE_END, needs=("reset_at",)),
    reach.Edge(ROWS_IN_CODES, needs=("lossy storage",)),
    reach.Edge(VARLEN),
    reach.Edge(ONE_CALL),
)


def note_attention_path(returned) -> None:
    """The model's path through the rows ``append_rows`` last returned (keys, values, valid):
    varlen where some slot is not valid, else one call."""
    if returned is not None and len(returned) == 3:
        reach.note(ONE_CALL if bool(returned[2].all()) else VARLEN)


def note_feed(counts, held: list[int], firsts: list[int], pad: str, most: int) -> None:
    """The edges a feed of ``counts`` ran, the rows holding ``held`` before it (of caches
    built for ``most`` tokens a row)."""
    fed = [count for count in counts if count]
    if not any(held):  # prompts into empty rows
        spread = max(counts) - min(counts)
        reach.note(
            SAME_PROMPTS if not spread else PROMPTS_BY_ONE if spread == 1 else PROMPTS_BY_MANY
        )
    if len(set(counts)) > 1:  # some slot of the call is a pad
        reach.note(PADS[pad])
    if fed and 0 in counts:
        reach.note(EMPTY_SLOT)
    if fed and any(n == most and not c for n, c in zip(held, counts, strict=True)):
        reach.note(FULL_ROW_IDLE)
    spans = zip(firsts, held, counts, strict=True)
    if any(first + n < ROPE_TABLE_POSITIONS <= first + n + c - 1 for first, n, c in spans):
        reach.note(CROSSES_TABLE_END)


def note_rollback(keep, held: list[int]) -> None:
    rolled = [n - k for n, k in zip(held, keep, strict=True)]
    if any(rolled) and 0 in rolled:
        reach.note(ROLLBACK_OF_NONE)
    if any(n and not k for n, k in zip(held, keep, strict=True)):
        reach.note(ROLLBACK_OF_ALL)


def note_selection(kept, rows: int) -> None:
    if len(kept) < rows:
        reach.note(ROW_LEAVES)
    elif tuple(kept) != tuple(range(rows)):
        reach.note(PERMUTATION)


def note_join(joining, *, with_firsts: bool) -> None:
    if len({prompt for prompt, _ in joining}) > 1:
        reach.note(JOIN_LENGTHS)
    if with_firsts and len({first for _, first in joining}) > 1:
        reach.note(JOIN_FIRSTS)


def note_first_positions(firsts) -> None:
    if len(set(firsts)) > 1:
        reach.note(FIRSTS_OF_THEIR_OWN)
    if any(first > 1 and not (first + 1) & first for first in firsts):
        reach.note(BELOW_A_POWER)
    if any(first > MAX_LENGTH for first in firsts):
        reach.note(PAST_MAX_LENGTH)


# The method each event of rows of their own needs beside append_rows.
NEEDS = {
    TruncateRows: "truncate_rows",
    SelectRows: "select_rows",
    Join: "join",
    ResetAt: "reset_at",
}


# --- Every plan within a scope (kvcheck.scope), for the bounded-exhaustive mode ---


def row_counts(tokens: int, batch: int) -> Iterator[tuple[int, ...]]:
    """Every way to give ``batch`` rows ``tokens`` new tokens in one call, a count each (0
    allowed: an idle row, an empty slot): C(tokens + batch - 1, batch - 1), the first row's
    count highest first."""
    if batch == 1:
        yield (tokens,)
        return
    for first in range(tokens, -1, -1):
        for rest in row_counts(tokens - first, batch - 1):
            yield first, *rest


def row_feed_moves(held: tuple[int, ...], left: int):
    """The grammar's moves (``kvcheck.grammar``) of a call feeding rows holding ``held`` 1 to
    ``left`` tokens in all, a count each (``row_counts``): each call, the lengths it leaves
    and the tokens it feeds."""
    for size in range(1, left + 1):
        for counts in row_counts(size, len(held)):
            fed = tuple(n + count for n, count in zip(held, counts, strict=True))
            yield (FeedRows(counts),), fed, size


def row_feeds(tokens: int, batch: int) -> Iterator[tuple[FeedRows, ...]]:
    """Every sequence of calls that feeds ``batch`` rows ``tokens`` tokens in all, each call
    a count per row, one at least not 0: the compositions of ``tokens`` into vectors of
    ``batch`` counts, sum over k calls of sum over j of (-1)^j C(k, j) C(tokens + (k - j)
    batch - 1, (k - j) batch - 1) (the calls with every row idle taken out); for 2 rows 2,
    7, 24, 82, 280, 956 at 1 to 6 tokens (c(n) = 4 c(n-1) - 2 c(n-2)). Depth first."""
    return grammar.sentences(tokens, (0,) * batch, row_feed_moves, lambda _: True)


def every_rows_plan(scope: kvscope.Scope) -> Iterator[RowsPlan]:
    """Every plan of feeds with a count per row (``row_feeds``: prompts of their own, rows
    idle beside rows decoding, chunks) of 1 to ``scope.tokens`` tokens over all rows: fewest
    tokens first, then the scope's layouts (a batch of 1 taken as 2: rows of their own need
    two), c_B(n) plans of n tokens a layout of B rows (``row_feeds``).

    Fixed, and why: the rows start at position 0 (no ``reset_at``: the scope bounds tokens,
    not positions; first positions are the search's), pads of nan (what any read of a pad
    shows first; the other poisons are the search's), and no ``truncate_rows``,
    ``select_rows``, ``join`` or restart events (each multiplies the plans by the lengths or
    rows held: the search draws them)."""
    return every_plan_of_rows(scope, RowsPlan, row_feeds)


def every_plan_of_rows(
    scope: kvscope.Scope,
    plan: type[P],
    sequences: Callable[[int, int], Iterable[tuple]],
    models: Iterable[tuple[kvscope.Layout, ModelConfig]] | None = None,
) -> Iterator[P]:
    """A plan of ``plan``'s kind (a ``RowsPlan``'s fields) for each sequence of events
    ``sequences(tokens, batch)`` of 1 to ``scope.tokens`` tokens, fewest first, on each
    (layout, model) of ``models`` (each layout of the scope on its own model where None), a
    batch of 1 taken as 2 (rows of their own need two); the rows from 0, pads of nan, seed 0."""
    if models is None:
        models = ((layout, layout.config()) for layout in scope.layouts)
    models = list(models)  # walked once per count of tokens
    for tokens in range(1, scope.tokens + 1):
        for layout, config in models:
            batch = max(layout.batch, 2)
            for events in sequences(tokens, batch):
                yield plan(
                    config=config, dtype=scope.dtype, batch=batch, events=events, token_seed=0
                )


# Tried first on every run: rows that start elsewhere than 0, differ in length, roll back by
# their own counts, and a row that leaves and one that joins with decode steps after each
# (a first position dropped by select_rows needs both, which a search of 20 rarely draws).
PINNED = (
    RowsPlan(
        config=ModelConfig(vocab_size=23, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8),
        dtype=torch.float64,
        batch=3,
        events=(
            FeedRows((5, 2, 7)),
            FeedRows((1, 0, 1)),
            SelectRows((0, 2)),
            FeedRows((1, 1)),
            TruncateRows((4, 8)),
            Join(((3, 4096),)),
            FeedRows((1, 1, 1)),
        ),
        token_seed=11,
        firsts=(255, 1025, 8191),
        pad="inf",
    ),
    # Every row stays, reordered by a 3-cycle (its inverse differs, and so does the
    # identity); two rows leave and a request of two rows with first positions and lengths
    # of their own joins; then a restart on the moved rows, and rollbacks of 0, of some and
    # of a whole row.
    RowsPlan(
        config=ModelConfig(vocab_size=29, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8),
        dtype=torch.float64,
        batch=3,
        events=(
            FeedRows((6, 2, 4)),
            SelectRows((2, 0, 1)),
            FeedRows((1, 1, 1)),
            SelectRows((1,)),
            Join(((3, 255), (5, 8190))),
            FeedRows((1, 1, 1)),
            ResetAt((1, 49, 4096)),
            FeedRows((2, 2, 3)),
            TruncateRows((2, 0, 1)),
            FeedRows((1, 1, 1)),
        ),
        token_seed=5,
        firsts=(4095, 48, 1023),
        pad="nan",
    ),
    # A row full at max_length sits idle while its neighbour decodes (capacity is per row),
    # then keeps all of its rows while its neighbour rolls back all of its own; the two swap
    # places and restart elsewhere than 0; in bfloat16, head_dim 64 and batch 2, inside the
    # tightest domains the built-ins declare.
    RowsPlan(
        config=ModelConfig(vocab_size=17, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=64),
        dtype=torch.bfloat16,
        batch=2,
        events=(
            FeedRows((MAX_LENGTH, 3)),
            FeedRows((0, 1)),
            TruncateRows((MAX_LENGTH, 0)),
            FeedRows((0, 2)),
            SelectRows((1, 0)),
            FeedRows((1, 0)),
            ResetAt((8191, 49)),
            FeedRows((3, 1)),
        ),
        token_seed=3,
        pad="-inf",
    ),
    # Pads of the one poison the plans above leave out, in as short a plan as has pads.
    RowsPlan(
        config=ModelConfig(vocab_size=17, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=64),
        dtype=torch.bfloat16,
        batch=2,
        events=(FeedRows((2, 1)), FeedRows((1, 0))),
        token_seed=7,
        pad="huge",
    ),
)

MIXED_LENGTHS = Property(
    "mixed lengths",
    "each row of a batch whose rows bring different numbers of tokens, roll back by their "
    "own counts, leave and join equals that row alone",
    check_mixed_lengths,
    rows_plans(),
    failures.WRONG_RESULTS,
    requires=("append_rows",),
    min_batch=2,
    pinned=PINNED,
    since="1.2",
    reaches=EDGES,
    every_plan=every_rows_plan,
    exhaustive_tokens=6,
    holds=(
        "a batch whose rows bring their own counts of new tokens (0 too; prompts that differ by 0, "
        "1 and many), roll back by their own counts, leave and join, from first positions of their "
        "own (`reset_at`, where offered): each row's logits, and the rows `append_rows` marks "
        "valid, equal the uncached model on that row alone, at batch 1, at its positions (contract,"
        " section 8; where `append_rows` is offered)"
    ),
)


class RowsTests(KitTests):
    """Rows of their own in one batched cache (``append_rows``): run when offered."""

    test_each_row_of_a_mixed_batch_equals_that_row_alone = property_test(MIXED_LENGTHS)
