"""Engines under the kit: the model, not the layer, is the unit (contract, section 13).

``EngineTests`` is what a user subclasses for an engine whose cache the kit cannot reach
layer by layer (llama.cpp behind ``llama_decode``, a generation loop)::

    from kvcheck.engines import EngineTests
    from mypkg.adapter import engine   # an EngineFactory: (model, EngineSpec) -> engine

    class TestMyEngine(EngineTests):
        engine = engine

Each property draws a plan (``EnginePlan``): a tiny model (the reference transformer the
factory converts into the engine's own weights) and the events to drive it through. Events
are the engine's own calls: ``Decode`` a batch of several sequences' tokens, each at its own
positions; ``Remove`` a span, ``Copy`` a sequence into another, ``Shift`` a span's
positions, ``Clear``. After every decode each returned logit row is held to the one oracle:
the reference model over a trusted cache of that sequence's own, whose rows the events
remove, copy and shift (``kvcheck.engine_books.CacheBooks``), in float64, at the tolerance of
the dtype the engine computes in. A ``Mirror`` follows the positions each
sequence holds, for the draws, the messages and the edges noted (``EdgeNotes``).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from hypothesis import strategies as st

from kvcheck import asserts as kvassert
from kvcheck import engine_interplay, exhaustive, failures, reach
from kvcheck import sizes as kvsizes
from kvcheck.engine_books import CacheBooks
from kvcheck.engine_events import (
    OPERATION,
    REMOVALS,
    SPAN_EDGES,
    Clear,
    Copy,
    Decode,
    EnginePlan,
    Feed,
    Held,
    Mirror,
    Remove,
    Shift,
    describe_held,
    span_removed,
)
from kvcheck.kit import NOT_OFFERED, Property, search
from kvcheck.scope import Layout, Scope, first_use_order
from kvref import ModelConfig, ReferenceTransformer
from kvref.engine import (
    ENGINE_OPERATIONS,
    EngineFactory,
    EngineSpec,
    Step,
    engine_capabilities,
    logits_of,
)

# --- running a plan --------------------------------------------------------------------


def run_plan(factory: EngineFactory, plan: EnginePlan, spec: EngineSpec, dtype) -> None:
    """Build the engine from ``plan``'s model and drive it through the plan's events,
    holding every decode's logits to the books' (``CacheBooks``)."""
    truth = ReferenceTransformer(plan.config, dtype=torch.float64)
    engine = factory(truth, spec)
    mirror = Mirror(spec.sequences)
    books = CacheBooks(truth, spec.sequences)  # what a KV cache holds (kvcheck.engine_books)
    edges, pairs = EdgeNotes(), engine_interplay.PairNotes(spec.sequences)
    for index, event in enumerate(plan.events):
        where = f"event {index + 1} of {len(plan.events)}, {event.describe()}"
        edges.before(event, mirror)
        pairs.before(event, [held.positions for held in mirror.held])
        if isinstance(event, Decode):
            steps = []
            for feed in event.feeds:
                positions = tuple(range(feed.first, feed.first + feed.count))
                steps.append(Step(feed.sequence, tuple(plan.tokens(index, feed)), positions))
            returned = engine.decode(steps)
            if not isinstance(returned, list | tuple) or len(returned) != len(steps):
                raise failures.WrongResults(
                    f"decode returned {type(returned).__name__} of "
                    f"{len(returned) if hasattr(returned, '__len__') else '?'} for "
                    f"{len(steps)} steps, at {where}"
                )
            for step, logits in zip(steps, returned, strict=True):
                got = logits_of(logits, step, plan.config.vocab_size)
                held = mirror.held[step.sequence]
                expected = books.decode(step)
                kvassert.assert_close_at(
                    got.to(dtype),
                    expected.to(dtype),
                    what="the engine's and the reference's logits",
                    where=f"{where}: sequence {step.sequence}, holding "
                    f"{describe_held(held)} before",
                    position_axis=0,
                    first_position=step.positions[0],
                )
                held.positions.extend(step.positions)
        elif isinstance(event, Clear):
            engine.clear()
            books.clear()
        else:
            operation = getattr(engine, OPERATION[type(event)])
            operation(*dataclasses.astuple(event))
            getattr(books, OPERATION[type(event)])(*dataclasses.astuple(event))
        mirror.apply(event)
        pairs.after([held.positions for held in mirror.held])


class EdgeNotes:
    """Notes the edges (``EDGES``) each event reaches, from what the sequences hold just
    before it runs, and what came before in the plan."""

    def __init__(self) -> None:
        self.sharing: set[int] = set()  # sequences in a copy, since the last clear
        self.emptied: set[int] = set()  # emptied by a remove
        self.cleared: set[int] = set()  # held tokens when the last clear came
        self.prefilled: set[int] = set()  # began with several tokens
        self.last: object = None
        self.operated = False  # a memory operation ran

    def before(self, event: object, mirror: Mirror) -> None:
        held = [h.positions for h in mirror.held]
        if isinstance(event, Decode):
            self._decode(event, held)
        elif isinstance(event, Remove):
            self._remove(event, held[event.sequence])
        elif isinstance(event, Copy):
            if event.target in self.emptied:
                reach.note("a copy into a sequence emptied by remove")
            self.sharing |= {event.source, event.target}
        elif isinstance(event, Shift):
            last = self.last
            if isinstance(last, Remove) and last.sequence == event.sequence and event.delta < 0:
                reach.note("a context shift")
                if last.end is not None and -event.delta > last.end - last.start:
                    reach.note("a context shift closing an earlier gap")
            elif event.end is not None:
                if event.end in held[event.sequence]:  # the token the span stops before
                    reach.note("a span moved on within a gap, a token held at its end")
            elif event.delta > 0:
                reach.note("a suffix moved on")
            if event.sequence in self.sharing:
                reach.note("a shift of a sequence that shares a copy")
        else:
            if self.operated:
                reach.note("a clear between other operations")
            self.cleared = {s for s, positions in enumerate(held) if positions}
            self.sharing = set()
        self.operated |= not isinstance(event, Decode | Clear)
        self.last = event

    def _decode(self, event: Decode, held: list[list[int]]) -> None:
        fed = {feed.sequence for feed in event.feeds}
        if len(fed) >= 3:
            reach.note("a batch of 3 sequences")
        if len({feed.count for feed in event.feeds}) > 1:
            reach.note("a batch of sequences with counts of their own")
        for feed in event.feeds:
            positions = held[feed.sequence]
            if feed.sequence:
                reach.note("a sequence other than 0")
            if not positions:
                if feed.first:
                    reach.note("a first position other than 0")
                if any(held):
                    reach.note("a sequence joining a later batch")
                if feed.sequence in self.cleared:
                    reach.note("a sequence fed again after clear")
                if feed.count > 1:
                    self.prefilled.add(feed.sequence)
            elif feed.count == 1 and feed.sequence in self.prefilled:
                reach.note("a prefill, then single-token steps")
            if positions and positions[-1] - positions[0] + 1 > len(positions):
                reach.note("a sequence fed after a gap")
            if feed.sequence in self.sharing:
                partners = self.sharing - {feed.sequence}
                reach.note(
                    "a copy and its source in one batch"
                    if partners & fed
                    else "a copy fed apart from its source"
                )

    def _remove(self, event: Remove, positions: list[int]) -> None:
        if event.sequence in self.sharing:
            reach.note("a remove of a sequence that shares a copy")
        if not positions:
            return
        span = span_removed(event, positions)
        reach.note(SPAN_EDGES[span])
        if span == "whole":
            self.emptied.add(event.sequence)
            self.sharing.discard(event.sequence)


# --- the draws -------------------------------------------------------------------------


@dataclass(frozen=True)
class Drawing:
    """What a test class lets the draws use (its class attributes)."""

    spec: EngineSpec
    head_dims: tuple[int, ...]
    ffn: str
    start_anywhere: bool  # an empty sequence may start at any position, not 0 alone
    # The operations offered, and "remove <span>" for each of REMOVALS the engine takes.
    offered: frozenset[str]

    def removes(self, span: str) -> bool:
        return f"remove {span}" in self.offered


@st.composite
def model_configs(draw, drawing: Drawing) -> ModelConfig:
    kv_heads = draw(st.integers(1, 2), label="kv_heads")
    return ModelConfig(
        vocab_size=draw(st.sampled_from((16, 32)), label="vocab_size"),
        num_layers=draw(st.integers(1, 2), label="num_layers"),
        num_heads=kv_heads * draw(st.integers(1, 2), label="queries per kv head"),
        num_kv_heads=kv_heads,
        head_dim=draw(st.sampled_from(drawing.head_dims), label="head_dim"),
        ffn_dim=draw(st.sampled_from((8, 16)), label="ffn_dim"),
        seed=draw(st.integers(0, 2**16), label="model seed"),
        ffn=drawing.ffn,
    )


class Planner:
    """Draws events one by one, keeping the positions each sequence holds, so that every
    event is valid where it is drawn (and every shrunk plan redrawn so)."""

    def __init__(self, draw, drawing: Drawing) -> None:
        self.draw, self.drawing = draw, drawing
        self.mirror = Mirror(drawing.spec.sequences)
        self.events: list = []

    @property
    def positions(self) -> list[list[int]]:
        return [held.positions for held in self.mirror.held]

    def room(self, sequence: int) -> int:
        return self.drawing.spec.max_tokens - len(self.positions[sequence])

    def decode(self, sequences: list[int], most: int | None = None) -> None:
        feeds, budget = [], self.drawing.spec.max_batch
        for sequence in sequences:
            top = min(self.room(sequence), budget, most or budget)
            if top < 1:
                continue
            count = self.draw(st.integers(1, top), label="tokens fed")
            held = self.positions[sequence]
            if held:
                first = held[-1] + 1
            elif self.drawing.start_anywhere:
                first = self.draw(st.sampled_from((0, 0, 1, 7, 40)), label="first position")
            else:
                first = 0
            feeds.append(Feed(sequence, first, count))
            self.mirror.held[sequence].positions.extend(range(first, first + count))
            budget -= count
        if feeds:
            self.events.append(Decode(tuple(feeds)))

    def chunks(self, sequence: int, at_least: int = 1) -> None:
        """A prefill and some decode steps of one sequence."""
        for chunk in range(self.draw(st.integers(at_least, 3), label="chunks")):
            # After the prefill, often one token at a time, as decoding goes.
            one = chunk and self.draw(st.booleans(), label="one token")
            self.decode([sequence], most=1 if one else None)

    def some_sequences(self, least: int = 1) -> list[int]:
        count = self.drawing.spec.sequences
        chosen = self.draw(
            st.lists(
                st.integers(0, count - 1), min_size=min(least, count), max_size=count, unique=True
            ),
            label="sequences",
        )
        return chosen

    def held(self) -> list[int]:
        return [s for s, held in enumerate(self.positions) if held]

    def remove(self, sequence: int) -> None:
        held = self.positions[sequence]
        spans = [span for span in REMOVALS if self.drawing.removes(span)]
        kind = self.draw(st.sampled_from(spans), label="removed")
        n = len(held)
        if kind == "middle" and n >= 3:  # tokens kept on both sides: a gap left
            low = self.draw(st.integers(1, n - 2), label="span from")
            high = self.draw(st.integers(low, n - 2), label="span to")
            event = Remove(sequence, held[low], held[high] + 1)
        elif kind == "head" and n >= 2:
            event = Remove(sequence, 0, held[self.draw(st.integers(0, n - 2), label="to")] + 1)
        elif kind == "whole":
            event = Remove(sequence, 0, None)
        elif kind == "past the end":
            event = Remove(sequence, held[-1] + 1, None)
        elif kind == "tail" or "tail" in spans:  # a tail, from any token on
            event = Remove(sequence, held[self.draw(st.integers(0, n - 1), label="from")], None)
        else:  # too short for the span drawn, and no tail taken instead
            return
        self.add(event)

    def copy(self, source: int) -> None:
        """``source`` copied into an empty sequence, where one is (``make_room``)."""
        empty = [s for s, held in enumerate(self.positions) if not held]
        if empty:
            self.add(Copy(source, self.draw(st.sampled_from(empty), label="copied to")))

    def make_room(self, keep: int) -> None:
        """Where every sequence holds tokens, one other than ``keep`` removed whole."""
        if self.drawing.removes("whole") and all(self.positions) and len(self.positions) > 1:
            others = [s for s in range(len(self.positions)) if s != keep]
            self.add(Remove(self.draw(st.sampled_from(others), label="emptied"), 0, None))

    def shift(self, sequence: int) -> None:
        """A context shift where remove is offered (a span dropped, what follows moved back
        over it), a suffix moved on, opening a gap, or where the sequence has a gap, a span
        before it moved on within it (an explicit ``end``, a token held at it)."""
        held = self.positions[sequence]
        n = len(held)
        ways = ["moved on"]
        if self.drawing.removes("middle") and n > (1 if self.drawing.removes("head") else 2):
            ways.insert(0, "context shift")
        if n >= 2:
            ways.append("span within a gap")
        way = self.draw(st.sampled_from(ways), label="shift") if len(ways) > 1 else ways[0]
        if way == "span within a gap":
            after_gaps = [at for at in range(1, n) if held[at] > held[at - 1] + 1]
            if not after_gaps:  # a suffix moved on first opens one
                at = self.draw(st.integers(1, n - 1), label="gap opened before")
                delta = self.draw(st.sampled_from((1, 3, 16)), label="opened by")
                self.add(Shift(sequence, held[at], None, delta))
                held, after_gaps = self.positions[sequence], [at]
            # The span [start, end) ends at a token held (it must not move), its tokens moved
            # on by 1 or by the whole gap: what follows keeps its place, the order kept.
            at = self.draw(st.sampled_from(after_gaps), label="the gap after the span")
            low = self.draw(st.integers(0, at - 1), label="span from")
            gap = held[at] - held[at - 1] - 1
            delta = self.draw(st.sampled_from(sorted({1, gap})), label="moved on by")
            self.add(Shift(sequence, held[low], held[at], delta))
            return
        if way == "context shift":
            # The span dropped: from the head too where the engine removes heads.
            lowest = 0 if self.drawing.removes("head") else 1
            low = self.draw(st.integers(lowest, n - 2), label="dropped from")
            high = self.draw(st.integers(low, n - 2), label="dropped to")
            start, end = held[low], held[high] + 1
            self.add(Remove(sequence, start, end))
            gap_before = start - (held[low - 1] + 1) if low else start
            closed = self.draw(
                st.sampled_from(list(dict.fromkeys((gap_before, 0)))), label="gap closed"
            )
            self.add(Shift(sequence, end, None, -(end - start) - closed))
            return
        at = self.draw(st.integers(0, n - 1), label="moved from")
        delta = self.draw(st.sampled_from((1, 3, 16)), label="moved on by")
        self.add(Shift(sequence, held[at], None, delta))

    def add(self, event: object) -> None:
        self.events.append(event)
        self.mirror.apply(event)


def plans(focus: str, drawing: Drawing) -> st.SearchStrategy[EnginePlan]:
    """Plans for the property ``focus``: its event, amid decodes before and after."""

    @st.composite
    def plan(draw) -> EnginePlan:
        p = Planner(draw, drawing)
        if focus == "decode":
            p.chunks(draw(st.integers(0, drawing.spec.sequences - 1), label="sequence"))
        elif focus == "sequences":
            for _ in range(draw(st.integers(1, 3), label="batches")):
                p.decode(p.some_sequences(least=2))
        elif focus == "clear":
            p.decode(p.some_sequences())
            p.add(Clear())
            p.decode(p.some_sequences())
        else:
            for _ in range(draw(st.integers(1, 2), label="rounds") if focus != "mixed" else 1):
                p.decode(p.some_sequences())
                if focus == "mixed":
                    mix(draw, p)
                    continue
                sequence = draw(st.sampled_from(p.held()), label="its sequence")
                if focus == "remove":
                    p.remove(sequence)
                elif focus == "copy":
                    p.make_room(sequence)
                    p.copy(sequence)
                    if "remove" in drawing.offered and draw(st.booleans(), label="then removed"):
                        p.decode(p.some_sequences())
                        p.remove(draw(st.sampled_from(p.held()), label="removed from"))
                elif focus == "shift":
                    if "copy" in drawing.offered and draw(st.booleans(), label="copied first"):
                        p.make_room(sequence)  # a copy sharing what the shift moves
                        p.copy(sequence)
                        sequence = draw(st.sampled_from(p.held()), label="shifted")
                    p.shift(sequence)
                p.decode(p.some_sequences())
        seed = draw(st.integers(0, 2**16), label="token seed")
        return EnginePlan(draw(model_configs(drawing)), tuple(p.events), seed)

    return plan()


def mix(draw, p: Planner) -> None:
    """Some events of every kind the engine offers, each followed by a decode."""
    kinds = ["decode", "clear", *(op for op in ENGINE_OPERATIONS if op in p.drawing.offered)]
    for _ in range(draw(st.integers(1, 5), label="events")):
        kind = draw(st.sampled_from(kinds), label="event")
        held = p.held()
        if kind == "clear":
            p.add(Clear())
        elif kind != "decode" and held:
            sequence = draw(st.sampled_from(held), label="its sequence")
            if kind == "remove":
                p.remove(sequence)
            elif kind == "copy":
                p.make_room(sequence)
                p.copy(sequence)
            else:
                p.shift(sequence)
        p.decode(p.some_sequences())


# --- every plan within a scope (the bounded-exhaustive mode) ---------------------------

# The first positions an empty sequence may start at where the engine takes any
# (``Drawing.start_anywhere``): 0, and 1, the nearest other (an engine that numbers a step's
# tokens by how many its sequence holds instead of reading them is off by it). The draws'
# 7 and 40 add nothing a few tokens can tell: only the gap they leave counts.
EVERY_START = (0, 1)
# The deltas a suffix is moved on by (``Shift`` to the end): 1, the nearest (a gap of one),
# and 16, past every position a few tokens hold (a rotation far from the old one). Moved
# back, a suffix closes the gap before it exactly (the farthest it may go and stay after
# what it follows); a context shift moves it back over the span removed, or over that span
# and the gap before it too (the draws' own two: ``Planner.shift``). A span with an end
# moves on within the gap after it (passing no neighbour), by 1 and by the whole gap.
EVERY_DELTA = (1, 16)
# The memory operations of "engine mixed" between its decodes, at most: the draws' up to 5
# events, of which decodes are some, bounded so that its plans stay in the thousands at 6
# tokens (each operation multiplies them by every sequence, span and position).
MIXED_OPERATIONS = 2


@dataclass(frozen=True)
class _Partial:
    """A plan being built: what each sequence holds, the events so far, the sequence ids
    they name in order (for the first-use collapse) and the tokens still to feed."""

    held: tuple[tuple[int, ...], ...]
    events: tuple
    labels: tuple[int, ...]
    left: int

    def then(self, event: object, *labels: int) -> _Partial | None:
        """This plan and ``event`` (naming ``labels``), or None where its ids do not come in
        first-use order (another plan, the same up to renaming ids, stands for it)."""
        if not first_use_order(self.labels + labels):
            return None
        mirror = Mirror(0)
        mirror.held = [Held(list(positions)) for positions in self.held]
        fed = 0
        if isinstance(event, Decode):
            for feed in event.feeds:
                mirror.held[feed.sequence].positions.extend(
                    range(feed.first, feed.first + feed.count)
                )
                fed += feed.count
        else:
            mirror.apply(event)
        held = tuple(tuple(h.positions) for h in mirror.held)
        return _Partial(held, (*self.events, event), self.labels + labels, self.left - fed)


class _Every:
    """Every event of each kind a ``Drawing`` offers after a partial plan, and the phases
    (runs of decodes, an operation) a focus's plans are made of."""

    def __init__(self, drawing: Drawing, sequences: int) -> None:
        self.drawing, self.sequences = drawing, sequences
        self.starts = EVERY_START if drawing.start_anywhere else (0,)

    # -- decodes --

    def batches(self, p: _Partial, least: int, most: int) -> Iterator[_Partial]:
        """Every batch of ``least`` to ``most`` sequences, in every order, each fed 1 or more
        tokens (within the batch's and each sequence's room), each empty one from every
        start."""
        spec = self.drawing.spec
        budget = min(p.left, spec.max_batch)
        for size in range(least, most + 1):
            for order in itertools.permutations(range(self.sequences), size):
                if not first_use_order(p.labels + order):
                    continue
                rooms = [min(spec.max_tokens - len(p.held[s]), budget) for s in order]
                for counts in itertools.product(*(range(1, room + 1) for room in rooms)):
                    if sum(counts) > budget:
                        continue
                    firsts = [(p.held[s][-1] + 1,) if p.held[s] else self.starts for s in order]
                    for first in itertools.product(*firsts):
                        feeds = tuple(map(Feed, order, first, counts))
                        yield p.then(Decode(feeds), *order)

    def runs(self, p: _Partial, least: int = 1, most: int | None = None) -> Iterator[_Partial]:
        """One or more batches in a row (every split of each sequence's feeds)."""
        most = self.sequences if most is None else most
        for q in self.batches(p, min(least, self.sequences), most):
            if q is not None:
                yield q
                yield from self.runs(q, least, most)

    # -- the operations --

    def held(self, p: _Partial) -> list[int]:
        return [s for s, positions in enumerate(p.held) if positions]

    def removes(self, p: _Partial) -> Iterator[_Partial]:
        """Every span of each kind offered, at every position, of every sequence holding
        tokens (one event where two kinds give the same span)."""
        for sequence in self.held(p):
            for event in dict.fromkeys(self.spans(sequence, p.held[sequence])):
                yield p.then(event, sequence)

    def spans(self, sequence: int, held: tuple[int, ...]) -> Iterator[Remove]:
        n, offers = len(held), self.drawing.removes
        if offers("middle"):  # tokens kept on both sides
            for low in range(1, n - 1):
                for high in range(low, n - 1):
                    yield Remove(sequence, held[low], held[high] + 1)
        if offers("head"):
            for high in range(n - 1):
                yield Remove(sequence, 0, held[high] + 1)
        if offers("tail"):
            for low in range(n):
                yield Remove(sequence, held[low], None)
        if offers("whole"):
            yield Remove(sequence, 0, None)
        if offers("past the end"):
            yield Remove(sequence, held[-1] + 1, None)

    def copies(self, p: _Partial) -> Iterator[_Partial]:
        """Every held sequence copied into every empty one; where none is empty, another
        removed whole first (``Planner.make_room``), where the engine removes whole ones."""
        for source in self.held(p):
            rooms = [p]
            if all(p.held) and self.drawing.removes("whole"):
                rooms = [
                    p.then(Remove(other, 0, None), other)
                    for other in range(self.sequences)
                    if other != source
                ]
            for q in filter(None, rooms):
                for target, positions in enumerate(q.held):
                    if not positions:
                        yield q.then(Copy(source, target), source, target)

    def shifts(self, p: _Partial) -> Iterator[_Partial]:
        """Every shift of every held sequence: a context shift at every span (a span removed,
        what follows moved back over it, or over it and the gap before it) where remove
        takes middle spans; every suffix moved on by each of ``EVERY_DELTA``; every suffix
        after a gap moved back to close it; every span before a gap moved on within it (an
        explicit end, a token held there), by one and by the whole gap."""
        for sequence in self.held(p):
            held, n = p.held[sequence], len(p.held[sequence])
            if self.drawing.removes("middle"):
                lowest = 0 if self.drawing.removes("head") else 1
                for low in range(lowest, n - 1):
                    for high in range(low, n - 1):
                        start, end = held[low], held[high] + 1
                        q = p.then(Remove(sequence, start, end), sequence)
                        gap_before = start - (held[low - 1] + 1) if low else start
                        for closed in dict.fromkeys((gap_before, 0)):
                            yield q.then(Shift(sequence, end, None, start - end - closed), sequence)
            for at in range(n):
                for delta in EVERY_DELTA:
                    yield p.then(Shift(sequence, held[at], None, delta), sequence)
                gap = held[at] - (held[at - 1] + 1) if at else held[at]
                if gap:
                    yield p.then(Shift(sequence, held[at], None, -gap), sequence)
                if gap and at:  # every span before the gap moved on within it, by 1 or all
                    for low in range(at):
                        for delta in sorted({1, gap}):
                            yield p.then(Shift(sequence, held[low], held[at], delta), sequence)

    def clears(self, p: _Partial) -> Iterator[_Partial]:
        yield p.then(Clear())

    def operations(self, p: _Partial) -> Iterator[_Partial]:
        """Every event of every operation offered, and clear (``mix``)."""
        yield from self.clears(p)
        kinds = {"remove": self.removes, "copy": self.copies, "shift": self.shifts}
        for name in ENGINE_OPERATIONS:
            if name in self.drawing.offered:
                yield from kinds[name](p)

    # -- the focuses --

    def batch(self, p: _Partial) -> Iterator[_Partial]:
        """One batch of any of the sequences (``Planner.decode(some_sequences())``)."""
        return self.batches(p, 1, self.sequences)

    def plans(self, focus: str, p: _Partial) -> Iterator[_Partial]:
        """Every plan of ``focus`` from ``p``, in the shapes ``plans`` draws
        (``every_engine_plan``'s docstring)."""
        offered, batch = self.drawing.offered, self.batch
        if focus == "decode":
            return self.runs(p, 1, 1)
        if focus == "sequences":
            return self.runs(p, 2)
        if focus == "clear":
            return chain(p, batch, self.clears, batch)
        if focus == "mixed":  # up to MIXED_OPERATIONS rounds, each once (not a 2nd alone)
            rounds = optional(self.operations, batch)
            for _ in range(MIXED_OPERATIONS - 1):
                rounds = optional(self.operations, batch, rounds)
            return chain(p, batch, rounds)
        if focus == "remove":
            middle: tuple[Phase, ...] = (self.removes,)
        elif focus == "copy":
            removed = (optional(batch, self.removes),) if "remove" in offered else ()
            middle = (self.copies, *removed)
        elif focus == "shift":
            copied = (optional(self.copies),) if "copy" in offered else ()
            middle = (*copied, self.shifts)
        else:
            raise ValueError(f"no engine property of focus {focus!r}")
        # One round, or two (the draws' ``rounds``): a batch, the focus's events, a batch.
        return chain(p, batch, *middle, batch, optional(batch, *middle, batch))


Phase = Callable[[_Partial], Iterator[_Partial | None]]


def chain(p: _Partial | None, *phases: Phase) -> Iterator[_Partial]:
    """Every plan made of ``p`` and then an outcome of each phase in turn."""
    if p is None or p.left < 0:
        return
    if not phases:
        yield p
        return
    for q in phases[0](p):
        yield from chain(q, *phases[1:])


def optional(*phases: Phase) -> Phase:
    """A phase that is ``phases`` in turn, or nothing."""

    def phase(p: _Partial) -> Iterator[_Partial]:
        yield p
        yield from chain(p, *phases)

    return phase


def engine_layouts(drawing: Drawing, scope: Scope) -> dict[ModelConfig, Layout]:
    """The models of an exhaustive engine run, each with a layout of it: each layout's
    layers, heads and kv heads, the drawing's smallest head width and its feed-forward
    block, the scope's fixed weights. A layout's window and batch are not the engine
    level's (an engine runs Llama's global attention, and batches sequences, not rows), so
    two layouts that differ in them alone give one model."""
    plain: dict[ModelConfig, Layout] = {}
    for layout in scope.layouts:
        moved = dataclasses.replace(layout, window=None, head_dim=min(drawing.head_dims), batch=1)
        plain.setdefault(moved.config(ffn=drawing.ffn), moved)
    return plain


def engine_scope(drawing: Drawing, tokens: int, dtype: torch.dtype) -> Scope:
    """The scope of an exhaustive engine run to ``tokens`` tokens: its models'
    (``engine_layouts``) once each, in the dtype the engine computes in, so that the
    verdict counts the models that ran."""
    layouts = engine_layouts(drawing, Scope(tokens)).values()
    return Scope(tokens, layouts=tuple(layouts), dtype=dtype)


def engine_models(drawing: Drawing, scope: Scope) -> list[ModelConfig]:
    """The models of an exhaustive engine run within ``scope`` (``engine_layouts``)."""
    return list(engine_layouts(drawing, scope))


def every_engine_plan(focus: str, drawing: Drawing, scope: Scope) -> Iterator[EnginePlan]:
    """Every plan of the engine property ``focus`` (its name less "engine ") that feeds at
    most ``scope.tokens`` tokens in all, fewest first, then by model (``engine_models``),
    then by shape; token seed 0. The plans are those ``plans`` draws, every choice of its
    taken in turn (``_Every``), each plan once:

    - decode: one sequence fed in every split of its tokens (a prefill, then chunks);
    - sequences: a run of batches of 2 or more sequences each;
    - clear: a run of batches, ``Clear``, a run of batches;
    - remove: a run of batches, a removal, a run of batches, and maybe a second removal and
      run of batches (the draws' two rounds);
    - copy: a run of batches, a copy (a sequence removed whole first where none is empty),
      a run of batches, and where remove is offered maybe a removal and a run of batches;
    - shift: a run of batches, where copy is offered maybe a copy, a shift, a run of batches;
    - mixed: a run of batches, then up to ``MIXED_OPERATIONS`` times an operation offered or
      a clear followed by a run of batches.

    A run of batches is one or more decodes, each batch every choice of its sequences, their
    order in it, their counts (within ``max_batch`` and each sequence's ``max_tokens``) and
    the start of each empty one (``EVERY_START``); a removal is every span kind offered at
    every position of every sequence holding tokens; a copy every held source into every
    empty target; a shift every one of ``_Every.shifts`` (``EVERY_DELTA``).

    Sequences: at most ``min(drawing.spec.sequences, scope.requests + 1)``: the scope's
    requests, live at once, and one more, empty, for a copy to go into (and the third of
    a batch of 3). Sequence ids are collapsed by first use (``first_use_order``): an engine
    keeps sequences apart by id alone, so a plan and the same plan with its ids renamed
    cannot be told apart by a correct engine; the first sequence a plan names is 0, the
    next new one 1, and so on. (An engine that treats one id unlike another, e.g. the last,
    is outside this collapse: docs/exhaustive.md.)

    The count has no closed form but for decode: ``len(EVERY_START) x (2^N - 1)`` per model
    where the engine starts anywhere, ``2^N - 1`` where at 0 alone (a feed of each
    composition of 1 to N tokens), which tests/test_engine_exhaustive.py holds, with the
    others' counts as measured (docs/exhaustive.md)."""
    if focus in ENGINE_OPERATIONS and focus not in drawing.offered:
        return  # not offered: the property is skipped, as its test is
    # One sequence for decode (its plans are one sequence's, the first named: 0).
    sequences = 1 if focus == "decode" else min(drawing.spec.sequences, scope.requests + 1)
    every = _Every(drawing, sequences)
    models = engine_models(drawing, scope)
    empty = tuple(() for _ in range(sequences))
    for tokens in range(1, scope.tokens + 1):
        for config in models:
            start = _Partial(empty, (), (), tokens)
            for plan in every.plans(focus, start):
                if plan is not None and plan.left == 0:
                    yield EnginePlan(config, plan.events, 0)


@dataclass(frozen=True)
class EnginePlans:
    """``every_engine_plan`` of one focus and ``Drawing``, as a property's ``every_plan``
    (a function of the scope alone, ``kvcheck.exhaustive``): a value, so that the plans of
    one test class are enumerated once per process whichever block asks."""

    focus: str
    drawing: Drawing

    def __call__(self, scope: Scope) -> Iterator[EnginePlan]:
        return every_engine_plan(self.focus, self.drawing, scope)

    def of(self, prop: Property) -> Property:
        """``prop`` enumerating these plans (its ``every_plan``)."""
        return dataclasses.replace(prop, every_plan=self)


# The tokens the bounded-exhaustive mode enumerates each property to by default
# (``--kv-exhaustive auto``): 14,307 plans in all, a minute on 2 cores against the
# built-in cell engine (docs/exhaustive.md). clear and remove go to 4: a clear that misses the
# last sequence needs three sequences fed before it and one after, a slot search that trusts
# ``head`` a removal and three feeds (tests/test_engine_exhaustive.py measures which mutant
# each enumeration catches). shift's 4 would be 130,275 plans, mixed's 3 10,347.
EXHAUSTIVE_TOKENS = {
    "engine decode": 6,
    "engine sequences": 4,
    "engine clear": 4,
    "engine remove": 4,
    "engine copy": 3,
    "engine shift": 3,
    "engine mixed": 2,
}


# --- the properties --------------------------------------------------------------------

E = reach.Edge
# What each property's plans must reach (kvcheck.reach), noted by ``note_edges`` as they run.
EDGES = {
    "engine decode": (
        E("a sequence other than 0"),
        E("a first position other than 0"),
        E("a prefill, then single-token steps"),
    ),
    "engine sequences": (
        E("a batch of 3 sequences"),
        E("a batch of sequences with counts of their own"),
        E("a sequence joining a later batch"),
    ),
    "engine clear": (E("a sequence fed again after clear"),),
    "engine remove": (
        E("a tail removed", needs=("remove tail",)),
        E("a middle span removed (a gap left)", needs=("remove middle",)),
        E("the head removed", needs=("remove head",)),
        E("a whole sequence removed", needs=("remove whole",)),
        E("a span past the end removed", needs=("remove past the end",)),
        E("a sequence fed after a gap", needs=("remove middle",)),
    ),
    "engine copy": (
        E("a copy fed apart from its source"),
        E("a copy and its source in one batch"),
        E("a copy into a sequence emptied by remove", needs=("remove whole",)),
        E("a remove of a sequence that shares a copy", needs=("remove",)),
    ),
    "engine shift": (
        E("a context shift", needs=("remove middle",)),
        E("a context shift closing an earlier gap", needs=("remove middle",)),
        E("a suffix moved on"),
        E("a span moved on within a gap, a token held at its end"),
        E("a shift of a sequence that shares a copy", needs=("copy",)),
    ),
    "engine mixed": (E("a clear between other operations", needs=("remove",)),),
    "engine interactions": (),  # its pairs are its reach (kvcheck.engine_interplay)
}
del E
TITLES = {
    "engine decode": "a prefill and decode steps of one sequence match the uncached model",
    "engine sequences": "sequences batched together each match themselves alone",
    "engine clear": "after clear(), sequences start afresh",
    "engine remove": "after remove(), a sequence matches what it still holds",
    "engine copy": "a copied sequence and its source go on apart",
    "engine shift": "after shift(), keys attend from their new positions",
    "engine mixed": "every operation offered, in any order",
    "engine interactions": "every pair of calls the engine offers, on one sequence, runs as "
    "the uncached model does",
}
# What each holds, in full, for its row of docs/properties.md (kvcheck.catalogue).
HOLDS = {
    "engine decode": (
        "one sequence (any id, from position 0 or another), a prefill and decode steps: "
        "every token's logits"
    ),
    "engine sequences": (
        "1 to 3 batches, each mixing 2 or more sequences with counts of their own: each "
        "sequence's logits equal it alone"
    ),
    "engine clear": (
        "sequences fed, `clear()`, then sequences fed afresh (the same ids among them)"
    ),
    "engine remove": (
        "`remove(sequence, start, end)` of a tail, a middle span (a gap left), the head, "
        "the whole sequence or a span past its end, then every sequence fed again (where "
        "`remove` is offered)"
    ),
    "engine copy": (
        "`copy(source, target)` into an empty sequence (another emptied first where "
        "`remove` is offered), then both fed apart (where `copy` is offered)"
    ),
    "engine shift": (
        "a context shift (a span removed and what follows moved back over it, an earlier "
        "gap closed too) where `remove` is offered, a suffix moved on, or a span moved on "
        "within the gap after it (an explicit `end`, a token held there that must not move): "
        "the moved keys attend from their new positions (where `shift` is offered)"
    ),
    "engine mixed": ("up to 5 events of every kind the engine offers, each followed by a batch"),
    "engine interactions": (
        "every offered pair `A → [s] → B` of a chunk, a token, each span of `remove` the "
        "engine takes, `copy`, a shift on or back and `clear`, on one sequence with nothing "
        "between them (state `s` one of empty, holds, a gap, shared), each in a plan of its "
        "own: a chunk of it and of the sequence beside it first, a token of every sequence "
        "after; docs/interactions.md lists the pairs"
    ),
}
INTERACTIONS = "engine interactions"
ENGINE_PROPERTIES = tuple(
    Property(
        name=name,
        title=title,
        check=run_plan,
        strategy=None,  # drawn per test class (its Drawing)
        severity=failures.WRONG_RESULTS,
        # "engine remove" needs remove(), and so on; the others need no operation.
        requires=tuple(op for op in ENGINE_OPERATIONS if name == f"engine {op}"),
        since="1.8" if name == INTERACTIONS else "1.7",
        holds=HOLDS[name],
        reaches=EDGES[name],
        exhaustive_tokens=EXHAUSTIVE_TOKENS.get(name, 0),  # the interactions: not enumerated
    )
    for name, title in TITLES.items()
)
BY_NAME = {prop.name: prop for prop in ENGINE_PROPERTIES}
SINCE = {prop.name: prop.since for prop in ENGINE_PROPERTIES}


# The operations the engine under a test offers, kept on its item for the verdict's reach;
# for the interactions, the pairs it offers (the verdict's N).
OFFERED = pytest.StashKey[frozenset]()
PAIRS_OFFERED = pytest.StashKey[list]()


def engine_test(prop: Property):
    focus = prop.name.removeprefix("engine ")

    # The signature stays (self, engine_factory, request), which a subclass may wrap: the
    # exhaustive mode's block comes by the kv_block fixture, which the plugin parametrizes.
    def test(self, engine_factory, request):
        kv_block = getattr(getattr(request.node, "callspec", None), "params", {}).get("kv_block")
        if not engine_factory:
            pytest.skip("no engine: set `engine` on the class")
        drawing = self.drawing(engine_factory)
        lacks = [name for name in prop.requires if name not in drawing.offered]
        if lacks:
            pytest.skip(
                f"{NOT_OFFERED}: the engine has no {' or '.join(f'{n}()' for n in lacks)} method"
            )
        request.node.stash[OFFERED] = drawing.offered  # for the verdict's reach
        if prop.name == INTERACTIONS:  # not drawn: a plan per pair, built for this engine
            run_every_pair(self, engine_factory, drawing, request)
            return
        drawn = dataclasses.replace(prop, strategy=plans(focus, drawing))

        def check(plan: EnginePlan) -> None:
            run_plan(engine_factory, plan, drawing.spec, self.dtype)

        if kv_block is not None:  # the bounded-exhaustive mode: every plan of one block
            exhaustive.run_block(
                EnginePlans(focus, drawing).of(prop),
                kv_block,
                check,
                lambda plan: search(drawn, check, {prop.name: (plan,)}, pinned_only=True),
                factory=engine_factory,
                test_id=f"{type(self).__qualname__}.{prop.name}",
            )
            return
        if exhaustive.setting_for(type(self)) is not None:  # an exhaustive run searches it
            exhaustive.note_searched()
        search(drawn, check, self.pinned, kvsizes.NONE, self.examples_scale)

    test.__doc__ = prop.title
    test = pytest.mark.usefixtures("kv_block")(test)
    return pytest.mark.kv_property(prop.name, prop.since)(test)


def small_model(head_dim: int, ffn: str, *, layers=1, queries=1, vocab=8) -> ModelConfig:
    """A model of one KV head ``head_dim`` wide, read by ``queries`` query heads."""
    return ModelConfig(
        vocab_size=vocab,
        num_layers=layers,
        num_heads=queries,
        num_kv_heads=1,
        head_dim=head_dim,
        ffn_dim=8,
        ffn=ffn,
    )


def run_every_pair(tests: EngineTests, factory: EngineFactory, drawing: Drawing, request) -> None:
    """The plans that run every pair of calls the engine offers, on the smallest model of
    two layers (one layer's bookkeeping against the other's)."""
    spec = drawing.spec
    config = small_model(drawing.head_dims[0], drawing.ffn, layers=2, queries=2, vocab=16)
    pair_plans = engine_interplay.covering_plans(drawing.offered, spec.sequences, spec.max_tokens)
    request.node.stash[PAIRS_OFFERED] = [plan.pair for plan in pair_plans]
    engine_interplay.run_every_pair(
        lambda events: run_plan(factory, EnginePlan(config, events, 0), spec, tests.dtype),
        pair_plans,
    )


class EngineTests:
    """Every engine property. Subclass it and set ``engine`` (an ``EngineFactory``)."""

    engine: ClassVar[EngineFactory | None] = None
    engine_name: ClassVar[str | None] = None  # the name in test ids; default the factory's
    dtype: ClassVar[torch.dtype] = torch.float32  # what the engine computes its logits in
    head_dims: ClassVar[tuple[int, ...]] = (4, 8)
    ffn: ClassVar[str] = "swiglu"  # the feed-forward block the engine's architecture has
    sequences: ClassVar[int] = 3
    max_tokens: ClassVar[int] = 24
    max_batch: ClassVar[int] = 16
    start_anywhere: ClassVar[bool] = True
    removes: ClassVar[tuple[str, ...]] = REMOVALS  # the spans its remove() takes
    examples_scale: ClassVar[float] = 1.0
    pinned: ClassVar[dict[str, tuple]] = {}

    def drawing(self, factory: EngineFactory) -> Drawing:
        spec = EngineSpec(self.sequences, self.max_tokens, self.max_batch)
        probe = factory(ReferenceTransformer(small_model(self.head_dims[0], self.ffn)), spec)
        offered = engine_capabilities(probe)
        if "remove" in offered:
            unknown = set(self.removes) - set(REMOVALS)
            if unknown or not self.removes:
                raise ValueError(f"removes must name some of {REMOVALS}, got {self.removes!r}")
            offered |= {f"remove {span}" for span in self.removes}
        return Drawing(spec, self.head_dims, self.ffn, self.start_anywhere, offered)

    def pytest_generate_tests(self, metafunc) -> None:
        if "engine_factory" not in metafunc.fixturenames:
            return
        factory = type(self).engine
        label = self.engine_name or getattr(factory, "__name__", None) or type(self).__name__
        name = f"{getattr(factory, '__module__', '?')}:{label}"
        mark = pytest.mark.kv_cache(label, name, kind="engine")
        metafunc.parametrize("engine_factory", [pytest.param(factory, id=label, marks=mark)])

    def exhaustive_blocks(self, metafunc) -> list | None:
        """In the bounded-exhaustive mode (``kvcheck.exhaustive``), the blocks of plans an
        engine property's test runs (the plugin parametrizes ``kv_block`` with them): its
        enumeration for what this engine offers (a probe engine is built to ask, at
        collection); ``[None]``, a search, for the interactions (their plans are built per
        pair) and an operation the engine does not offer. None outside the mode."""
        setting, factory = exhaustive.setting_for(type(self)), type(self).engine
        mark = metafunc.definition.get_closest_marker("kv_property")
        if setting is None or mark is None or not factory:
            return None
        prop = BY_NAME[mark.args[0]]
        drawing = self.drawing(factory)
        if prop.name == INTERACTIONS or not set(prop.requires) <= drawing.offered:
            return [None]
        enumerated = EnginePlans(prop.name.removeprefix("engine "), drawing).of(prop)
        tokens = exhaustive.tokens_for(enumerated, setting)
        return exhaustive.blocks(enumerated, engine_scope(drawing, tokens, self.dtype))


for _prop in ENGINE_PROPERTIES:
    setattr(EngineTests, "test_" + _prop.name.replace(" ", "_"), engine_test(_prop))
del _prop
