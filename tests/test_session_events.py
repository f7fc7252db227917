"""The session engine's shape (kvcheck/session/, issue 37): every event a plan calls by name
runs as a unit of its own through ``Engine.apply``, and the package imports nothing above it
(the kit, the properties, the plugin, the verdict), so that any of those may use it."""

import ast
import dataclasses
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings

from kvcheck import plan_events as plan
from kvcheck import session
from kvcheck import strategies as kvst
from kvcheck import tensors as kvtensors
from kvcheck.properties import core
from kvcheck.session.events.base import Event
from kvimpl import ChunkedCache
from kvref import ModelConfig

KVCHECK = Path(session.__file__).parent.parent
ABOVE = ("kvcheck.kit", "kvcheck.properties", "kvcheck.plugin", "kvcheck.verdict", "kvcheck.base")


def kvcheck_imports(path: Path, *, anywhere: bool) -> set[str]:
    """The kvcheck modules ``path`` imports: at any depth of its code (``anywhere``), or as
    it is imported (its top-level statements)."""
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree) if anywhere else tree.body:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in names if name.startswith("kvcheck")}


def module_file(name: str) -> Path | None:
    """The file of kvcheck module ``name`` (None for a name imported from one)."""
    path = KVCHECK.parent.joinpath(*name.split("."))
    for candidate in (path / "__init__.py", path.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def test_the_session_imports_nothing_above_it():
    # Its own modules at any depth of their code; what they load, as it is imported (some
    # lower modules look a property up inside a function: not a layer's import).
    seen, todo = set(), ["kvcheck.session"]
    while todo:
        name = todo.pop()
        path = module_file(name)
        # The root package serves the test classes lazily, to whoever asks: not a layer.
        if name in seen or path is None or name == "kvcheck":
            continue
        seen.add(name)
        ours = name.startswith("kvcheck.session")
        todo.extend(kvcheck_imports(path, anywhere=ours))
        if ours and path.name == "__init__.py":  # every unit, imported by the engine or not
            todo.extend(f"{name}.{file.stem}" for file in path.parent.glob("*.py"))
    reached = sorted(name for name in seen if name.startswith(ABOVE))
    assert reached == [], f"kvcheck.session reaches {reached}"
    assert {"kvcheck.session.events.tree", "kvcheck.harness"} <= seen  # it did look


def test_each_event_a_plan_calls_runs_as_its_own_unit(monkeypatch):
    ran: list[str] = []
    original = session.Engine.apply

    def recorded(self, event: Event):
        assert isinstance(event, Event)
        ran.append(type(event).__name__)
        return original(self, event)

    monkeypatch.setattr(session.Engine, "apply", recorded)
    config = ModelConfig(vocab_size=17, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4)
    model = kvtensors.build_model(config, torch.float32)
    engine = session.Engine(ChunkedCache, model, max_length=16)
    request = engine.start("a", batch=2)
    engine.feed(request, torch.randint(0, 17, (2, 5), device=model.device))
    assert engine.truncate(request, 3) is True
    engine.reorder(request, torch.tensor([1, 0]))
    child = engine.fork(request, "b")
    engine.feed(child, torch.randint(0, 17, (2, 2), device=model.device))
    engine.reset(request)
    engine.check("the plan")
    engine.finish()
    # A chunked cache offers no fork(): the child is fresh caches fed the parent's history.
    assert "fork" not in request.offered
    fork = ["Fork", "Feed"]
    assert ran == ["Feed", "Truncate", "Reorder", *fork, "Feed", "Reset", "Drop", "Drop"]
    assert (request.held, child.held) == (0, 5)


@pytest.mark.parametrize("name", session.__all__)
def test_what_callers_import_from_the_session_is_there(name):
    # What kvcheck.session gave before it was a package: properties and tests import these.
    assert getattr(session, name) is not None


def tiny_engine(factory=ChunkedCache) -> session.Engine:
    config = ModelConfig(vocab_size=17, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4)
    return session.Engine(factory, kvtensors.build_model(config, torch.float32), max_length=16)


def test_a_plan_event_plays_where_the_caches_offer_it_and_says_whether_it_ran():
    engine = tiny_engine()
    request = engine.start("r0", batch=2)
    new = torch.randint(0, 17, (2, 5), device=engine.model.device)
    assert engine.play(request, plan.Feed(0, 5), new=new)
    assert engine.play(request, plan.Truncate(0, 2)) is ("truncate" in request.offered)
    assert engine.play(request, plan.Shift(0, 0, 1)) is ("shift" in request.offered)
    assert engine.play(request, plan.Fork(0, 1))
    assert engine.live["r1"].held == request.held
    with pytest.raises(ValueError, match="needs its 5 new tokens"):
        engine.play(request, plan.Feed(0, 5), new=new[:, :2])
    engine.check("the plan")
    engine.finish()


def test_a_poisoned_request_takes_only_a_reset_or_its_end():
    engine = tiny_engine()
    request = engine.start("r0", batch=1)
    engine.play(request, plan.Feed(0, 4), new=torch.randint(0, 17, (1, 4)))
    engine.play(request, plan.Poison(0, "nan", 3))
    engine.check("the poison")  # the caches hold the history and the 3 rows past it
    with pytest.raises(TypeError, match="3 poisoned rows past its history"):
        engine.play(request, plan.Feed(0, 1), new=torch.randint(0, 17, (1, 1)))
    assert request.held == 4  # the refused feed changed nothing
    engine.play(request, plan.Reset(0))
    engine.play(request, plan.Feed(0, 2), new=torch.randint(0, 17, (1, 2)))  # judged
    engine.check("the plan")
    engine.finish()


@settings(max_examples=50, deadline=None)
@given(scenario=kvst.scenarios(poison=True))
def test_a_scenario_is_its_sessions_plan_events_and_back(scenario):
    events = [
        event
        for index, session in enumerate(scenario.sessions)
        for event in core.session_events(session, index, scenario.batch)
    ]
    again = core.sessions_of(tuple(events))

    # Each session's plan but its tokens (their seed and kind: what is fed, not an event).
    def plan_of(session):
        return dataclasses.replace(session, token_seed=0, tokens="random")

    assert list(map(plan_of, again)) == list(map(plan_of, scenario.sessions))
    assert sum(isinstance(event, plan.Start) for event in events) == len(scenario.sessions)
