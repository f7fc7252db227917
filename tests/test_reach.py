"""Reach (kvcheck.reach) and the verdict's account of a run: the edges a property's plans
ran, a plan drawn again run again (never rejected), a warm-up that fails reported
as the warm-up's failure, and the failures one first divergence explains grouped under it."""

import dataclasses

import pytest
import torch
from hypothesis import strategies as st

from kvcheck import failures, kit, reach
from kvcheck import strategies as kvst
from kvcheck import verdict as kvverdict
from kvcheck.badinput import BAD_APPENDS
from kvcheck.properties.rejection import check_bad_append
from kvimpl import ConcatCache
from kvref import CacheSpec
from tests.pytest_run import run_in_process


def entry(prop: str, outcome: str = "pass", **more) -> dict:
    return {"cache": "A", "name": "m:A", "property": prop, "test": f"t::{prop}", **more} | {
        "outcome": outcome
    }


def test_notes_are_collected_only_inside_a_collection_and_nested_ones_apart():
    reach.note("ignored")  # no test collects: nothing kept, nothing raised
    with reach.collecting() as outer:
        reach.note("a", "b")
        with reach.collecting() as inner:
            reach.note("c")
    assert (outer, inner) == ({"a", "b"}, {"c"})


def test_split_names_what_was_reached_and_what_a_cache_could_have_reached():
    declared = (reach.Edge("plain"), reach.Edge("a join", needs=("join",)), reach.Edge("seen"))
    assert reach.split(declared, {"seen"}) == (["seen"], ["plain", "a join"])
    assert reach.split(declared, {"seen"}, offered={"truncate"}) == (["seen"], ["plain"])


def test_a_plan_drawn_again_runs_again_and_a_correct_cache_holds_every_time():
    # Every draw builds one plan: each runs (none is rejected, which Hypothesis calls a flaky
    # test where it replays a choice sequence it saw valid before), and a correct cache holds.
    from kvcheck.properties import BY_NAME
    from kvref import ModelConfig

    config = ModelConfig(vocab_size=11, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4)
    session = kvst.Session(chunks=(3, 1), token_seed=1, start="fresh")
    plan = kvst.Scenario(config, batch=1, dtype=torch.float64, sessions=(session,))
    logits, ran = BY_NAME["logits"], []

    def check(drawn):
        ran.append(drawn)
        logits.run(ConcatCache, drawn, path="append")

    again = dataclasses.replace(logits, strategy=st.integers(0, 9).map(lambda _: plan))
    kit.search(again, check)
    drawn_plans = [drawn for drawn in ran if drawn is plan]  # the property's pinned ones aside
    assert len(drawn_plans) > 1, f"the plan drawn again ran {len(drawn_plans)} times"


def test_a_failure_found_while_shrinking_is_reported_as_itself_with_its_plan():
    # Draws that build the same plans over and over, failing on some: the search ends on the
    # check's own failure, its plan printed, never on a rejection or a flaky replay.
    def check(drawn):
        assert drawn[0] + drawn[1] < 2, f"the sum of {drawn} is 2 or more"

    # Ten draws build each plan; most plans fail, so every Hypothesis version finds one.
    pairs = st.tuples(st.integers(0, 9), st.integers(0, 9)).map(lambda p: (p[0] // 5, p[1] // 5))
    prop = kit.Property("p", "t", check, pairs, failures.WRONG_RESULTS, since="1.0")
    with pytest.raises(AssertionError) as raised:
        kit.search(prop, check)
    assert type(raised.value) is AssertionError, repr(raised.value)
    assert "is 2 or more" in str(raised.value)
    notes = "\n".join(getattr(raised.value, "__notes__", []))
    assert "drawn=(" in notes, f"no falsifying plan among the notes: {notes!r}"


def test_the_verdict_says_what_the_passing_properties_reached_and_never_reached():
    entries = [
        entry("logits", reached=["x"], **{"not reached": ["y"]}),
        entry("lengths", reached=["x", "y"], **{"not reached": []}),
    ]
    lines = kvverdict.render(kvverdict.tabulate(entries))
    assert "  reached      3 of 4 edges the passing properties name; never: logits: y" in lines


def test_require_reach_judges_the_run_as_a_whole(pytester):
    run = kvverdict.Verdict(pytester.parseconfig(), held_to="1.0")
    run.kit_properties = ["logits"]
    run.entries = [
        entry("logits", reached=["x"], **{"not reached": ["y"]}),
        {
            **entry("logits", reached=["y"], **{"not reached": ["x"]}),
            "cache": "B",
        },
        entry("lengths", reached=[], **{"not reached": ["z"]}),
    ]
    assert run.never_reached() == {"lengths": ["z"]}


def test_failures_of_one_root_are_grouped_under_it():
    root = "row 31 since a reset came back wrong"
    failed = {"severity": "data loss or corruption", "reason": "why"}
    entries = [
        entry("logits", "FAIL", **failed, root=root),
        entry("lengths", "FAIL", **failed, root=root),
        entry("bad append", "FAIL", **failed),
    ]
    lines = kvverdict.render(kvverdict.tabulate(entries))
    assert f"  one root     {root}: the first divergence of logits, lengths" in lines, lines


class DropsRow31(ConcatCache):
    """Loses the row at index 31 once it holds more than 32: wrong whatever it is sent."""

    def append(self, key, value):
        keys, values = super().append(key, value)
        if self.length > 32:
            keys[:, :, 31] = 0
        return keys, values


SPEC = CacheSpec(1, 1, 2, max_length=40, dtype=torch.float64, device=torch.device("cpu"))
WRONG_BATCH = next(case for case in BAD_APPENDS if str(case) == "wrong batch")


@pytest.mark.parametrize(
    ("chunks", "blamed"),
    [((40,), "warm-up append #0"), ((32,), "a twin cache given the same rows and no bad input")],
    ids=["while-warming-up", "only-on-the-read-back"],
)
def test_a_cache_wrong_whatever_it_is_sent_is_not_blamed_on_a_refusal(chunks, blamed):
    plan = kvst.CachePlan(spec=SPEC, chunks=chunks, new_tokens=1)
    with pytest.raises(failures.DataLoss, match=blamed) as caught:
        check_bad_append(DropsRow31, plan, WRONG_BATCH)
    assert not isinstance(caught.value, failures.RefusalChangedState)
    assert failures.root_of(caught.value) == "row 31 since a reset came back wrong"


PASSING_CACHE = """
from kvimpl import ConcatCache


class Fine(ConcatCache):
    pass
"""


@pytest.mark.long  # a run of pytest, in this process
def test_require_reach_fails_a_run_whose_draws_miss_an_edge(pytester, monkeypatch):
    import dataclasses

    from kvcheck import properties

    (pytester.path / "fine.py").write_text(PASSING_CACHE)
    (pytester.path / "test_x.py").write_text(
        "from kvcheck import CoreTests\nfrom fine import Fine\n\n\n"
        "class TestX(CoreTests):\n    factory = Fine\n    examples_scale = 0.05\n"
    )
    monkeypatch.syspath_prepend(pytester.path)
    logits = properties.BY_NAME["logits"]
    edges = (*logits.reaches, reach.Edge("a plan no draw makes"))
    monkeypatch.setitem(properties.BY_NAME, "logits", dataclasses.replace(logits, reaches=edges))
    args = ("-q", "-k", "test_logits_match_uncached")
    result = run_in_process(pytester, *args, "--kv-require-reach")
    assert result.returncode == pytest.ExitCode.TESTS_FAILED, result.stdout
    named = [line for line in result.stdout.splitlines() if line.startswith("  logits: ")]
    assert named, result.stdout
    assert named[0].endswith("; a plan no draw makes"), result.stdout
    assert run_in_process(pytester, *args).returncode == pytest.ExitCode.OK
