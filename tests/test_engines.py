"""The engine-level kit (``kvcheck.engines``) on its own correct engine and its mutants.

``TestCellEngine`` holds ``kvimpl.cell_engine.CellEngine`` (llama.cpp's unified KV cache in
miniature) to every engine property; the plain tests check that the Planner draws what its
properties claim and that each one-bug engine of ``tests/mutants/engines.py`` is caught.
"""

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from kvcheck import engines as kve
from kvcheck import sizes as kvsizes
from kvcheck.kit import search
from kvimpl.cell_engine import engine as cell_engine
from tests import depth
from tests.mutants.engines import ENGINE_MUTANTS


class TestCellEngine(kve.EngineTests):
    engine = cell_engine
    dtype = torch.float64
    examples_scale = depth.pick(0.5, soak=2.0)


DRAWING = TestCellEngine().drawing(cell_engine)
FEW = settings(
    max_examples=30, database=None, derandomize=True, suppress_health_check=list(HealthCheck)
)


def mirrored(plan):
    """The positions each sequence holds before each event."""
    mirror, before = kve.Mirror(DRAWING.spec.sequences), []
    for event in plan.events:
        before.append([list(h.positions) for h in mirror.held])
        mirror.apply(event)
    return before


@pytest.mark.parametrize("focus", ["remove", "copy", "shift", "clear"])
def test_a_plan_from_each_focus_has_its_event(focus):
    kind = {"remove": kve.Remove, "copy": kve.Copy, "shift": kve.Shift, "clear": kve.Clear}

    @FEW
    @given(plan=kve.plans(focus, DRAWING))
    def check(plan):
        assert any(isinstance(e, kind[focus]) for e in plan.events), plan.events

    check()


@pytest.mark.parametrize("focus", ["decode", "sequences", "remove", "copy", "shift", "mixed"])
def test_plans_feed_each_sequence_after_its_last_position_and_within_the_spec(focus):
    @FEW
    @given(plan=kve.plans(focus, DRAWING))
    def check(plan):
        for event, held in zip(plan.events, mirrored(plan), strict=True):
            if isinstance(event, kve.Decode):
                assert sum(f.count for f in event.feeds) <= DRAWING.spec.max_batch
                assert len({f.sequence for f in event.feeds}) == len(event.feeds)
                for feed in event.feeds:
                    mine = held[feed.sequence]
                    assert not mine or feed.first == mine[-1] + 1, (feed, mine)
                    assert len(mine) + feed.count <= DRAWING.spec.max_tokens
            if isinstance(event, kve.Copy):
                assert not held[event.target], (event, held)
        for positions in mirrored(plan)[1:]:
            for mine in positions:
                assert mine == sorted(set(mine)), mine
                assert all(p >= 0 for p in mine), mine

    check()


def test_a_shift_plan_keeps_positions_increasing_and_moves_only_its_span():
    @FEW
    @given(plan=kve.plans("shift", DRAWING))
    def check(plan):
        for event, held in zip(plan.events, mirrored(plan), strict=True):
            if isinstance(event, kve.Shift):
                mirror = kve.Mirror(0)
                mirror.held = [kve.Held(list(p)) for p in held]
                mirror.apply(event)
                after = mirror.held[event.sequence].positions
                assert after == sorted(set(after)), (event, after)
                assert min(after, default=0) >= 0, (event, after)
                moved = [a - b for a, b in zip(after, held[event.sequence], strict=True)]
                assert set(moved) <= {0, event.delta}, moved

    check()


def test_the_books_hold_a_removed_span_s_followers_as_they_were_computed():
    # Two layers: the token after a removed span keeps the keys and values it was computed
    # with, so the engine's logits are not the uncached pass over what is left; the cell
    # engine, a KV cache, matches the books (kvcheck.engine_books).
    config = kve.ModelConfig(
        vocab_size=16,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        ffn_dim=8,
        seed=3,
        ffn="swiglu",
    )
    for middle in (kve.Remove(0, 1, 3), kve.Remove(0, 0, 2), kve.Shift(0, 3, None, 5)):
        events = (kve.Decode((kve.Feed(0, 0, 5),)), middle, kve.Decode((kve.Feed(0, 20, 2),)))
        kve.run_plan(cell_engine, kve.EnginePlan(config, events, 0), DRAWING.spec, torch.float64)


@pytest.mark.parametrize(
    ("mutant", "name"), ENGINE_MUTANTS, ids=[f"{m.__name__}-{n}" for m, n in ENGINE_MUTANTS]
)
def test_each_engine_mutant_is_caught(mutant, name):
    prop = kve.BY_NAME[name]
    test = TestCellEngine()
    drawing = test.drawing(mutant)
    plans = kve.plans(name.removeprefix("engine "), drawing)
    drawn = dataclasses.replace(prop, strategy=plans, shrinks=False)  # a catch is enough
    with pytest.raises(AssertionError):
        search(
            drawn,
            lambda plan: kve.run_plan(mutant, plan, drawing.spec, torch.float64),
            {},
            kvsizes.NONE,
            depth.pick(3.0, soak=5.0),  # stops at the first catch: cheap
        )
