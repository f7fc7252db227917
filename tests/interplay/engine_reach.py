"""How often the kit's own engine plans (``kvcheck.engines.plans``) hold the pair each
interplay engine bug needs, in a form that shows: plans only, no model run.

    PYTHONPATH=/work/main python tests/interplay/engine_reach.py 500

- ``LagEngineOverwritesPendingRotation``: a shift of sequence s moving a token whose
  rotation an earlier shift of s left pending (s not decoded between), then a decode of s.
- ``TombstoneEngineCopiesDeadEntries``: a removal from s, a copy of s into t before s runs
  again (or is shifted), then a decode of t after a position s removed (the resurrected
  token is then in its view).

Why: a bug the kit never catches is either out of the plans' reach or reached too rarely;
this tells the two apart for the engine bugs, whose properties draw plans at random.
"""

from __future__ import annotations

import sys

from hypothesis import HealthCheck, given, settings

from kvcheck import engines as kve
from tests.interplay.lag_engine import LagEngineAddsPendingRotation


class _Drawn(kve.EngineTests):
    engine = LagEngineAddsPendingRotation


def shift_twice_pending(plan: kve.EnginePlan, sequences: int) -> bool:
    mirror = kve.Mirror(sequences)
    pending: dict[int, set[int]] = {}  # sequence -> positions whose rotation waits
    hit = None  # the sequence the pair happened to, seen once it decodes
    for event in plan.events:
        if isinstance(event, kve.Decode):
            for feed in event.feeds:
                if feed.sequence == hit:
                    return True
                pending.pop(feed.sequence, None)
                mirror.held[feed.sequence].positions.extend(
                    range(feed.first, feed.first + feed.count)
                )
            continue
        if isinstance(event, kve.Shift):
            held = mirror.held[event.sequence].positions
            moved = {p for p in held if p >= event.start and (event.end is None or p < event.end)}
            waiting = pending.get(event.sequence, set())
            if moved & waiting:
                hit = event.sequence
            pending[event.sequence] = {p + event.delta for p in moved} | (waiting - moved)
        elif isinstance(event, kve.Copy) and event.source in pending:
            pending[event.target] = set(pending[event.source])
        elif isinstance(event, kve.Clear):
            pending = {}
        mirror.apply(event)
    return False


def copy_before_reclaim(plan: kve.EnginePlan, sequences: int) -> bool:
    mirror = kve.Mirror(sequences)
    dead: dict[int, set[int]] = {}  # removed, not yet reclaimed
    undead: dict[int, set[int]] = {}  # copied live into a target
    for event in plan.events:
        if isinstance(event, kve.Decode):
            for feed in event.feeds:
                if undead.get(feed.sequence) and min(undead[feed.sequence]) < feed.first:
                    return True
                dead.pop(feed.sequence, None)
                undead.pop(feed.sequence, None)
                mirror.held[feed.sequence].positions.extend(
                    range(feed.first, feed.first + feed.count)
                )
            continue
        if isinstance(event, kve.Remove):
            held = mirror.held[event.sequence].positions
            dead.setdefault(event.sequence, set()).update(
                p for p in held if p >= event.start and (event.end is None or p < event.end)
            )
        elif isinstance(event, kve.Copy) and dead.get(event.source):
            undead[event.target] = set(dead[event.source])
        elif isinstance(event, kve.Shift):
            dead.pop(event.sequence, None)  # a shift reclaims first
        elif isinstance(event, kve.Clear):
            dead, undead = {}, {}
        mirror.apply(event)
    return False


def counted(focus: str, drawing: kve.Drawing, examples: int) -> dict[str, int]:
    """How many of ``examples`` plans of ``focus`` hold each pair."""
    counts = {"shift twice pending": 0, "copy before reclaim": 0}
    sequences = drawing.spec.sequences

    @settings(
        max_examples=examples,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(plan=kve.plans(focus, drawing))
    def count(plan):
        counts["shift twice pending"] += shift_twice_pending(plan, sequences)
        counts["copy before reclaim"] += copy_before_reclaim(plan, sequences)

    count()
    return counts


def main(examples: int) -> None:
    drawing = _Drawn().drawing(LagEngineAddsPendingRotation)
    print(f"{examples} plans a focus (kvcheck.engines.plans, random draws)")
    for focus in ("decode", "sequences", "clear", "remove", "copy", "shift", "mixed"):
        counts = counted(focus, drawing, examples)
        print(f"engine {focus}: " + ", ".join(f"{k} {v}" for k, v in counts.items()))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 500)
