"""The events an engine plan is made of (an engine's own calls: ``Decode`` a batch of
sequences' tokens, ``Remove`` a span, ``Copy`` a sequence, ``Shift`` positions, ``Clear``),
the plan, and the ``Mirror`` of the positions each sequence holds after them: the vocabulary
``kvcheck.engines`` draws and runs and ``kvcheck.engine_interplay`` pairs, below both.

They are the plans' events (``kvcheck.plan_events``) at the level an engine is driven: a
sequence addresses its tokens by position (llama.cpp's ``seq_rm``, ``seq_cp``, ``seq_add``),
not by how many it holds, so a feed says where it starts and a removal or a shift a span of
positions. Each says itself (``describe()``) as a plan event does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvref import ModelConfig
from kvref.reprs import short_repr

# --- the events ------------------------------------------------------------------------


@dataclass(frozen=True)
class Feed:
    """``count`` new tokens of ``sequence``, from position ``first`` on."""

    sequence: int
    first: int
    count: int

    def describe(self) -> str:
        return f"sequence {self.sequence} at {self.first}..{self.first + self.count - 1}"


@dataclass(frozen=True)
class Decode:
    """One batch: a ``Feed`` per sequence in it, evaluated together."""

    feeds: tuple[Feed, ...]

    def describe(self) -> str:
        return f"decode [{', '.join(feed.describe() for feed in self.feeds)}]"


@dataclass(frozen=True)
class Remove:
    """The sequence's tokens at positions [start, end) dropped; end None: to its end."""

    sequence: int
    start: int
    end: int | None

    def describe(self) -> str:
        return f"remove(sequence {self.sequence}, {self.start}, {self.end})"


@dataclass(frozen=True)
class Copy:
    """The empty sequence ``target`` made to hold what ``source`` holds."""

    source: int
    target: int

    def describe(self) -> str:
        return f"copy(sequence {self.source} to {self.target})"


@dataclass(frozen=True)
class Shift:
    """``delta`` added to the positions of the sequence's tokens in [start, end)."""

    sequence: int
    start: int
    end: int | None
    delta: int

    def describe(self) -> str:
        return f"shift(sequence {self.sequence}, {self.start}, {self.end}, {self.delta:+d})"


@dataclass(frozen=True)
class Clear:
    """Every sequence forgotten."""

    def describe(self) -> str:
        return "clear()"


# The spans an engine's ``remove`` may be given (``EngineTests.removes``): some engines drop
# a tail alone (transformers' ``DynamicCache.crop``, llama.cpp's recurrent memories).
REMOVALS = ("middle", "tail", "head", "whole", "past the end")

# The memory operation each event calls, where it is one (``kvref.engine.ENGINE_OPERATIONS``).
OPERATION = {Remove: "remove", Copy: "copy", Shift: "shift"}


@short_repr
@dataclass(frozen=True)
class EnginePlan:
    """A model and the events to drive an engine built from it through."""

    config: ModelConfig
    events: tuple
    seed: int  # the tokens: each decode's drawn from it and the event's index

    def tokens(self, index: int, feed: Feed) -> list[int]:
        generator = torch.Generator().manual_seed(
            self.seed * 1_000_003 + index * 101 + feed.sequence
        )
        drawn = torch.randint(0, self.config.vocab_size, (feed.count,), generator=generator)
        return drawn.tolist()


# --- what each sequence holds ----------------------------------------------------------


@dataclass
class Held:
    """One sequence: the positions of its tokens, in order (the tokens themselves and their
    rows are the books', ``CacheBooks``)."""

    positions: list[int] = field(default_factory=list)

    def keep(self, inside: Callable[[int], bool]) -> None:
        self.positions = [p for p in self.positions if not inside(p)]


class Mirror:
    """What each sequence of an engine should hold after the events so far (the kit's own
    books: the engine is never asked)."""

    def __init__(self, sequences: int) -> None:
        self.held = [Held() for _ in range(sequences)]

    def apply(self, event: object) -> None:
        if isinstance(event, Remove):
            end = event.end

            def inside(p: int) -> bool:
                return p >= event.start and (end is None or p < end)

            self.held[event.sequence].keep(inside)
        elif isinstance(event, Copy):
            source = self.held[event.source]
            self.held[event.target] = Held(list(source.positions))
        elif isinstance(event, Shift):
            held = self.held[event.sequence]
            held.positions = [
                p + event.delta if p >= event.start and (event.end is None or p < event.end) else p
                for p in held.positions
            ]
        elif isinstance(event, Clear):
            self.held = [Held() for _ in self.held]


# The edge each span of REMOVALS reaches.
SPAN_EDGES = {
    "middle": "a middle span removed (a gap left)",
    "tail": "a tail removed",
    "head": "the head removed",
    "whole": "a whole sequence removed",
    "past the end": "a span past the end removed",
}


def span_removed(event: Remove, positions: list[int]) -> str:
    """Which of ``REMOVALS`` ``event`` is on a sequence holding ``positions`` (``whole``
    where it holds none: what it leaves is the same)."""
    if not positions:
        return "whole"
    first, last = positions[0], positions[-1]
    reaches_end = event.end is None or event.end > last
    if event.start > last:
        return "past the end"
    if event.start <= first and reaches_end:
        return "whole"
    if reaches_end:
        return "tail"
    return "head" if event.start <= first else "middle"


def describe_held(held: Held) -> str:
    if not held.positions:
        return "nothing"
    runs, start = [], held.positions[0]
    for before, after in zip(held.positions, [*held.positions[1:], None], strict=True):
        if after != before + 1:
            runs.append(f"{start}..{before}" if before != start else f"{start}")
            start = after
    return f"{len(held.positions)} tokens at positions {', '.join(runs)}"
