"""Measure what the kit catches of the interplay bugs (``tests.interplay``): run the whole
kit on each bug and on its correct twin, in the ci profile and under seeds of the dev
profile, and write the table.

    python tests/interplay/measure.py --kit /work/main --out /tmp/interplay

- ``--kit``: the directory whose ``kvcheck``, ``kvref`` and ``tests`` packages are run (put
  first on ``PYTHONPATH``; it must hold ``tests/interplay``, e.g. as a symlink, when it is a
  snapshot of another tree such as ``git archive HEAD``).
- ``--out``: where the runs' logs (``runs/COMMIT/``, the commit named by the kit's
  ``.kit-rev`` file, else its folder's name), their results (``results.jsonl``, one line a
  run, kept between invocations: a run already there is not run again) and ``measured.md``
  go (a table per kit measured; ``OUT/notes.md``, where there is one, is added below).
- ``--seeds``: the seeds of the dev-profile runs (default: 5 drawn at random the first time
  and kept in ``seeds.txt``, so that every bug and twin runs under the same ones).
- ``--only NAME`` (repeatable), ``--variants bug,twin``, ``--modes ci,seeds``: a part of it.
- ``--table``: only write ``measured.md`` from the results already there; ``--replan``:
  read each failing plan again from the runs' reports first.

To measure a commit other than the working tree's, snapshot it and link this package in::

    git -C /work/main archive COMMIT | tar -x -C /tmp/interplay/kit-COMMIT
    ln -s /work/main/tests/interplay /tmp/interplay/kit-COMMIT/tests/interplay
    echo COMMIT > /tmp/interplay/kit-COMMIT/.kit-rev

A cache runs as ``pytest -n 2 -p no:cacheprovider --pyargs kvcheck --kv-impl MODULE:ATTR``;
an engine through a test file subclassing ``kvcheck.engines.EngineTests`` written into
``OUT/engines/``. The ci profile with ``CI=true``; a seed without ``CI`` (the dev profile)
and ``--hypothesis-seed=N``, each run in a fresh working directory, so that no run replays
another's failures from a ``.hypothesis`` database. Each run's verdict is read from its
``--kv-report`` JSON: a property "caught" it where its result is FAIL.

Only the standard library here: the runs import torch, this script does not.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ENGINE_FILE = """import torch
from kvcheck.engines import EngineTests
from {module} import {attr} as _engine


class TestInterplayEngine(EngineTests):
    engine = _engine
    engine_name = "{attr}"
    dtype = torch.float64  # the engine computes in the model's dtype, float64
"""


def registry() -> tuple[dict[str, tuple[str, str]], set[str]]:
    """``KV_IMPL`` and ``ENGINES`` of tests/interplay/__init__.py, read without importing it
    (which would import torch)."""
    tree = ast.parse((HERE / "__init__.py").read_text())
    table, engines = {}, set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "_TABLE":
            for key, value in zip(node.value.keys, node.value.values, strict=True):
                module, bug, twin = (element.value for element in value.elts[:3])
                table[key.value] = (
                    f"tests.interplay.{module}:{bug}",
                    f"tests.interplay.{module}:{twin}",
                )
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "ENGINES":
            engines = {element.value for element in node.value.args[0].elts}
    return table, engines


def pairs() -> dict[str, str]:
    """``PAIRS`` of tests/interplay/__init__.py (each bug's two events), read as a literal."""
    tree = ast.parse((HERE / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "PAIRS":
            return ast.literal_eval(node.value)
    return {}


def docstring_events(name: str, impl: str) -> tuple[str, str]:
    """The first and second events as the module docstring names them (its two bullets)."""
    module = impl.split(":")[0].rsplit(".", 1)[1]
    text = ast.get_docstring(ast.parse((HERE / f"{module}.py").read_text())) or ""
    events = {}
    for paragraph in text.split("\n- "):
        for which in ("First event", "Second event"):
            if paragraph.startswith(which + ":"):
                said = " ".join(paragraph[len(which) + 1 :].split())
                events[which] = said.split(" (")[0].rstrip(".,")
    return events.get("First event", "?"), events.get("Second event", "?")


def run_one(args, name: str, variant: str, impl: str, engine: bool, mode: str, seed: int | None):
    key = f"{name}-{variant}-{mode}" + ("" if seed is None else f"-{seed}")
    where = args.out / "runs" / kit_rev(str(args.kit)) / key  # one folder of logs per kit
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    report = where / "report.json"
    command = [sys.executable, "-m", "pytest", "-n", "2", "-q", "-p", "no:cacheprovider"]
    if engine:
        module, attr = impl.split(":")
        test = args.out / "engines" / f"test_{attr}.py"
        test.parent.mkdir(parents=True, exist_ok=True)
        test.write_text(ENGINE_FILE.format(module=module, attr=attr))
        command += [str(test)]
    else:
        command += ["--pyargs", "kvcheck", "--kv-impl", impl]
    command += ["--kv-report", str(report)]
    env = dict(os.environ, PYTHONPATH=str(args.kit))
    env.pop("CI", None)
    if mode == "ci":
        env["CI"] = "true"
    else:
        command += [f"--hypothesis-seed={seed}"]
    began = time.monotonic()
    try:
        done = subprocess.run(
            command, cwd=where, env=env, capture_output=True, text=True, timeout=args.timeout
        )
        rc, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as error:
        rc = "timeout"
        output = (error.stdout or b"").decode() + (error.stderr or b"").decode()
    wall = time.monotonic() - began
    (where / "log.txt").write_text(output)
    caught, holds, counted = {}, None, None
    if report.exists():
        verdict = next(iter(json.loads(report.read_text())["caches"].values()))
        holds, counted = verdict.get("holds"), verdict.get("run")
        for prop, row in verdict["properties"].items():
            if row.get("result") == "FAIL":
                message = row.get("message", "")
                plan = plan_of(message)
                caught[prop] = {
                    "severity": row.get("severity"),
                    "reason": row.get("reason"),
                    "plan": plan,
                }
    shutil.rmtree(where / ".hypothesis", ignore_errors=True)
    return {
        "name": name,
        "variant": variant,
        "impl": impl,
        "mode": mode,
        "seed": seed,
        "rc": rc,
        "wall_s": round(wall, 1),
        "caught_by": caught,
        "holds": holds,
        "run": counted,
        "kit": str(args.kit),
    }


def plan_of(message: str) -> str:
    """The failing plan a property's message shows: the session's own line of events where it
    has one, else the drawn input Hypothesis printed (cut to 600 characters)."""
    lines = message.splitlines()
    said = (" then ", "interactions walk ")  # the session's plans; the interactions walks
    events = next((line.strip() for line in lines if any(s in line for s in said)), "")
    if events:
        return events
    drawn = next((line.strip() for line in lines if line.strip().startswith("drawn=")), "")
    return drawn[:600] + ("..." if len(drawn) > 600 else "")


def replan(args) -> None:
    """Read each result's plans again from its run's report (after ``plan_of`` changed)."""
    results = args.out / "results.jsonl"
    rows = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    for row in rows:
        key = f"{row['name']}-{row['variant']}-{row['mode']}"
        key += "" if row["seed"] is None else f"-{row['seed']}"
        report = args.out / "runs" / kit_rev(row["kit"]) / key / "report.json"
        if not report.exists():
            continue
        verdict = next(iter(json.loads(report.read_text())["caches"].values()))
        for prop, found in row["caught_by"].items():
            found["plan"] = plan_of(verdict["properties"][prop].get("message", ""))
    results.write_text("".join(json.dumps(row) + "\n" for row in rows))


def done_keys(results: Path) -> set[tuple]:
    if not results.exists():
        return set()
    rows = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    return {(r["name"], r["variant"], r["mode"], r["seed"], r["kit"]) for r in rows}


def seeds_of(args) -> list[int]:
    if args.seeds:
        return [int(s) for s in args.seeds.split(",")]
    kept = args.out / "seeds.txt"
    if not kept.exists():
        drawn = [random.SystemRandom().randrange(2**31) for _ in range(5)]
        kept.write_text(",".join(map(str, drawn)) + "\n")
    return [int(s) for s in kept.read_text().strip().split(",")]


def kit_rev(kit: str) -> str:
    """A short name of a kit: the commit in its ``.kit-rev``, else its folder's name."""
    rev = Path(kit) / ".kit-rev"
    return rev.read_text().strip() if rev.exists() else Path(kit).name


def kit_label(kit: str) -> str:
    """The commit a kit snapshot was made from (its ``.kit-rev``), else its path."""
    rev = Path(kit) / ".kit-rev"
    return f"commit {rev.read_text().strip()} ({kit})" if rev.exists() else kit


def tables(args, names: dict, engines: set[str], seeds: list[int]) -> str:
    """One table per kit in the results, the kit named by ``--kit`` first."""
    rows = [json.loads(line) for line in (args.out / "results.jsonl").read_text().splitlines()]
    kits = list(dict.fromkeys([str(args.kit), *(r["kit"] for r in rows)]))
    measured = [kit for kit in kits if any(r["kit"] == kit for r in rows)]
    parts = [table(kit, rows, names, engines, seeds) for kit in measured]
    return "\n\n".join(parts)


def table(kit: str, rows: list[dict], names: dict, engines: set[str], seeds: list[int]) -> str:
    rows = [r for r in rows if r["kit"] == kit]

    def pick(name, variant, mode):
        return [r for r in rows if (r["name"], r["variant"], r["mode"]) == (name, variant, mode)]

    def caught_by(found) -> str:
        return ", ".join(f"`{p}`" for p in sorted(found)) if found else "—"

    out = [
        f"## The kit at {kit_label(kit)}",
        "",
        "Each bug (and its correct twin) ran the whole kit: "
        "`pytest -n 2 -p no:cacheprovider --pyargs kvcheck --kv-impl MODULE:ATTR` (an "
        "engine: a test file subclassing `kvcheck.engines.EngineTests`, dtype float64), in "
        "the ci profile (`CI=true`: 20 examples a property, derandomized) and without `CI` "
        f"(the dev profile) under the seeds {', '.join(map(str, seeds))} "
        "(`--hypothesis-seed=N`, a fresh working directory each: no example database shared). "
        "Wall times on 2 shared CPU cores, with the kit's 2 xdist workers.",
        "",
        "| # | bug (module) | first event → [state] → second event | ci: caught by | ci wall | "
        "seeds caught | seeds: caught by | seed walls | twin |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for number, (name, (bug_impl, _)) in enumerate(names.items(), 1):
        pair = pairs().get(name) or " → ".join(docstring_events(name, bug_impl))
        ci = pick(name, "bug", "ci")
        seeded = pick(name, "bug", "seeds")
        ci_cell = caught_by(ci[-1]["caught_by"]) if ci else "(not run)"
        ci_wall = f"{ci[-1]['wall_s']:.0f} s" if ci else ""
        if ci and ci[-1]["rc"] not in (0, 1):
            ci_cell += f" (rc {ci[-1]['rc']})"
        hits = [r for r in seeded if r["caught_by"]]
        props: dict[str, int] = {}
        for r in seeded:
            for p in r["caught_by"]:
                props[p] = props.get(p, 0) + 1
        seed_props = ", ".join(f"`{p}` {n}/{len(seeded)}" for p, n in sorted(props.items()))
        walls = "/".join(f"{r['wall_s']:.0f}" for r in seeded) + (" s" if seeded else "")
        twin = pick(name, "twin", "ci") + pick(name, "twin", "seeds")
        false = [r for r in twin if r["caught_by"] or r["rc"] not in (0,)]
        if not twin:
            twin_cell = "(not run)"
        elif false:
            twin_cell = "FALSE ALARM: " + "; ".join(
                f"{r['mode']}{'' if r['seed'] is None else ' ' + str(r['seed'])}: "
                f"{caught_by(r['caught_by'])} rc {r['rc']}"
                for r in false
            )
        else:
            twin_cell = f"holds ({len(twin)} of {len(twin)} runs; " + (
                "/".join(f"{r['wall_s']:.0f}" for r in twin) + " s)"
            )
        kind = "engine " if name in engines else ""
        module = bug_impl.split(":")[0].rsplit(".", 1)[1]
        out.append(
            f"| {number} | {kind}`{name}` (`{module}`) | {pair} | {ci_cell} | "
            f"{ci_wall} | {len(hits)}/{len(seeded)} | {seed_props or '—'} | {walls} | "
            f"{twin_cell} |"
        )
    out += ["", "The plan each catching property reported, shrunk (ci profile):", ""]
    for name in names:
        for r in pick(name, "bug", "ci"):
            for prop, found in sorted(r["caught_by"].items()):
                out.append(
                    f"- `{name}`, `{prop}` ({found['severity']}: {found['reason']}): "
                    f"{found['plan'] or '(see the log)'}"
                )
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kit", type=Path, default=HERE.parents[1])
    parser.add_argument("--out", type=Path, default=Path("/tmp/interplay"))
    parser.add_argument("--seeds", default="")
    parser.add_argument("--only", action="append", default=[])
    parser.add_argument("--variants", default="bug,twin")
    parser.add_argument("--modes", default="ci,seeds")
    parser.add_argument("--timeout", type=int, default=1800)
    parser.add_argument("--table", action="store_true")
    parser.add_argument("--replan", action="store_true", help="re-read plans, then --table")
    args = parser.parse_args()
    args.kit, args.out = args.kit.resolve(), args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    names, engines = registry()
    seeds = seeds_of(args)
    results = args.out / "results.jsonl"
    if args.replan:
        replan(args)
    if not (args.table or args.replan):
        done = done_keys(results)
        for name, impls in names.items():
            if args.only and name not in args.only:
                continue
            for variant in args.variants.split(","):
                impl = impls[0] if variant == "bug" else impls[1]
                runs = [("ci", None)] if "ci" in args.modes else []
                runs += [("seeds", s) for s in seeds] if "seeds" in args.modes else []
                for mode, seed in runs:
                    if (name, variant, mode, seed, str(args.kit)) in done:
                        continue
                    row = run_one(args, name, variant, impl, name in engines, mode, seed)
                    with results.open("a") as file:
                        file.write(json.dumps(row) + "\n")
                    print(
                        f"{name} {variant} {mode} {seed or ''}: "
                        f"{sorted(row['caught_by']) or 'holds'} rc {row['rc']} "
                        f"{row['wall_s']} s",
                        flush=True,
                    )
    if results.exists():
        heading = "# What the kit catches of ten interplay bugs (tests/interplay)\n\n"
        notes = args.out / "notes.md"  # a reader's notes on the runs, kept below the tables
        extra = "\n" + notes.read_text() if notes.exists() else ""
        (args.out / "measured.md").write_text(heading + tables(args, names, engines, seeds) + extra)


if __name__ == "__main__":
    main()
