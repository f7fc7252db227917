"""Measure what the thorough search costs per property: the table in docs/search.md.

    python -m tests.measure_search [--caches concat,paged] [--scale 0.03] [--write docs/search.md]

For each cache (a built-in's short name, as ``--kv-impl`` takes it), one run of pytest of its
own, all of them side by side, runs every property test of the kit (``CacheTests``; not the
hand-picked edges, which do not search) under ``--kv-profile thorough`` with the examples
scaled down by ``--scale``, so that each search draws some tens of examples at the thorough
profile's sizes. Each test's call is timed and the examples it ran counted (its pinned inputs
among them); a property's per-example time is its tests' time over their examples, and its
thorough cost that time the examples the thorough profile gives each of its tests (its
``max_examples`` times the property's share, plus the pinned inputs; fewer where the search
ran out of inputs to draw) summed over its tests (one per case and path). The markdown table
goes between the marker comments of ``--write``'s file, or to stdout.

The figures are estimates: some tens of examples each, drawn at random (the thorough profile
is not derandomized), on the machine the script runs on, each run of pytest on one torch
thread.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEGIN = "<!-- measure_search: begin (python -m tests.measure_search --write docs/search.md) -->"
END = "<!-- measure_search: end -->"
TEST_FILE = """
from kvcheck import CacheTests


class TestMeasured(CacheTests):
    examples_scale = {scale!r}
"""


def measure_one(name: str, scale: float) -> dict:
    """In this process: every property test of the kit on the built-in ``name``, under the
    thorough profile at ``scale``; each test's seconds, examples run and outcome."""
    import pytest

    from kvcheck import kit
    from kvcheck.properties import stateful

    ran = [0]
    run, machine = kit.Property.run, stateful.CachedDecoding.__init__

    def counted_run(self, *args, **kwargs):
        ran[0] += 1
        return run(self, *args, **kwargs)

    def counted_machine(self, *args, **kwargs):  # one state machine an example
        ran[0] += 1
        return machine(self, *args, **kwargs)

    kit.Property.run = counted_run
    stateful.CachedDecoding.__init__ = counted_machine
    tests: dict[str, dict] = {}

    class Timer:
        @pytest.hookimpl(wrapper=True)
        def pytest_runtest_call(self, item):
            mark = item.get_closest_marker("kv_property")
            if mark is None or "at_edges" in item.name:
                return (yield)
            ran[0] = 0
            start = time.perf_counter()
            try:
                return (yield)
            finally:
                tests[item.nodeid] = {
                    "property": mark.args[0],
                    "seconds": time.perf_counter() - start,
                    "examples": ran[0],
                }

        def pytest_runtest_logreport(self, report):
            if report.nodeid in tests and report.when == "call":
                tests[report.nodeid]["outcome"] = report.outcome

    with tempfile.TemporaryDirectory() as where:
        (Path(where) / "pytest.ini").write_text("[pytest]\n")
        test_file = Path(where) / "test_measured.py"
        test_file.write_text(TEST_FILE.format(scale=scale))
        args = [str(test_file), "-q", "-p", "no:cacheprovider", "-p", "no:xdist"]
        args += ["-p", "no:randomly", "--kv-profile", "thorough", "--kv-impl", name]
        args += ["-k", "not at_edges", f"--rootdir={where}"]
        pytest.main(args, plugins=[Timer()])
    return {"cache": name, "scale": scale, "tests": list(tests.values())}


def thorough_examples(prop, measured_generated: int, planned: int) -> int:
    """Examples a test of ``prop`` draws under the thorough profile: its share of the
    profile's, unless the search ran out of inputs before its planned examples here."""
    from kvcheck import profiles

    full = max(1, math.ceil(profiles.PROFILES["thorough"].max_examples * prop.examples_share))
    return measured_generated if measured_generated < planned else full


def summarise(result: dict) -> dict[str, dict]:
    """Per property: tests run, skipped (not offered), examples, seconds, thorough seconds."""
    from kvcheck import profiles
    from kvcheck.properties import BY_NAME

    rows: dict[str, dict] = {}
    thorough = profiles.PROFILES["thorough"].max_examples
    for test in result["tests"]:
        prop = BY_NAME[test["property"]]
        row = rows.setdefault(
            prop.name, {"tests": 0, "skipped": 0, "examples": 0, "seconds": 0.0, "thorough": 0.0}
        )
        if test.get("outcome") not in ("passed", "failed") or test["examples"] == 0:
            row["skipped"] += 1
            continue
        pinned = len(prop.pinned)
        planned = max(1, math.ceil(thorough * prop.examples_share * result["scale"]))
        generated = max(test["examples"] - pinned, 0)
        per_example = test["seconds"] / test["examples"]
        row["tests"] += 1
        row["examples"] += test["examples"]
        row["seconds"] += test["seconds"]
        row["thorough"] += per_example * (pinned + thorough_examples(prop, generated, planned))
    return rows


def duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def table(results: list[dict], cores: int) -> str:
    from kvcheck import profiles
    from kvcheck.properties import ALL

    thorough = profiles.PROFILES["thorough"].max_examples
    summaries = [(result["cache"], summarise(result)) for result in results]
    head = "| property | examples a test (thorough) |"
    rule = "|---|---:|"
    for cache, _ in summaries:
        head += f" {cache}: tests | {cache}: per example | {cache}: thorough |"
        rule += "---:|---:|---:|"
    lines = [head, rule]
    totals = {cache: 0.0 for cache, _ in summaries}
    for prop in ALL:
        full = max(1, math.ceil(thorough * prop.examples_share))
        line = f"| {prop.name} | {full:,} + {len(prop.pinned)} pinned |"
        for cache, rows in summaries:
            row = rows.get(prop.name)
            if row is None or row["tests"] == 0:
                line += " - | not offered | - |"
                continue
            per_example = row["seconds"] / row["examples"]
            line += (
                f" {row['tests']} | {per_example * 1000:,.0f} ms | {duration(row['thorough'])} |"
            )
            totals[cache] += row["thorough"]
        lines.append(line)
    total = "| **all properties, one process** | |"
    for cache, _ in summaries:
        total += f" | | **{duration(totals[cache])}** |"
    lines.append(total)
    spread = f"| **the same, `-n auto` on {cores} cores** (ideal) | |"
    for cache, _ in summaries:
        spread += f" | | {duration(totals[cache] / cores)} |"
    lines.append(spread)
    caches = ", ".join(f"{result['cache']} at scale {result['scale']}" for result in results)
    examples = sum(test["examples"] for result in results for test in result["tests"])
    lines.append("")
    lines.append(
        f"Measured {date.today().isoformat()} by `python -m tests.measure_search` ({caches}: "
        f"{examples:,} examples in all) on this machine, {os.cpu_count()} cores, one torch "
        f"thread a process: per-example times of some {round(thorough * results[0]['scale'])} "
        "random examples a property (and its pinned inputs), times the "
        f"thorough profile's {thorough:,} examples a property (its share of them) and pinned "
        "inputs, summed over the property's tests (one per case and path)."
    )
    return "\n".join(lines)


def write_between_markers(path: Path, text: str) -> None:
    document = path.read_text()
    if BEGIN not in document or END not in document:
        raise SystemExit(f"{path}: no {BEGIN} ... {END} markers to write between")
    before, rest = document.split(BEGIN, 1)
    _, after = rest.split(END, 1)
    path.write_text(f"{before}{BEGIN}\n{text}\n{END}{after}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--caches", default="concat,paged", help="built-ins, comma-separated")
    parser.add_argument(
        "--scale", type=float, default=0.03, help="examples_scale: 0.03 draws 60 a property"
    )
    parser.add_argument("--write", type=Path, default=None, help="the markdown file to update")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child's cache
    args = parser.parse_args(argv)
    if args.one is not None:
        print(json.dumps(measure_one(args.one, args.scale)), file=sys.__stdout__)
        return
    caches = [name.strip() for name in args.caches.split(",") if name.strip()]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    env.pop("CI", None)
    env.pop("KV_IMPL", None)

    def child(name: str) -> dict:
        command = [sys.executable, "-m", "tests.measure_search", "--one", name]
        command += ["--scale", str(args.scale)]
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"measuring {name} failed:\n{done.stdout}\n{done.stderr}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    start = time.perf_counter()
    with ThreadPoolExecutor(len(caches)) as pool:
        results = list(pool.map(child, caches))
    text = table(results, os.cpu_count() or 1)
    print(text)
    print(f"\n({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    if args.write is not None:
        write_between_markers(args.write, text)


if __name__ == "__main__":
    main()
