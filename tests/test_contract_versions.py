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
}
CASES = [case for table in TABLES.values() for case in table]


def test_every_property_and_case_arrived_in_a_version_of_the_contract():
    assert list(contract.VERSIONS)[-1] == contract.VERSION
    unknown = [item.name for item in [*ALL, *CASES] if item.since not in contract.VERSIONS]
    assert unknown == [], f"since names no version of kvcheck.contract.VERSIONS: {unknown}"


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
        prop.name for prop in ALL if prop.since != "1.0" and not named(prop.name, prop.since)
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
    [("9.0", r"checks contract 1\.\d+ at most"), ("one", "not a version"), ("1.", "not a version")],
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
    cache = next(iter(report["caches"].values()))
    assert cache["failed"] == 0
    assert "sharded" not in cache["properties"]
    assert cache["not counted"]["sharded"]["result"] == kvverdict.FAIL
    assert cache["not counted"]["sharded"]["since"] == "1.5"
    assert re.search(
        r"not counted  sharded \(new in contract 1\.5\): FAIL \[wrong results\]", out
    ), out
    assert cache["kit properties"] == sum(not contract.newer(v, "1.4") for v in SINCE.values())

    # Unpinned, the same run is red, and the comparison calls the failure a new rule.
    status, out, unpinned = run_on_the_shard_bug(pytester)
    assert status == pytest.ExitCode.TESTS_FAILED, out
    assert "not counted" not in out
    lines, regressed = kvverdict.compare(report, unpinned)
    assert not regressed, lines
    assert any(re.search(r"sharded: absent -> FAIL.*new in contract 1\.5", line) for line in lines)
    assert lines[0] == f"contract: held to 1.4 -> {contract.VERSION}"


def test_a_change_in_a_property_the_old_run_was_held_to_is_still_a_regression():
    def report(held: str, logits: str) -> dict:
        row = {"result": logits, "since": "1.0", "severity": "wrong results", "reason": "x"}
        return {"contract": {"version": held, "held to": held}, "caches": {"c": {
            "name": "c", "properties": {"logits": row}}}}  # fmt: skip

    lines, regressed = kvverdict.compare(report("1.4", "pass"), report("1.5", "FAIL"))
    assert regressed, lines
    assert "new in contract" not in lines[-1], lines
    # A report from before versions (no "contract"): nothing is called new.
    old = report("1.4", "pass")
    del old["contract"]
    assert kvverdict.compare(old, report("1.5", "FAIL"))[1]


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
