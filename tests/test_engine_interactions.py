"""Engine interactions (``kvcheck.engine_interplay``): every pair of an engine's calls on one
sequence, each run by a plan of its own, and noted wherever any plan runs it.

The plans are checked as plans (valid calls, the pair they name is the pair they run), the
correct cell engine holds every one, each one-bug engine of ``tests/mutants/engines.py`` and
both engines of ``tests/interplay`` whose bug is a pair of calls are caught, their twins not.
"""

import pytest
import torch

from kvcheck import engine_interplay, interplay, reach
from kvcheck import engines as kve
from kvimpl.cell_engine import engine as cell_engine
from tests import test_engines  # its class by module: imported, pytest would run it here too
from tests.interplay import ENGINES, INTERPLAY_BUGS, TWINS
from tests.mutants.engines import ENGINE_MUTANTS

EVERY = frozenset({*kve.ENGINE_OPERATIONS, *(f"remove {span}" for span in kve.REMOVALS)})
CONFIG = kve.ModelConfig(vocab_size=16, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4)


def run_pairs(engine, drawing: kve.Drawing) -> None:
    plans = engine_interplay.covering_plans(
        drawing.offered, drawing.spec.sequences, drawing.spec.max_tokens
    )
    engine_interplay.run_every_pair(
        lambda events: kve.run_plan(
            engine, kve.EnginePlan(CONFIG, events, 0), drawing.spec, torch.float64
        ),
        plans,
    )


def test_an_engine_offering_every_call_runs_every_pair_its_states_allow():
    pairs = engine_interplay.offered_pairs(EVERY, 3, 24)
    assert len(pairs) == len(set(pairs)) == 108
    # With no operation: a chunk or a token, then a chunk or a token (a clear empties it).
    assert engine_interplay.offered_pairs(frozenset(), 3, 24) == [
        "chunk → [holds] → chunk",
        "chunk → [holds] → decode",
        "chunk → [holds] → clear",
        "decode → [holds] → chunk",
        "decode → [holds] → decode",
        "decode → [holds] → clear",
        "clear → [empty] → chunk",
        "clear → [empty] → decode",
    ]  # a clear of empty sequences acts on none of them: no pair
    assert "remove middle → [a gap] → shift back" in pairs
    assert not any(pair.endswith("→ shift back") and "[a gap]" not in pair for pair in pairs)
    # A copy needs an empty sequence: with two sequences, both hold tokens.
    assert not any("copy" in pair for pair in engine_interplay.offered_pairs(EVERY, 2, 24))


def test_every_pair_of_kinds_is_run_or_ruled_out_with_its_reason():
    run = engine_interplay.offered_pairs(EVERY, 3, 24)
    ruled = dict(engine_interplay.ruled_out(EVERY, 3, 24))
    assert all(ruled.values())
    assert not set(run) & set(ruled)
    named = {(first, then) for first, _, then in map(interplay.split, [*run, *ruled])}
    kinds = [kind.name for kind in engine_interplay.KINDS]
    assert named == {(first, then) for first in kinds for then in kinds}


def test_each_plan_runs_the_pair_it_names_and_the_correct_cell_engine_holds_it():
    for plan in engine_interplay.covering_plans(EVERY, 3, 24):
        with reach.collecting() as noted:
            kve.run_plan(
                cell_engine, kve.EnginePlan(CONFIG, plan.events, 0), kve.EngineSpec(3, 24, 16),
                torch.float64,
            )  # fmt: skip
        assert interplay.PREFIX + plan.pair in noted, (plan.pair, sorted(noted))


def test_any_engine_plan_notes_the_pairs_it_runs():
    events = (
        kve.Decode((kve.Feed(0, 0, 4), kve.Feed(1, 0, 1))),
        kve.Remove(0, 1, 3),
        kve.Shift(0, 3, None, -2),
        kve.Copy(0, 2),
        kve.Decode((kve.Feed(0, 2, 1), kve.Feed(2, 2, 2))),
        kve.Clear(),
    )
    with reach.collecting() as noted:
        kve.run_plan(
            cell_engine, kve.EnginePlan(CONFIG, events, 0), kve.EngineSpec(3, 24, 16),
            torch.float64,
        )  # fmt: skip
    pairs = {n.removeprefix(interplay.PREFIX) for n in noted if n.startswith(interplay.PREFIX)}
    assert pairs == {
        "chunk → [holds] → remove middle",
        "remove middle → [a gap] → shift back",
        "shift back → [holds] → copy",
        "copy → [shared] → decode",
        "decode → [shared] → clear",
        "decode → [holds] → clear",  # sequence 1, fed once, beside them
        "chunk → [shared] → clear",  # the copy: its history begins with the copy
    }, pairs


@pytest.mark.parametrize(
    "mutant", sorted({m for m, _ in ENGINE_MUTANTS}, key=lambda m: m.__name__),
    ids=lambda m: m.__name__,
)  # fmt: skip
def test_each_engine_mutant_fails_some_pair(mutant):
    with pytest.raises(AssertionError):
        run_pairs(mutant, test_engines.TestCellEngine().drawing(mutant))


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_an_engine_whose_bug_is_a_pair_of_calls_is_caught_and_its_twin_holds(name):
    bug, twin = INTERPLAY_BUGS[name], TWINS[name]
    run_pairs(twin, test_engines.TestCellEngine().drawing(twin))
    with pytest.raises(AssertionError, match="engine interactions, the pair"):
        run_pairs(bug, test_engines.TestCellEngine().drawing(bug))
