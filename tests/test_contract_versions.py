"""The contract's versions (docs/contract.md, section 12): every property and bad-input case
says the version it arrived in, the docs agree, a pin holds a run to an earlier version (what
is newer runs, is reported and is not counted), a bad pin stops the run, and the comparison
of two reports tells a new rule from a change in the cache."""

from __future__ import annotations

import json
import re

import pytest

from kvcheck import badinput as kvbad
from kvcheck import contract
from kvcheck import verdict as kvverdict
from kvcheck.engines import ENGINE_PROPERTIES
from kvcheck.engines import SINCE as ENGINE_SINCE
from kvcheck.properties import ALL, SINCE
from tests.pytest_run import ROOT, run_in_process

CONTRACT = (ROOT / "docs" / "contract.md").read_text()
PROPERTIES = (ROOT / "docs" / "properties.md").read_text()
# Each table of bad input and the property that runs it.
TABLES = {
    "bad append": kvbad.BAD_APPENDS,
    "bad model call": kvbad.BAD_CALLS,
    "bad truncate": kvbad.BAD_TRUNCATES,
    "bad reorder": kvbad.BAD_REORDERS,
    "bad import": kvbad.BAD_IMPORTS,
    "bad shift per row": kvbad.BAD_ROW_SHIFTS,
    "bad latent attend": kvbad.BAD_LATENT_ATTENDS,
}
CASES = [case for table in TABLES.values() for case in table]


def test_every_property_and_case_arrived_in_a_version_of_the_contract():
    assert list(contract.VERSIONS)[-1] == contract.VERSION
    every = [*ALL, *ENGINE_PROPERTIES, *CASES]
    unknown = [item.name for item in every if item.since not in contract.VERSIONS]
    assert unknown == [], f"since names no version of kvcheck.contract.VERSIONS: {unknown}"


def test_every_table_of_bad_input_gives_its_cases_a_version_and_takes_only_known_ones():
    tables = {
        name: table
        for name, table in vars(kvbad).items()
        if isinstance(table, list) and table and isinstance(table[0], kvbad.BadInput)
    }
    assert "BAD_TREE_CALLS" in tables
    assert all(any(t is table for t in tables.values()) for table in TABLES.values())
    unplaced = [f"{name}: {c.name}" for name, t in tables.items() for c in t if c.since is None]
    assert unplaced == [], f"cases of a table not built with arrived_in: {unplaced}"
    with pytest.raises(ValueError, match=r"1\.99"):
        kvbad.arrived_in("1.99", kvbad.BAD_TRUNCATES)
    assert {case.since for case in kvbad.BAD_TRUNCATES} == {"1.0"}  # nothing changed


def test_the_contract_names_its_version_and_what_arrived_in_each():
    assert f"**Contract version {contract.VERSION}.**" in CONTRACT
    table = CONTRACT[CONTRACT.index("## 12. Versions of this contract") :]
    rows = {
        line.split("|")[1].strip(): line
        for line in table.splitlines()
        if re.match(r"\| \d+\.\d+ \|", line)
    }
    assert list(rows) == list(contract.VERSIONS), "section 12's table lists every version"

    def named(name: str, since: str) -> bool:
        return f"`{name}`" in rows[since]

    unnamed = [
        prop.name
        for prop in [*ALL, *ENGINE_PROPERTIES]
        if prop.since != "1.0" and not named(prop.name, prop.since)
    ]
    for prop, table in TABLES.items():
        # A table whose cases all arrived with it may be named as "`prop` and its N cases".
        together = f"`{prop}` and its {len(table)} cases"
        unnamed += [
            case.name
            for case in table
            if case.since != "1.0" and not named(case.name, case.since)
            and together not in rows[case.since]
        ]  # fmt: skip
    assert unnamed == [], f"section 12 does not name these in their version's row: {unnamed}"


def test_the_properties_table_gives_each_property_its_version():
    rows = {
        cells[1].strip(): cells[3].strip()
        for line in PROPERTIES.splitlines()
        if line.startswith("| ") and len(cells := line.split("|")) >= 6
    }
    assert {name: rows.get(name) for name in SINCE} == SINCE
    assert {name: rows.get(name) for name in ENGINE_SINCE} == ENGINE_SINCE


def test_a_pin_is_read_from_the_option_the_environment_or_the_ini(monkeypatch):
    monkeypatch.delenv(contract.ENV, raising=False)
    assert contract.held_to(None, "") == contract.VERSION
    assert contract.held_to(None, "1.2") == "1.2"
    monkeypatch.setenv(contract.ENV, "1.3")
    assert contract.held_to(None, "1.2") == "1.3"
    assert contract.held_to("1.0", "1.2") == "1.0"
    assert contract.newer("1.10", "1.9")
    assert not contract.newer("1.4", "1.4")


@pytest.mark.parametrize(
    ("pin", "says"),
    [
        ("9.0", r"checks contract 1\.\d+ at most"),
        ("one", "not a version"),
        ("1.", "not a version"),
        ("", "not a version"),  # --kv-contract=$PIN with PIN unset: never ignored
    ],
)
def test_a_pin_the_kit_does_not_know_stops_the_run_naming_the_versions(pytester, pin, says):
    result = run_in_process(
        pytester, "--collect-only", "--pyargs", "kvcheck", f"--kv-contract={pin}"
    )
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, result.stdout
    assert re.search(says, result.stderr), result.stderr
    assert ", ".join(contract.VERSIONS) in result.stderr


# A cache that breaks only what arrived in 1.5: a kv head on the wrong rank under GQA.
SHARD_BUG = """
from kvcheck import ShardedTests, CoreTests
from tests.mutants.shards import KvHeadOnWrongRank


class TestShardBug(CoreTests, ShardedTests):
    factory = KvHeadOnWrongRank
    examples_scale = 0.05
"""


def run_on_the_shard_bug(pytester, *args: str) -> tuple[int, str, dict]:
    pytester.makepyfile(test_shard_bug=SHARD_BUG)
    pytester.syspathinsert(ROOT)
    report = pytester.path / "verdict.json"
    selected = ["-k", "logits_match or sharded_ranks_equal"]
    result = run_in_process(pytester, *selected, f"--kv-report={report}", *args)
    return result.returncode, result.stdout, json.loads(report.read_text())


def test_a_run_pinned_before_a_property_reports_its_failure_without_counting_it(pytester):
    status, out, report = run_on_the_shard_bug(pytester, "--kv-contract=1.4")
    assert status == 0, out  # green: what failed arrived after the pin
    assert "kv contract: held to 1.4" in out
    assert report["contract"] == {"version": contract.VERSION, "held to": "1.4"}
    assert report["environment"] == kvverdict.environment("cpu")
    cache = next(iter(report["caches"].values()))
    assert cache["failed"] == 0
    assert "sharded" not in cache["properties"]
    assert cache["not counted"]["sharded"]["result"] == kvverdict.FAIL
    assert cache["not counted"]["sharded"]["since"] == "1.5"
    assert re.search(
        r"not counted  sharded \(new in contract 1\.5\): FAIL \[wrong results\]", out
    ), out
    assert cache["kit properties"] == sum(not contract.newer(v, "1.4") for v in SINCE.values())

    # Neither pytest's strict xfails nor --runxfail count what the pin does not.
    pytester.makeini("[pytest]\nxfail_strict = true\n")
    status, out, _ = run_on_the_shard_bug(pytester, "--kv-contract=1.4", "--runxfail")
    assert status == 0, out

    # Unpinned, the same run is red; the comparison sees the same failure, counted now.
    status, out, unpinned = run_on_the_shard_bug(pytester)
    assert status == pytest.ExitCode.TESTS_FAILED, out
    assert "not counted" not in out
    lines, regressed = kvverdict.compare(report, unpinned)
    assert not regressed, lines
    changed = r"sharded: FAIL \[wrong results\] -> FAIL \[wrong results\].*\(counted now\)$"
    assert any(re.search(changed, line) for line in lines), lines
    assert lines[0] == f"contract: held to 1.4 -> {contract.VERSION}"


def row(result: str, since: str = "1.0", severity: str = "wrong results", test: str = "t"):
    failed = {"severity": severity, "reason": "x", "test": test} if result == "FAIL" else {}
    return {"result": result, "tests": 1, "failed": int(bool(failed)), "since": since, **failed}


def report(held: str | None, counted: dict, not_counted: dict | None = None) -> dict:
    cache = {"name": "c", "properties": counted, "not counted": not_counted or {}}
    versioned = {"contract": {"version": contract.VERSION, "held to": held}} if held else {}
    return {**versioned, "caches": {"c": cache}}


def test_a_change_in_a_property_the_old_run_was_held_to_is_still_a_regression():
    lines, regressed = kvverdict.compare(
        report("1.4", {"logits": row("pass")}), report("1.5", {"logits": row("FAIL")})
    )
    assert regressed, lines
    assert "new in contract" not in lines[-1], lines
    # A report from before versions (no "contract"): nothing is called new.
    old = report(None, {"logits": row("pass")})
    assert kvverdict.compare(old, report("1.5", {"logits": row("FAIL")}))[1]


def test_what_passed_uncounted_and_now_fails_is_a_regression():
    # The old run held to 1.4 ran sharded without counting it, and it passed.
    old = report("1.4", {}, {"sharded": row("pass", "1.5")})
    lines, regressed = kvverdict.compare(old, report("1.5", {"sharded": row("FAIL", "1.5")}))
    assert regressed, lines
    assert lines[-1].startswith("c: sharded: pass -> FAIL"), lines
    assert "counted now" in lines[-1], lines


def test_a_failure_the_same_in_both_runs_is_no_change_whichever_counted_it():
    case = row("FAIL", "1.4", severity="accepts bad input", test="case")
    old = report("1.3", {"bad append": row("pass")}, {"bad append": case})
    new = report("1.5", {"bad append": row("FAIL", severity="accepts bad input", test="case")})
    assert kvverdict.compare(old, new) == (["contract: held to 1.3 -> 1.5"], False)


def test_a_pin_lowered_over_a_passing_property_is_no_regression():
    old = report("1.5", {"sharded": row("pass", "1.5")})
    lines, regressed = kvverdict.compare(old, report("1.4", {}, {"sharded": row("pass", "1.5")}))
    assert not regressed, lines
    assert lines[-1] == "c: sharded: pass -> pass (not counted in the new run)", lines


def test_an_entry_list_of_property_names_counts_them_all():
    entry = {"cache": "c", "name": "c", "property": "logits", "test": "t", "outcome": "pass"}
    cache = kvverdict.tabulate([entry], ["logits", "lengths"])["c"]
    assert (cache["kit properties"], cache["holds"]) == (2, 1)


def test_the_versions_on_record_change_only_on_purpose():
    # A property says its version (``since`` is required); this record keeps those already
    # released from changing by mistake (a rule moved to a later version stops counting
    # under earlier pins). A property not on record is new: it arrives in the newest version.
    recorded = {
        **dict.fromkeys(
            [
                *("logits", "lengths", "contents", "reset", "stale rows", "isolation"),
                *("bad append", "overflow", "bad model call", "memory", "stateful", "requests"),
                *("fork", "attend", "pool", "exhausted pool", "truncate", "bad truncate"),
                *("reorder", "bad reorder", "truncate and reorder"),
            ],
            "1.0",
        ),
        **dict.fromkeys(["mixed lengths", "context shift", "attention sinks"], "1.2"),
        **dict.fromkeys(["prefix caching", "offload", "tree drafts"], "1.3"),
        "shared layers": "1.4",
        **dict.fromkeys(["move", "bad import", "sharded", "sharded runtime"], "1.5"),
        **dict.fromkeys(
            [
                *("context shift per row", "bad shift per row", "shared layers through rows"),
                *("shared layers under a tree", "latent attend", "bad latent attend"),
            ],
            "1.6",
        ),
    }
    assert {name: SINCE[name] for name in recorded if name in SINCE} == recorded
    assert set(recorded) <= set(SINCE), "a property on record is gone"
    new = {name: since for name, since in SINCE.items() if name not in recorded}
    assert all(since == contract.VERSION for since in new.values()), new
    assert {
        **dict.fromkeys(
            [
                *("engine decode", "engine sequences", "engine clear", "engine remove"),
                *("engine copy", "engine shift", "engine mixed"),
            ],
            "1.7",
        ),
        "engine interactions": "1.8",
    } == ENGINE_SINCE
    cases = {prop: (len(table), {c.since for c in table}) for prop, table in TABLES.items()}
    assert cases == {
        "bad append": (13, {"1.0"}),
        "bad model call": (14, {"1.0"}),  # the stateful property samples these under any pin
        "bad truncate": (3, {"1.0"}),
        "bad reorder": (8, {"1.0"}),
        "bad import": (12, {"1.5"}),
        "bad shift per row": (7, {"1.6"}),
        "bad latent attend": (9, {"1.6"}),
    }


def test_the_newest_release_in_the_changelog_is_this_one_and_names_its_contract():
    import tomllib

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    releases = re.findall(
        r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d\d-\d\d \(contract (\d+\.\d+)\)$",
        (ROOT / "CHANGELOG.md").read_text(),
        re.MULTILINE,
    )
    assert releases[0] == (version, contract.VERSION), releases[0]
    assert {held for _, held in releases} == set(contract.VERSIONS)
