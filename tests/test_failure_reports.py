"""A failure as a person reads it at 2 a.m. (kvcheck.tracebacks): the kit's message on the
first lines of its report, then the plan in its own terms and a diagnosis, then the frames of
the cache's own code; no frame of the kit, torch or Hypothesis unless asked (--tb=long). On
two users' caches of another style: one that checks nothing (bad append, overflow), one
whose reset keeps its values."""

from __future__ import annotations

import json

import pytest
import torch

# Imported here, before any run: pytester puts sys.modules back after each run in this
# process, and a kit class of a later run must be a subclass of the KitTests the plugin sees.
from kvcheck import CacheTests  # noqa: F401
from kvcheck import strategies as kvst
from kvcheck import verdict as kvverdict
from kvref import CacheSpec, ModelConfig
from tests.pytest_run import ROOT, run_in_process

USERS = """
from kvcheck import CacheTests
from tests.users.keeps_values_cache import KeepsValuesCache
from tests.users.unchecked_cache import UncheckedCache, WrappingCache


class TestUnchecked(CacheTests):
    factory = UncheckedCache


class TestWrapping(CacheTests):
    factory = WrappingCache


class TestKeepsValues(CacheTests):
    factory = KeepsValuesCache
"""
# The failure, the words its first line must hold, and the cache's own frame it names.
FAILURES = {
    "bad append": (
        "TestUnchecked::test_bad_append_is_refused_and_changes_nothing[UncheckedCache-wrong batch]",
        "UnclearError: wrong batch: refused with RuntimeError",
        "unchecked_cache.py:23 in append",
    ),
    "overflow": (
        "TestUnchecked::test_append_past_max_length_is_refused_or_held_exactly[UncheckedCache]",
        "UnclearError: append past max_length: refused with RuntimeError",
        "unchecked_cache.py:23 in append",
    ),
    "reset keeps values": (
        "TestKeepsValues::test_logits_match_uncached[KeepsValuesCache]",
        "CacheContractError: layer 0",
        None,  # the cache raised nothing: the model refused what it returned
    ),
}


def failure_report(pytester: pytest.Pytester, test: str, *args: str) -> tuple[list[str], str]:
    """The lines of ``test``'s failure report (from its title on), and the whole output."""
    pytester.makepyfile(test_users=USERS)
    pytester.syspathinsert(ROOT)
    result = run_in_process(pytester, f"test_users.py::{test}", *args)
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    title = next(i for i, line in enumerate(lines) if line.startswith("_") and "Test" in line)
    end = next(i for i, line in enumerate(lines) if "kv cache verdict" in line)
    return lines[title + 1 : end], result.stdout


@pytest.mark.parametrize("failure", list(FAILURES))
def test_a_failures_message_opens_its_report_and_the_caches_own_frame_follows(pytester, failure):
    test, message, own_frame = FAILURES[failure]
    report, out = failure_report(pytester, test)
    first = next((i for i, line in enumerate(report) if message in line), None)
    assert first is not None, f"no {message!r}:\n{out}"
    assert first < 25, f"the message is not within 25 lines:\n{out}"
    kit_frames = [line for line in report if "kvcheck/" in line or "site-packages" in line]
    assert not kit_frames, f"frames of the kit or a library shown: {kit_frames}\n{out}"
    if own_frame is not None:
        assert any(own_frame in line for line in report[:25]), f"no {own_frame!r}:\n{out}"


def test_the_plan_reads_in_its_own_terms_with_a_diagnosis_of_the_refused_rows(pytester):
    report, out = failure_report(pytester, FAILURES["reset keeps values"][0])
    text = "\n".join(report)
    assert "plan: prompt 1, chunk 16, reset, prompt 2 (" in text, out
    assert "diagnosis: layer 0's cache was given" in text, out
    assert "rows from before its reset came back in its values" in text, out
    # The falsifying example names only the fields a plan sets: no MLA field of a plain model.
    assert "drawn=Scenario(" in text, out
    assert "mla_path" not in text, out


def test_long_tracebacks_stay_pytests_own(pytester):
    report, out = failure_report(pytester, FAILURES["bad append"][0], "--tb=long")
    assert any("kvcheck/" in line for line in report), out


def test_a_verdict_line_is_never_cut_and_the_json_holds_the_whole_message(pytester):
    report_path = pytester.path / "verdict.json"
    _, out = failure_report(pytester, FAILURES["overflow"][0], "--kv-report", str(report_path))
    verdict = out.split(" kv cache verdict ")[1].split(" short test summary info ")[0]
    assert "..." not in verdict, verdict
    assert all(len(line) <= 200 for line in verdict.splitlines()), verdict
    row = json.loads(report_path.read_text())["caches"]["UncheckedCache"]["properties"]
    message = row["overflow"]["message"]
    assert "Tensor sizes" in message, message
    assert "drawn=CachePlan(" in message, message
    assert row["overflow"]["reason"] in message


def test_a_plan_prints_the_fields_it_sets_and_reads_back_as_itself():
    config = ModelConfig(vocab_size=11, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4)
    sessions = (kvst.Session((1, 16), 1, "fresh"), kvst.Session((2,), 2, "reset"))
    plan = kvst.Scenario(config, 1, torch.float64, sessions)
    shown = repr(plan)
    assert shown == (
        "Scenario(config=ModelConfig(vocab_size=11, num_layers=1, num_heads=2, num_kv_heads=1, "
        "head_dim=4), batch=1, dtype=torch.float64, sessions=(Session(chunks=(1, 16), "
        "token_seed=1, start='fresh'), Session(chunks=(2,), token_seed=2, start='reset')))"
    )
    names = {"Scenario": kvst.Scenario, "Session": kvst.Session, "ModelConfig": ModelConfig}
    assert eval(shown, {**names, "torch": torch}) == plan  # pasted back as a pinned input
    spec = CacheSpec(1, 1, 2, 8, torch.float64, torch.device("cpu"))
    assert "shard" not in repr(spec), repr(spec)
    assert plan.in_words().startswith("prompt 1, chunk 16, reset, prompt 2 (")


def test_a_verdict_line_breaks_between_words():
    entry = {"cache": "A", "name": "m:A", "property": "logits", "test": "t", "outcome": "FAIL"}
    entry.update(severity="wrong results", reason="word " * 80)
    lines = kvverdict.render(kvverdict.tabulate([entry], ["logits"]), width=100)
    fail = [line for line in lines if line.startswith("  FAIL") or line.startswith(" " * 15)]
    assert len(fail) > 1, lines
    assert all(len(line) <= 100 and not line.endswith("wor") for line in fail), fail
    assert " ".join(line.strip() for line in fail).count("word") == 80, fail


def test_every_link_of_the_chain_under_the_kits_message_is_shown(pytester):
    test = "TestWrapping::test_bad_append_is_refused_and_changes_nothing[WrappingCache-wrong batch]"
    report, out = failure_report(pytester, test)
    text = "\n".join(report)
    assert text.index("UnclearError") < text.index("could not store the rows"), out
    assert text.index("could not store the rows") < text.index("The expanded size"), out
    assert "unchecked_cache.py:23 in append" in text, out  # the root's own frame
