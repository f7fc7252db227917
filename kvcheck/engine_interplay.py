"""Interactions of an engine's calls: every pair of them on one sequence, run by construction.

The cache-level pairs (``kvcheck.interplay``) are the session's events on one request; an
engine (contract, section 13) has calls of its own: a batch decoding one token or a chunk
of a sequence, ``remove`` of a span, ``copy`` of a sequence into an empty one, ``shift`` of a
suffix's positions, ``clear``. A pair here is ``A → [s] → B``: call ``A`` on a sequence, which
left it in state ``s``, then call ``B`` on the same sequence, with nothing between (the bugs
live there: a rotation still pending when a second shift comes, a copy that takes entries
a remove marked dead but has not reclaimed).

- ``KINDS``: the vocabulary, each kind with the offered names it needs
  (``kvcheck.engines.Drawing.offered``: the operations and ``remove <span>``);
- ``kind_of(event, mirror)``: the kind of a call and the sequence it acts on, from what the
  sequences hold just before it (a remove's span is read from the positions it covers);
- ``covering_plans(drawing, config)``: for every pair the engine offers, the shortest plan
  that runs it (a chunk of the sequence and of another, then ``A``, then ``B``, then a
  token of every sequence holding some), judged by ``kvcheck.engines.run_plan`` like any;
- ``PairNotes``: notes the pair each call of any plan completes, for the verdict's count.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from kvcheck import engine_events as e
from kvcheck import reach
from kvcheck.interplay import PREFIX, pair_name
from kvref.engine import ENGINE_OPERATIONS

# Every pair acts on the last sequence (an id loop off by one misses it), and the first
# holds tokens beside it in each batch (an engine batches sequences: a call on one must
# leave the other as it was).
BESIDE = 0
FIRST_CHUNK, CHUNK, MOVED_ON_BY = 6, 3, 3


@dataclass(frozen=True)
class Kind:
    """A call on one sequence: its name, the offered name it needs (None: every engine) and
    what it needs of the sequence (where a first call leaves less, the pair is not run)."""

    name: str
    needs: str | None
    why_not: str = ""


HELD = "needs a token held"
KINDS = (
    Kind("chunk", None),
    Kind("decode", None),
    Kind("remove tail", "remove tail", "a tail short of the whole needs 2 tokens held"),
    Kind("remove middle", "remove middle", "a middle span needs a token kept on either side"),
    Kind("remove head", "remove head", "a head short of the whole needs 2 tokens held"),
    Kind("remove whole", "remove whole", HELD),
    Kind("remove past the end", "remove past the end", HELD),
    Kind("copy", "copy", "needs a token held and an empty sequence to copy into"),
    Kind("shift on", "shift", HELD),
    Kind("shift back", "shift", "closes a gap: needs one"),
    Kind("shift span", "shift", "moves a span on within the gap after it: needs one"),
    Kind("clear", None, "the sequence holds nothing to clear"),
)
BY_NAME = {kind.name: kind for kind in KINDS}


def state_of(positions: list[int], shared: bool) -> str:
    """What a next call can tell apart of a sequence holding ``positions``."""
    if not positions:
        return "empty"
    if positions[-1] - positions[0] + 1 > len(positions):
        return "a gap"
    return "shared" if shared else "holds"


def kind_of(event, positions: list[list[int]]) -> list[tuple[int, str]]:
    """The sequences ``event`` acts on, each with the kind of call it is there, read from
    the ``positions`` each sequence holds just before it."""
    if isinstance(event, e.Decode):
        return [(f.sequence, "decode" if f.count == 1 else "chunk") for f in event.feeds]
    if isinstance(event, e.Remove):
        return [(event.sequence, f"remove {e.span_removed(event, positions[event.sequence])}")]
    if isinstance(event, e.Copy):
        return [(event.source, "copy")]
    if isinstance(event, e.Shift):
        if event.end is not None:
            return [(event.sequence, "shift span")]
        return [(event.sequence, "shift on" if event.delta > 0 else "shift back")]
    return [(sequence, "clear") for sequence, held in enumerate(positions) if held]


class PairNotes:
    """Notes, before each call of a plan, the pair it completes on each sequence it acts on
    (``kvcheck.reach``, as the cache-level pairs are); after it, the state it left them in."""

    def __init__(self, sequences: int) -> None:
        self.last: list[tuple[str, str] | None] = [None] * sequences
        self.shared: set[int] = set()  # in a copy since the last clear
        self.acted: list[tuple[int, str]] = []  # the call's sequences, until ``after``

    def before(self, event, positions: list[list[int]]) -> None:
        self.acted = kind_of(event, positions)
        for sequence, kind in self.acted:
            if (last := self.last[sequence]) is not None:
                reach.note(PREFIX + pair_name(last[0], last[1], kind))
        if isinstance(event, e.Copy):
            self.shared |= {event.source, event.target}
            self.last[event.target] = None  # its history begins here: no pair across it
        elif isinstance(event, e.Clear):
            self.shared = set()

    def after(self, positions: list[list[int]]) -> None:
        """The call has run: ``positions`` is what each sequence holds now."""
        for sequence, kind in self.acted:
            if not positions[sequence]:
                self.shared.discard(sequence)
            shared = sequence in self.shared
            self.last[sequence] = (kind, state_of(positions[sequence], shared))


def _apply(mirror, event) -> None:
    """``mirror`` after ``event``, a decode's tokens too (``run_plan`` adds those itself)."""
    if isinstance(event, e.Decode):
        for feed in event.feeds:
            mirror.held[feed.sequence].positions.extend(range(feed.first, feed.first + feed.count))
    else:
        mirror.apply(event)


# --- the plans that run every pair ------------------------------------------------------


def _call(kind: str, its: int, positions: list[list[int]], room: int) -> list | None:
    """The call of ``kind`` on sequence ``its`` (a list of events: one), or None where it
    cannot run on what the sequences hold."""
    held = positions[its]
    n = len(held)
    after = held[-1] + 1 if held else 0
    if kind in ("chunk", "decode"):
        count = CHUNK if kind == "chunk" else 1
        return [e.Decode((e.Feed(its, after, count),))] if n + count <= room else None
    if kind == "remove tail" and n >= 2:
        return [e.Remove(its, held[n // 2], None)]
    if kind == "remove middle" and n >= 3:  # a token kept on either side: a gap left
        return [e.Remove(its, held[1], held[n - 2] + 1)]
    if kind == "remove head" and n >= 2:
        return [e.Remove(its, 0, held[n // 2 - 1] + 1)]
    if kind == "remove whole" and n:
        return [e.Remove(its, 0, None)]
    if kind == "remove past the end" and n:
        return [e.Remove(its, after, None)]
    if kind == "copy" and n:
        empty = [s for s, p in enumerate(positions) if not p and s != its]
        return [e.Copy(its, empty[-1])] if empty else None
    if kind == "shift on" and n:
        return [e.Shift(its, held[n // 2], None, MOVED_ON_BY)]
    if kind == "shift back":  # the first gap closed: what follows it moved back over it
        gaps = [(b, a) for b, a in itertools.pairwise(held) if a > b + 1]
        if gaps:
            before, at = gaps[0]
            return [e.Shift(its, at, None, before + 1 - at)]
        return None
    if kind == "shift span":  # the tokens before the first gap moved on by one, its end held
        gaps = [at for at in range(1, n) if held[at] > held[at - 1] + 1]
        return [e.Shift(its, held[0], held[gaps[0]], 1)] if gaps else None
    if kind == "clear":
        return [e.Clear()]
    return None


@dataclass(frozen=True)
class PairPlan:
    """The plan that runs one pair, and the pair's name."""

    pair: str
    events: tuple


def covering_plans(offered: frozenset[str], sequences: int, max_tokens: int) -> list[PairPlan]:
    """For every pair of the kinds ``offered`` allows, on an engine of ``sequences``
    sequences of up to ``max_tokens`` tokens, the plan that runs it: a chunk of the
    sequence and of the one beside it, the pair's two calls, then a token of every sequence
    holding some (each call's result judged by the logits that follow)."""
    return _pairs(offered, sequences, max_tokens)[0]


def ruled_out(offered: frozenset[str], sequences: int, max_tokens: int) -> list[tuple[str, str]]:
    """Each pair whose second call cannot run where its first left the sequence, and why."""
    return _pairs(offered, sequences, max_tokens)[1]


def _pairs(offered, sequences: int, max_tokens: int):
    kinds = [kind for kind in KINDS if kind.needs is None or kind.needs in offered]
    its = sequences - 1
    setup = [e.Feed(its, 0, FIRST_CHUNK)]
    if its != BESIDE:
        setup.insert(0, e.Feed(BESIDE, 0, 2))
    plans, ruled = [], []
    for first in kinds:
        for then in kinds:
            events: list = [e.Decode(tuple(setup))]
            mirror = e.Mirror(sequences)
            for feed in setup:
                mirror.held[feed.sequence].positions = list(range(feed.count))
            state = None
            if first.name in ("shift back", "shift span"):  # a shift on opens a gap first
                opened = _call("shift on", its, [h.positions for h in mirror.held], max_tokens)
                events += opened
                _apply(mirror, opened[0])
            for kind in (first, then):
                positions = [held.positions for held in mirror.held]
                if kind is then:
                    shared = isinstance(events[-1], e.Copy) and bool(positions[its])
                    state = state_of(positions[its], shared)
                call = _call(kind.name, its, positions, max_tokens)
                if call is None or (its, kind.name) not in kind_of(call[0], positions):
                    if kind is then:
                        ruled.append((pair_name(first.name, state, then.name), then.why_not))
                    break
                events += call
                _apply(mirror, call[0])
            else:
                fed = [
                    e.Feed(s, held.positions[-1] + 1, 1)
                    for s, held in enumerate(mirror.held)
                    if held.positions and len(held.positions) < max_tokens
                ]
                if fed:
                    events.append(e.Decode(tuple(fed)))
                plans.append(PairPlan(pair_name(first.name, state, then.name), tuple(events)))
    return plans, ruled


def offered_pairs(offered: frozenset[str], sequences: int, max_tokens: int) -> list[str]:
    return [plan.pair for plan in covering_plans(offered, sequences, max_tokens)]


def run_every_pair(run: Callable[[tuple], None], plans: list[PairPlan]) -> None:
    """``run`` each plan's events; a failure names the pair and its plan, in words."""
    for plan in plans:
        try:
            run(plan.events)
        except Exception as error:  # a failure, or the engine's own crash
            words = "; ".join(event.describe() for event in plan.events)
            error.add_note(f"  engine interactions, the pair {plan.pair}: {words}")
            raise


def table() -> str:
    """The engines' section of docs/interactions.md: their vocabulary and the pairs an engine
    offering every call runs (three sequences of 24 tokens, the kit's default)."""
    every = frozenset({*ENGINE_OPERATIONS, *(f"remove {span}" for span in e.REMOVALS)})
    offered = offered_pairs(every, 3, 24)
    plain = offered_pairs(frozenset(), 3, 24)
    lines = [
        "## Engines",
        "",
        "An engine (contract, section 13) is judged by its own calls, on one sequence with",
        "nothing between them: `A → [s] → B` is call `A` on a sequence, which left it in state",
        "`s` (empty, holds, a gap, shared: in a copy since the last clear), then call `B` on it.",
        "The `engine interactions` property runs each offered pair in a plan of its own (a",
        "chunk of the sequence and of the one beside it, the pair, a token of every sequence);",
        "a pair none of these states allows (a remove of an empty sequence, a shift back with",
        "no gap) is not offered.",
        "",
        "| call | needs |",
        "|---|---|",
        *(
            f"| {kind.name} | {f'`{kind.needs}`' if kind.needs else 'every engine'} |"
            for kind in KINDS
        ),
        "",
        f"An engine with no operation offers {len(plain)} pairs; one with every operation and",
        f"every span of `remove`, {len(offered)}:",
        "",
        *(f"- {pair}" for pair in offered),
        "",
        "### Engine pairs none runs",
        "",
        "| pair | why none runs |",
        "|---|---|",
        *(f"| {pair} | {why} |" for pair, why in ruled_out(every, 3, 24)),
        "",
    ]
    return "\n".join(lines)
