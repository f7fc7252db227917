"""The bounded-exhaustive mode on engines (``kvcheck.engines.every_engine_plan``, which
``EngineTests`` runs in blocks under ``--kv-exhaustive``): decode's count is its closed
form; every focus's plans come fewest tokens first, each once, their sequences named in
first-use order, within the spec; a correct engine holds them and the verdict says so; a
one-bug engine's first failing plan is named and rerun through Hypothesis; and the one-bug
engines of tests/mutants/engines.py that each enumeration catches at its default tokens."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvcheck import engines as kve
from kvcheck.scope import first_use_order
from tests import test_engines  # its class by module: imported, pytest would run it here too
from tests.mutants.engines import ENGINE_MUTANTS, ShiftMovesTheTokenAtEnd
from tests.pytest_run import run_in_process

FOCUSES = ("decode", "sequences", "clear", "remove", "copy", "shift", "mixed")
# What a plan of each focus must hold besides its decodes.
ITS_EVENT = {"clear": kve.Clear, "remove": kve.Remove, "copy": kve.Copy, "shift": kve.Shift}


def every_plan(focus: str, tokens: int, drawing: kve.Drawing | None = None) -> list:
    drawing = drawing or test_engines.DRAWING
    scope = kve.engine_scope(drawing, tokens, torch.float64)
    return list(kve.every_engine_plan(focus, drawing, scope))


def fed(plan: kve.EnginePlan) -> int:
    return sum(feed.count for e in plan.events if isinstance(e, kve.Decode) for feed in e.feeds)


@pytest.mark.parametrize("anywhere", [True, False], ids=["start anywhere", "start at 0"])
def test_decode_counts_every_split_from_every_start_on_every_model(anywhere):
    drawing = dataclasses.replace(test_engines.DRAWING, start_anywhere=anywhere)
    starts = len(kve.EVERY_START) if anywhere else 1
    for tokens in range(1, 6):
        models = len(kve.engine_scope(drawing, tokens, torch.float64).layouts)
        want = models * starts * (2**tokens - 1)
        assert len(every_plan("decode", tokens, drawing)) == want, tokens


def test_the_scope_counts_the_models_an_engine_runs_once_each():
    drawing = test_engines.DRAWING
    scope = kve.engine_scope(drawing, 3, torch.float64)
    models = kve.engine_models(drawing, scope)
    assert len(models) == len(scope.layouts) == len(set(models))


@pytest.mark.parametrize("focus", FOCUSES)
def test_plans_run_fewest_tokens_first_each_once_within_the_spec(focus):
    plans = every_plan(focus, 2 if focus in ("shift", "mixed") else 3)
    assert plans, focus
    totals = [fed(plan) for plan in plans]
    assert totals == sorted(totals), f"{focus}: not fewest tokens first"
    assert len(set(plans)) == len(plans), f"{focus}: a plan enumerated twice"
    spec = test_engines.DRAWING.spec
    for plan in plans:
        mirror, named = kve.Mirror(spec.sequences), []
        for event in plan.events:
            if isinstance(event, kve.Decode):
                assert sum(feed.count for feed in event.feeds) <= spec.max_batch, plan
                for feed in event.feeds:
                    held = mirror.held[feed.sequence].positions
                    assert not held or feed.first == held[-1] + 1, plan
                    assert len(held) + feed.count <= spec.max_tokens, plan
                    named.append(feed.sequence)
                    held.extend(range(feed.first, feed.first + feed.count))
                continue
            named += [event.source, event.target] if isinstance(event, kve.Copy) else []
            named += [event.sequence] if hasattr(event, "sequence") else []
            mirror.apply(event)
        assert first_use_order(tuple(dict.fromkeys(named))), plan
        if focus in ITS_EVENT:
            assert any(isinstance(event, ITS_EVENT[focus]) for event in plan.events), plan


ENGINE_CLASS = """
import torch
from kvcheck.engines import EngineTests
from {module} import {name} as engine


class TestIt(EngineTests):
    engine = engine
    dtype = torch.float64
"""


def write_engine_class(pytester, module: str, name: str) -> None:
    (pytester.path / "test_it.py").write_text(ENGINE_CLASS.format(module=module, name=name))


def test_a_correct_engine_holds_every_plan_and_the_verdict_says_so(pytester):
    write_engine_class(pytester, "kvimpl.cell_engine", "engine")
    result = run_in_process(pytester, "-k", "decode or sequences", "--kv-exhaustive", "2")
    assert result.returncode == 0, result.stdout
    decode = len(every_plan("decode", 2))
    sequences = len(every_plan("sequences", 2))
    said = f"every plan holds: engine decode {decode}, engine sequences {sequences}"
    assert said in result.stdout, result.stdout


def test_the_first_failing_plan_of_an_engine_is_named_and_rerun(pytester):
    write_engine_class(pytester, "tests.mutants.engines", "PrefillNotCausal")
    result = run_in_process(pytester, "-k", "decode", "--kv-exhaustive", "2")
    assert result.returncode == 1, result.stdout
    out = result.stdout
    assert "drawn=EnginePlan(" in out, "not rerun through Hypothesis"
    plans = len(every_plan("decode", 2))  # one block
    assert f"of {plans} fails, the first of its block (#1-{plans}) to" in out, out
    assert "every plan holds" not in out


# The one-bug engine no enumeration catches at its default tokens: a span shifted to an
# explicit end needs a gap, a token at the end and a feed after it, 4 tokens of shift
# plans (130,275 of them); the search catches it (tests/test_engines.py).
BEYOND_THE_DEFAULT = {(ShiftMovesTheTokenAtEnd, "engine shift")}


@pytest.mark.soak  # remove to 4 tokens: 2,547 plans before its catch
@pytest.mark.parametrize(
    ("mutant", "name"),
    [pair for pair in ENGINE_MUTANTS if pair not in BEYOND_THE_DEFAULT],
    ids=[f"{m.__name__}-{n}" for m, n in ENGINE_MUTANTS if (m, n) not in BEYOND_THE_DEFAULT],
)
def test_each_engine_mutant_is_caught_by_its_enumeration(mutant, name):
    drawing = test_engines.TestCellEngine().drawing(mutant)
    tokens = kve.EXHAUSTIVE_TOKENS[name]
    for plan in every_plan(name.removeprefix("engine "), tokens, drawing):
        try:
            kve.run_plan(mutant, plan, drawing.spec, torch.float64)
        except AssertionError:
            return
    pytest.fail(f"{mutant.__name__}: every plan of {name} to {tokens} tokens held")


WRAPPED_CLASS = (
    ENGINE_CLASS
    + """
    test_engine_decode = pytest.mark.xfail(reason="a user's own mark", strict=False)(wrapped)
"""
)
WRAPPER = """
import pytest
from kvcheck.engines import EngineTests

inherited = EngineTests.test_engine_decode


def wrapped(self, engine_factory, request):  # as a user wraps one (its marks kept)
    return inherited(self, engine_factory, request)


wrapped.pytestmark = list(getattr(inherited, "pytestmark", []))
"""


@pytest.mark.parametrize("mode", [[], ["--kv-exhaustive", "2"]], ids=["search", "exhaustive"])
def test_an_inherited_engine_test_wrapped_with_its_signature_still_runs(pytester, mode):
    # An engine test's signature is (self, engine_factory, request): a subclass that wraps
    # one (as tests/test_found_in_the_wild_llamacpp.py marks some xfail) must not crash.
    text = WRAPPER + WRAPPED_CLASS.format(module="kvimpl.cell_engine", name="engine")
    (pytester.path / "test_it.py").write_text(text)
    result = run_in_process(pytester, "-k", "decode", "-rX", *mode)
    assert result.returncode == 0, result.stdout
    assert "TypeError" not in result.stdout, result.stdout
    assert "XPASS" in result.stdout, result.stdout  # it ran, and the cell engine holds
