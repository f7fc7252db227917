"""The kit's pytest plugin: naming caches (built-in names, MODULE:ATTR, labels, --kv-impl,
KV_IMPL, the ini option), its cost where no kit test runs, the lines after collection, test
ids, --kv-profile, and the verdict: its lines, its JSON and their comparison."""

from __future__ import annotations

import importlib.metadata
import json
import platform
from types import SimpleNamespace

import pytest
import torch

import kvimpl
from kvcheck import devices as kvdevices
from kvcheck import failures, selection
from kvcheck import plugin as kvplugin
from kvcheck import profiles as kvprofiles
from kvcheck import verdict as kvverdict
from kvcheck.properties import NAMES
from kvref import CacheContractError
from tests.pytest_run import ROOT, run_in_process, run_pytest

EXAMPLE = "examples.doubling_cache:DoublingCache"


def test_builtin_names_resolve_to_the_registry():
    assert list(selection.BUILTINS) == list(kvimpl.CACHES)
    for name, factory in kvimpl.CACHES.items():
        assert selection.load_factory(name) is factory, f"{name!r} does not give CACHES[{name!r}]"


def test_module_attr_resolves_to_the_object():
    from examples.doubling_cache import DoublingCache

    assert selection.load_factory(EXAMPLE) is DoublingCache


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("no_such_module:Cache", "cannot import module 'no_such_module'"),
        ("kvimpl.concat:NoSuchCache", "has no attribute 'NoSuchCache'"),
        ("kvimpl:CACHES", "not a callable"),
        ("concatenated", "neither a built-in cache"),
        ("kvimpl.concat:", "neither a built-in cache"),
    ],
)
def test_a_bad_name_is_refused_with_the_reason(name, reason):
    with pytest.raises(ValueError, match=reason) as raised:
        selection.load_factory(name)
    assert repr(name) in str(raised.value), f"the error does not name {name!r}: {raised.value}"


def test_labels_are_short_unless_two_names_clash():
    names = ["concat", "a.b:Cache", "c.d:Cache", "e:Other"]
    labels = [selection.cache_label(name, names) for name in names]
    assert labels == ["concat", "a.b:Cache", "c.d:Cache", "Other"], labels


def test_a_cache_can_be_given_a_label_and_reading_names_imports_nothing():
    names = ["mine=no_such_module:Cache", "theirs = concat", "a.b:Cache", "c.d:Cache"]
    assert selection.labelled(names) == {
        "mine": "no_such_module:Cache",
        "theirs": "concat",
        "a.b:Cache": "a.b:Cache",
        "c.d:Cache": "c.d:Cache",
    }
    # A label takes the cache out of the clash: the other is short again.
    assert list(selection.labelled(["x=a.b:Cache", "c.d:Cache"])) == ["x", "Cache"]


@pytest.mark.parametrize(
    ("names", "reason"),
    [
        (["concat", "concat"], "'concat' is named 2 times"),
        (["=concat"], "'=concat': the label before '=' is empty"),
        (["mine="], "'mine=' is neither a built-in cache"),
        (["a=concat", "a=chunked"], "'a=chunked': the label 'a' is given to 'concat' too"),
        (["chunked", "chunked=concat"], "the label 'chunked' is given to 'chunked' too"),
        ([f"DoublingCache={EXAMPLE}", EXAMPLE], "the label 'DoublingCache' is given to"),
    ],
)
def test_an_empty_label_or_one_given_twice_is_refused(names, reason):
    with pytest.raises(ValueError, match=reason):
        selection.labelled(names)


def test_kv_impl_is_comma_separated_the_option_wins_over_it_and_it_over_the_ini():
    given = selection.names_given
    assert given([], f"concat, {EXAMPLE}", ["window"]) == ["concat", EXAMPLE]
    assert given(["chunked"], "concat", ["window"]) == ["chunked"], "--kv-impl must win"
    assert given([], " , ", ["window"]) == ["window"], "a blank KV_IMPL names none"
    assert given([], None, []) == [], "the kit names no cache by default"
    assert list(selection.select([f"mine={EXAMPLE}", "concat"])) == ["mine", "concat"]


def test_the_kit_lines_after_collection_and_test_ids_name_the_caches(pytester):
    before = kvprofiles.current_name()
    result = run_in_process(
        pytester,
        "--collect-only",
        "--pyargs",
        "kvcheck",
        "-k",
        "logits_match",
        "--kv-impl",
        "chunked",
        "--kv-impl",
        f"mine={EXAMPLE}",
        "--kv-profile",
        "thorough",
        "--kv-head-dim",
        "64,128",
        "--kv-max-batch",
        "16",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert kvprofiles.current_name() == before, "the run's profile outlived it"
    lines = result.stdout.splitlines()
    header = (
        f"kv caches under test: chunked, mine ({EXAMPLE}); kit profile: thorough; "
        "kv device: cpu (float64, float32, bfloat16, float16)"
    )
    assert header in lines, result.stdout
    collected = next(i for i, line in enumerate(lines) if line.startswith("collected"))
    assert lines.index(header) > collected, "the kit's lines come once the tests are known"
    sizes = "kv sizes from the command line: head dims 64/128, batch up to 16"
    assert sizes in lines, result.stdout
    assert "kv sizes the caches declare: chunked page 16" in lines, result.stdout
    tests = [line.strip() for line in lines if "<Function" in line]
    # A cache offering attend runs a path property once per path, and its ids say which.
    assert tests == [
        "<Function test_logits_match_uncached[chunked-append]>",
        "<Function test_logits_match_uncached[chunked-attend]>",
        "<Function test_logits_match_uncached[mine]>",
    ], result.stdout


LIGHT_TEST = """
import sys


def test_x():
    assert "kvcheck.plugin" in sys.modules, "the kit's plugin is not loaded"
    heavy = {"torch", "kvimpl", "kvref"} & set(sys.modules)
    assert not heavy, heavy
    kit = {name for name in sys.modules if name.startswith("kvcheck")}
    assert kit == {
        "kvcheck", "kvcheck.contract", "kvcheck.plugin", "kvcheck.selection", "kvcheck.verdict"
    }, kit  # fmt: skip
"""


@pytest.mark.long  # a process of its own
def test_a_run_without_kit_tests_imports_no_torch_and_prints_no_kit_line(tmp_path):
    (tmp_path / "test_x.py").write_text(LIGHT_TEST)
    result = run_pytest("test_x.py", "-v", cwd=tmp_path, extra_path=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "kvcache-verify" in result.stdout, result.stdout  # pytest's list of plugins
    kit_lines = [line for line in result.stdout.splitlines() if line.startswith("kv")]
    assert kit_lines == [], result.stdout


@pytest.mark.parametrize(
    ("option", "error"),
    [
        (["--kv-profile", "fast"], "--kv-profile: unknown kit profile 'fast'; choose one of "),
        (["--kv-torch-threads", "0"], "--kv-torch-threads: '0' is not a positive number"),
        (["--kv-heads", "8,x"], "kv sizes: --kv-heads: 'x' is not a positive int"),
        (["--kv-impl", "=concat"], "--kv-impl / KV_IMPL: '=concat': the label before '='"),
    ],
    ids=["profile", "threads", "sizes", "impl"],
)
@pytest.mark.long  # a process of its own
def test_an_option_checked_without_torch_stops_even_a_run_without_kit_tests(
    tmp_path, option, error
):
    (tmp_path / "test_x.py").write_text(LIGHT_TEST)
    result = run_pytest("test_x.py", *option, cwd=tmp_path, extra_path=ROOT)
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("ERROR")]
    assert len(errors) == 1, result.stderr
    assert errors[0].startswith(f"ERROR: {error}"), result.stderr


def test_the_plugin_knows_the_kit_profiles_by_name():
    assert tuple(kvprofiles.PROFILES) == kvplugin.PROFILES


WITH_FACTORY = (
    "from kvcheck import CoreTests\nfrom kvimpl import ConcatCache\n\n\n"
    "class TestMine(CoreTests):\n    factory = ConcatCache\n"
)


@pytest.mark.parametrize(
    ("test_file", "args", "error"),
    [
        # A class of the user's without a factory takes the same path as the kit's own.
        (None, ["--pyargs", "kvcheck"], selection.NO_CACHE),
        (WITH_FACTORY, ["test_mine.py"], None),
    ],
    ids=["pyargs", "factory"],
)
def test_a_kit_class_without_a_factory_needs_a_cache_named(pytester, test_file, args, error):
    if test_file is not None:
        (pytester.path / "test_mine.py").write_text(test_file)
    result = run_in_process(pytester, "--collect-only", *args)
    errors = [line for line in result.stderr.splitlines() if line.startswith("ERROR")]
    if error is None:
        assert result.returncode == 0, result.stdout + result.stderr
        assert "kv caches under test: ConcatCache (kvimpl.concat:ConcatCache); " in (
            result.stdout
        ), result.stdout
        return
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, result.stdout + result.stderr
    assert errors == [f"ERROR: {error}"], result.stderr


@pytest.mark.parametrize(
    ("option", "error"),
    [
        (
            ["--kv-impl", "nope.mod:Cache"],
            "ERROR: --kv-impl / KV_IMPL: 'nope.mod:Cache': cannot import module 'nope.mod': "
            "ModuleNotFoundError: No module named 'nope'",
        ),
        (
            ["--kv-impl", "concat", "--kv-device", "gpu:0"],
            "ERROR: --kv-device / KV_DEVICE: 'gpu:0' is not a torch device",
        ),
    ],
    ids=["impl", "device"],
)
def test_a_bad_cache_or_device_stops_the_run_with_one_line(pytester, option, error):
    result = run_in_process(pytester, "--collect-only", "--pyargs", "kvcheck", *option)
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, result.stdout + result.stderr
    # Only the error line: torch may warn on stderr too (no numpy in a fresh venv).
    errors = [line for line in result.stderr.splitlines() if line.startswith("ERROR")]
    assert len(errors) == 1, result.stderr
    assert errors[0].startswith(error), result.stderr


def missing_cuda_device() -> str:
    """A CUDA device this machine lacks: any on a machine without a GPU."""
    return f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"


def test_a_device_this_machine_lacks_skips_every_kit_test_with_the_reason(pytester):
    device = missing_cuda_device()
    result = run_in_process(
        pytester, "--pyargs", "kvcheck", "-k", "logits or reorder", "--kv-impl", "concat",
        "--kv-device", device, "-rs",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"kv device: {device} (unavailable: " in result.stdout, result.stdout
    skipped = [line for line in result.stdout.splitlines() if line.startswith("SKIPPED")]
    # One reason per test (not "not offered": the device is checked first), and no test ran.
    assert skipped, result.stdout
    assert all(f"--kv-device {device}: " in line for line in skipped), skipped
    assert " passed" not in result.stdout, result.stdout
    run = f"concat: 4 skipped (0 of 4 pass); 0 of {len(NAMES)} properties run"
    assert run in result.stdout, result.stdout
    assert " failed" not in result.stdout, result.stdout


def test_a_dtype_the_device_lacks_is_never_drawn(monkeypatch):
    from hypothesis import given

    from kvcheck import devices
    from kvcheck import strategies as kvst
    from kvcheck.kit import probe_spec

    # As on MPS, which has no float64.
    monkeypatch.setattr(devices, "supports", lambda dtype, device: dtype != torch.float64)
    assert probe_spec().dtype == torch.float32

    @given(spec=kvst.cache_specs(), scenario=kvst.scenarios(max_sessions=1))
    def draws(spec, scenario):
        assert torch.float64 not in (spec.dtype, scenario.dtype)

    draws()


@pytest.mark.parametrize(
    ("option", "value"),
    [("profile", "fast"), ("threads", "0"), ("device", "gpu:0"), ("device", "meta")],
)
def test_a_bad_kit_setting_is_refused_with_the_choices(option, value):
    # The plugin turns the ValueError into a one-line usage error (see the --kv-impl test).
    choose = {
        "profile": kvprofiles.choose,
        "threads": kvprofiles.choose_threads,
        "device": kvdevices.choose,
    }[option]
    with pytest.raises(ValueError, match=repr(value)):
        choose(value)
    kvdevices.choose(None)


def report(caches: dict) -> dict:
    return {"kvcache-verify": "0", "kit_profile": "ci", "caches": caches}


def row(result: str, **extra) -> dict:
    return {"result": result, "tests": 1, "failed": int(result == "FAIL"), **extra}


def test_comparing_two_reports_names_what_changed_and_fails_on_a_regression(tmp_path):
    failed = row("FAIL", severity="wrong results", reason="logits differ")
    old = report({"A": {"name": "m:A", "properties": {"logits": row("pass"), "memory": failed}}})
    new = report({"A": {"name": "m:A", "properties": {"logits": failed, "memory": row("pass")}}})
    (tmp_path / "old.json").write_text(json.dumps(old))
    (tmp_path / "new.json").write_text(json.dumps(new))
    status = kvverdict.main([str(tmp_path / "old.json"), str(tmp_path / "new.json")])
    assert status == 1, "a property that held and now fails is a regression"
    lines, regressed = kvverdict.compare(old, new)
    assert lines == [
        "A: logits: pass -> FAIL [wrong results]: logits differ",
        "A: memory: FAIL [wrong results] -> pass",
    ], lines
    assert regressed
    assert kvverdict.compare(new, new) == ([], False)
    worse = report({"A": {"name": "m:A", "properties": {"logits": failed, "memory": failed}}})
    unclear = row("FAIL", severity="unclear error", reason="message names nothing")
    milder = report({"A": {"name": "m:A", "properties": {"logits": unclear, "memory": failed}}})
    assert kvverdict.compare(milder, worse)[1], "unclear error -> wrong results is a regression"
    assert not kvverdict.compare(worse, milder)[1], "a milder failure is no regression"
    gone = report({})
    assert kvverdict.compare(new, gone)[1], "a property that held and is gone is a regression"


def test_a_comparison_says_first_which_settings_of_the_run_changed():
    rows = {"A": {"name": "m:A", "properties": {"logits": row("pass")}}}
    setting = {"python": "3.11.9", "torch": "2.13.0", "hypothesis": "6.155.2", "kv device": "cpu"}
    old = report(rows) | {"environment": setting}
    new = report(rows) | {"kvcache-verify": "1", "kit_profile": "thorough"}
    new["environment"] = setting | {"torch": "2.14.0"}
    assert kvverdict.compare(old, new) == (
        ["kit: 0 -> 1", "kit profile: ci -> thorough", "torch: 2.13.0 -> 2.14.0"],
        False,
    ), "a changed setting is said, and is no regression by itself"
    # A report from before the environment was recorded: nothing to compare it with.
    assert kvverdict.compare(report(rows), new)[0] == ["kit: 0 -> 1", "kit profile: ci -> thorough"]


def test_a_report_records_the_versions_that_computed_it_and_the_device():
    environment = kvverdict.environment("cuda:1")
    assert environment["kv device"] == "cuda:1"
    assert environment["torch"] == importlib.metadata.version("torch")
    assert environment["python"] == platform.python_version()
    assert environment["hypothesis"] == importlib.metadata.version("hypothesis")


def verdict_of(outcomes: list[str]) -> tuple[list[str], dict]:
    """The first line of the verdict, and the JSON, of one cache whose properties (in the
    kit's order, the rest not run) had ``outcomes``."""
    from kvcheck.properties import ALL

    entries = [
        {"cache": "A", "name": "m:A", "property": prop.name, "test": f"t::{index:02}"}
        | {"outcome": outcome, "severity": "wrong results", "reason": "why"}
        for index, (prop, outcome) in enumerate(zip(ALL, outcomes, strict=False))
    ]
    caches = kvverdict.tabulate(entries)
    return kvverdict.render(caches)[0], caches["A"]


def test_the_verdict_holds_every_property_only_where_every_one_ran_or_is_not_offered():
    from kvcheck.properties import ALL

    every = len(ALL)
    line, cache = verdict_of(["pass"] * (every - 1) + ["not offered"])
    assert line == f"A (m:A): holds every property ({every - 1} of {every - 1} pass)", line
    assert (cache["holds"], cache["run"], cache["kit properties"]) == (every - 1,) * 2 + (every,)
    assert cache["not offered"] == 1, cache
    for outcomes, expected in [
        (["pass"] * 3, f"3 of {every} properties run (3 of 3 pass)"),
        (["FAIL", "pass"], f"1 FAIL (1 of 2 pass); 2 of {every} properties run"),
        (["skipped", "not offered"], f"1 skipped (0 of 1 pass); 0 of {every} properties run"),
        (["pass"] * (every - 1) + ["skipped"], f"1 skipped ({every - 1} of {every} pass); "),
    ]:
        line, cache = verdict_of(outcomes)
        assert line.startswith(f"A (m:A): {expected}"), (outcomes, line)
        assert "every" not in line, line
        assert cache["run"] == outcomes.count("pass") + outcomes.count("FAIL"), cache


def test_every_property_is_bound_by_the_kit_and_reported():
    """Each property of the registry has a test in CacheTests (so users run it), and every
    kit test names a property of the registry (so the verdict has its row)."""
    from kvcheck import CacheTests
    from kvcheck.properties import ALL

    bound = {
        mark.args[0]
        for name in dir(CacheTests)
        if name.startswith("test_")
        for mark in getattr(getattr(CacheTests, name), "pytestmark", [])
        if mark.name == "kv_property"
    }
    assert bound == {prop.name for prop in ALL}, f"bound {sorted(bound)}"


def fake_item(prop: str = "logits"):
    marks = {"kv_property": (prop,), "kv_cache": ("MyCache", "mypkg:MyCache")}
    return SimpleNamespace(
        nodeid="t.py::T::test[MyCache]",
        get_closest_marker=lambda name: (
            SimpleNamespace(args=marks[name]) if name in marks else None
        ),
    )


def fake_report(when="call", outcome="failed", **extra):
    return SimpleNamespace(
        when=when,
        passed=outcome == "passed",
        skipped=outcome == "skipped",
        longrepr=extra.pop("longrepr", None),
        longreprtext=extra.pop("longreprtext", ""),
        **extra,
    )


def raised(error: Exception):
    return SimpleNamespace(excinfo=SimpleNamespace(value=error))


@pytest.mark.parametrize(
    ("report", "call", "expected"),
    [
        (fake_report(outcome="passed"), raised(None), {"outcome": "pass"}),
        (
            fake_report(outcome="skipped", longrepr=("f", 1, "Skipped: not offered: no truncate")),
            raised(None),
            {"outcome": "not offered", "reason": "not offered: no truncate"},
        ),
        (
            fake_report(outcome="skipped", wasxfail="known bug 12"),
            raised(None),
            {"outcome": "skipped", "reason": "xfail: known bug 12"},
        ),
        (
            fake_report(),
            raised(failures.DataLoss("layer 0: length is 3\n  at step 2")),
            {"outcome": "FAIL", "severity": "data loss or corruption"},
        ),
        (
            fake_report(),
            raised(CacheContractError("layer 1: append must return 4 rows")),
            {"outcome": "FAIL", "severity": "data loss or corruption"},
        ),
        (
            fake_report(),
            raised(
                BaseExceptionGroup("two", [failures.UnclearError("u"), failures.WrongResults("w")])
            ),
            {"outcome": "FAIL", "severity": "wrong results", "reason": "w"},
        ),
        (
            fake_report(when="setup"),
            raised(RuntimeError("no GPU")),
            {
                "severity": "crash",
                "reason": "in setup, before the property ran: RuntimeError: no GPU",
            },
        ),
    ],
)
def test_a_report_becomes_a_verdict_entry(report, call, expected):
    entry = kvverdict.entry_for(fake_item(), call, report)
    assert {key: entry[key] for key in expected} == expected, entry


EVERY_AREA = (
    "from kvcheck import CacheTests\nfrom kvimpl import ConcatCache\n\n\n"
    "class TestMine(CacheTests):\n    factory = ConcatCache\n"
)


def kit_verdict(pytester: pytest.Pytester, *args: str) -> tuple[dict, object]:
    """The JSON verdict of a run of the whole kit on ConcatCache with ``args``, and the run."""
    (pytester.path / "test_mine.py").write_text(EVERY_AREA)
    report = pytester.path / "verdict.json"
    paths = [] if any(arg.startswith("test_mine.py::") for arg in args) else ["test_mine.py"]
    result = run_in_process(pytester, *paths, "--kv-report", str(report), *args)
    assert report.exists(), result.stdout + result.stderr
    return json.loads(report.read_text())["caches"]["ConcatCache"], result


def test_a_property_some_of_whose_cases_were_left_out_is_partly_run_not_a_pass(pytester):
    # -k lengths selects the two pinned cases of `lengths at edges` (of 3 tests of lengths)
    # and one case of `bad model call` (of 14): neither holds.
    cache, result = kit_verdict(pytester, "-k", "lengths")
    for name in ("lengths", "bad model call"):
        row = cache["properties"][name]
        assert row["result"] == kvverdict.PARTLY, (name, row)
        assert row["cases"]["run"] < row["cases"]["of"], (name, row)
        assert row["partly"] == f"pass ({row['cases']['run']} of {row['cases']['of']} cases)"
        assert f"partly run   {name}: {row['partly']}" in result.stdout, result.stdout
    assert cache["holds"] == 0, cache
    assert "holds every property" not in result.stdout


def test_a_test_id_runs_one_case_and_the_verdict_says_so(pytester):
    test = "test_bad_append_is_refused_and_changes_nothing"
    one = f"test_mine.py::TestMine::{test}[ConcatCache-wrong batch]"
    cache, result = kit_verdict(pytester, one)
    assert set(cache["properties"]) == {"bad append"}, result.stdout
    row = cache["properties"]["bad append"]
    assert row["result"] == kvverdict.PARTLY, row
    assert row["cases"]["run"] == 1 < row["cases"]["of"], row


def test_kv_property_runs_the_properties_it_names_in_full(pytester):
    cache, result = kit_verdict(pytester, "--kv-property", "bad append", "--kv-property", "memory")
    assert set(cache["properties"]) == {"bad append", "memory"}, cache["properties"]
    for name, row in cache["properties"].items():
        assert row["result"] == kvverdict.PASS, (name, row)
        assert row["cases"]["run"] == row["cases"]["of"], (name, row)
    assert result.returncode == 0, result.stdout


def test_kv_property_refuses_a_name_the_kit_does_not_have_naming_the_closest(pytester):
    (pytester.path / "test_mine.py").write_text(EVERY_AREA)
    result = run_in_process(pytester, "test_mine.py", "--kv-property", "bad apend")
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("ERROR")]
    assert len(errors) == 1, result.stderr
    assert "'bad apend'" in errors[0], errors
    assert "'bad append'" in errors[0], errors  # the property meant, offered


def kit_entry(test: str, outcome: str = kvverdict.PASS, **more) -> dict:
    """A verdict entry of cache A's logits property, from test ``test``."""
    planned = {"t.py::TestA": 3}
    return {"cache": "A", "name": "m:A", "property": "logits", "test": test} | {
        "outcome": outcome,
        "planned": planned,
        **more,
    }


def test_a_test_reported_twice_counts_once():
    # --dist each, or a rerun plugin: two reports of one test are one case that ran.
    entries = [kit_entry("t::a"), kit_entry("t::a"), kit_entry("t::b")]
    row = kvverdict.tabulate(entries, ["logits"])["A"]["properties"]["logits"]
    assert row["result"] == kvverdict.PARTLY, row
    assert row["cases"] == {"run": 2, "of": 3}, row


def test_a_users_skip_or_xfail_is_not_a_case_that_ran():
    skipped = {"outcome": kvverdict.SKIPPED, "reason": "xfail: known"}
    entries = [kit_entry("t::a"), kit_entry("t::b"), kit_entry("t::c", **skipped)]
    row = kvverdict.tabulate(entries, ["logits"])["A"]["properties"]["logits"]
    assert row["result"] == kvverdict.PARTLY, row
    not_offered = {"outcome": kvverdict.NOT_OFFERED, "reason": "not offered: no attend"}
    entries[2] = kit_entry("t::c", **not_offered)  # the kit found that case not offered: ran
    row = kvverdict.tabulate(entries, ["logits"])["A"]["properties"]["logits"]
    assert row["result"] == kvverdict.PASS, row


def test_the_cases_of_every_class_on_one_cache_are_counted():
    # Two classes test cache A's logits; only the first class's tests ran.
    both = {"t.py::TestA": 3, "t.py::TestB": 3}
    entries = [kit_entry(f"t::{case}", planned=both) for case in "abc"]
    row = kvverdict.tabulate(entries, ["logits"])["A"]["properties"]["logits"]
    assert row["cases"] == {"run": 3, "of": 6}, row
    assert row["result"] == kvverdict.PARTLY, row


def test_a_kit_test_whose_worker_died_is_a_crash_in_the_verdict(pytester):
    gathered = kvverdict.Verdict(pytester.parseconfig(), held_to="1.0")
    gathered.kit_tests = {"t.py::TestA::test_logits[A]": ["A", "m:A", "logits"]}
    gathered.unreported = {"t.py::TestA::test_logits[A]", "t.py::test_not_the_kits"}
    gathered.entries = [kit_entry("t::a"), kit_entry("t::b")]
    row = gathered.caches()["A"]["properties"]["logits"]
    assert row["result"] == kvverdict.FAIL, row
    assert row["severity"] == failures.CRASH, row
    assert "died" in row["reason"], row


def test_a_misspelled_property_is_one_usage_error_under_xdist(tmp_path):
    (tmp_path / "test_mine.py").write_text(EVERY_AREA)
    result = run_pytest("-n", "2", "test_mine.py", "--kv-property", "logit", cwd=tmp_path)
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, result.stdout + result.stderr
    assert "INTERNALERROR" not in result.stdout + result.stderr, result.stdout + result.stderr
    assert "'logits'" in result.stderr, result.stderr  # the property meant, offered
