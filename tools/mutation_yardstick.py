"""A mutation yardstick of the engines' own cache code: which one-bug mutants of an engine's
installed cache files its own unit tests catch, and which the kit catches through the
engine's adapter in ``kvimpl/``.

The mutants and the commands are the engine's (one module per engine beside this one:
``yardstick_transformers.py``, ``yardstick_vllm.py``); this file is the harness they share.
For each mutant it

1. writes the mutant (its original line must be where it says, once, or the script stops),
2. runs (a) the kit's properties on the adapters that reach the mutated code and (b) the
   engine's own offline CPU tests, each selection being the tests that pass on the pristine
   install, stopping at the first failure,
3. puts the original file back (``try``/``finally``; SIGTERM is turned into an exception so
   that it restores too) and checks its sha256.

Before any mutant it checks that every file it mutates is the pinned release's (by sha256; a
copy left aside by an interrupted in-place run is put back first) and runs both selections on
the pristine install: a test that fails there is dropped, and the page says how many.

Where the mutants go: by default into a PRIVATE overlay of the installed package (a tree of
symlinks to it with its own copies of the mutated files, first on ``PYTHONPATH`` of the test
processes only), so that nobody else using the same environment ever imports a mutant.
``--in-place`` patches the installed files themselves; use it only on an environment of your
own.

    python tools/mutation_yardstick.py transformers --python /tmp/hfvenv/bin/python \\
        --engine-source /path/to/transformers/.git --engine-commit c7e57f79... --deps DIR
    python tools/mutation_yardstick.py vllm --python /tmp/vllm/bin/python \\
        --engine-source /path/to/unpacked/vllm-0.32.0
    KVCHECK_SGLANG_PATH=DIR python tools/mutation_yardstick.py sglang

An engine whose adapter finds it through an environment variable (``Engine.path_env``, e.g.
SGLang's files under ``pip install --no-deps --target DIR``) is read from the folder that
variable names, and the test processes get the overlay's folder through it.

``--only M01,M07`` runs some mutants (the engine's section then holds those alone);
``--check`` only checks that every mutant applies to the installed files (what the
repository's tests do); ``--rewrite`` writes the section again from the last run's results
(after a change to the notes). A run rewrites the engine's section of ``docs/yardstick.md``
and keeps the others; the raw results go to ``WORK/ENGINE/results.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "yardstick.md"
# each a module yardstick_<name>.py beside this
ENGINES = ("transformers", "vllm", "mlx_lm", "sglang")
BACKUP_SUFFIX = ".yardstick-orig"
KIT_TIMEOUT = 900
ENGINE_TIMEOUT = 900


@dataclasses.dataclass(frozen=True)
class Mutant:
    id: str
    file: str  # path inside the installed package, e.g. "v1/core/block_pool.py"
    where: str  # "Class.method" or "function": the original line is searched for there only
    original: str  # the line, without its indentation
    mutant: str
    what: str
    # "issues/N" or "pull/N" of the engine's tracker, or "owner/repo/issues/N" of another's
    inspired_by: tuple[str, ...]
    adapters: tuple[str, ...]  # the adapters whose kit selection runs it; () if none reaches it
    unreached: str = ""  # with no adapters: why none reaches the mutated code
    # Where the original line is in ``where`` more than once: which of them (0 is the first).
    nth: int | None = None


@dataclasses.dataclass(frozen=True)
class Engine:
    """What the harness needs of an engine (its module's ``ENGINE``)."""

    name: str  # the page's name for it
    package: str  # its import name
    version: str  # the release the mutants are written for
    files: dict[str, str]  # the files mutated, inside the package -> their pristine sha256
    tracker: str  # "https://github.com/OWNER/REPO/"
    mutants: tuple[Mutant, ...]
    # adapter -> the pytest arguments (run from this repository) of every kit test on it;
    # options as one argument each ("-kEXPR", "--opt=value"): a run keeps them beside the
    # node ids that passed on the pristine install
    kit_suites: dict[str, tuple[str, ...]]
    kit_note: str  # what the kit's selection is, for the page
    engine_files: tuple[str, ...]  # what to copy out of the engine's source tree
    engine_tests: tuple[str, ...]  # the test files to run, among engine_files
    # (counts of the pristine run, its seconds, the source given) -> the paragraph of the page
    engine_note: Callable[[dict[str, int], float, str], str]
    notes: tuple[str, ...]  # the section's closing notes
    engine_env: dict[str, str] = dataclasses.field(default_factory=dict)
    # An environment variable naming the folder that holds the package, where the adapter
    # looks for it instead of importing it (SGLang's: its package would import its server)
    path_env: str = ""
    # With no engine_tests: why none run (each row's cell for the engine's tests)
    no_tests: str = ""


def tally(counts: dict[str, int], seconds: float) -> str:
    """The pristine run of an engine's tests, for its paragraph on the page."""
    return (
        f"Of their {sum(counts.values())} tests, {counts.get('passed', 0)} pass on the "
        f"pristine install and are the selection; {counts.get('failed', 0)} fail or error "
        f"without a mutant and {counts.get('skipped', 0)} skip. Pristine run: {seconds:.0f} s."
    )


def conformance_suites(
    module: str, mutants: tuple[Mutant, ...], options: dict[str, tuple[str, ...]] | None = None
) -> dict[str, tuple[str, ...]]:
    """``Engine.kit_suites`` for adapters run through ``--kv-impl``: on each adapter the
    mutants name (``module:Adapter``), every property of the kit on valid input, ci profile,
    with the adapter's ``options`` (where the draws aim, e.g. ``--kv-page=256``). The
    bad-input properties (``test_bad_*``) are left out: they judge refusals of bad input,
    which no mutant of valid-input code changes, and they cost minutes an adapter where they
    shrink the deviations docs/found-in-the-wild.md lists."""
    adapters = sorted({adapter for mutant in mutants for adapter in mutant.adapters})
    return {
        adapter: (
            "kvcheck/test_conformance.py",
            f"--kv-impl={module}:{adapter}",
            "--kv-profile=ci",
            "-knot test_bad_",
            *(options or {}).get(adapter, ()),
        )
        for adapter in adapters
    }


# --- the files under mutation -------------------------------------------------------------


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _block_end(lines: list[str], start: int, indent: str) -> int:
    """The index past the block opened at ``start`` (a def or class indented by ``indent``):
    the first line after it that is indented no deeper, but for the closing bracket of a
    signature spread over lines."""
    for i in range(start + 1, len(lines)):
        line = lines[i]
        if not line.strip():
            continue
        body = line.removeprefix(indent) if line.startswith(indent) else None
        if body is None or not (body[:1].isspace() or body.startswith((")", "]"))):
            return i
    return len(lines)


def locate(lines: list[str], mutant: Mutant) -> int:
    """The index of ``mutant.original`` inside ``mutant.where``; it must be there once (or
    at least ``nth`` + 1 times, with ``nth``)."""
    *owner, name = mutant.where.split(".")
    start, end, indent = 0, len(lines), ""
    if owner:
        classes = [i for i, line in enumerate(lines) if re.match(rf"class {owner[0]}\b", line)]
        if len(classes) != 1:
            raise LookupError(f"{mutant.id}: class {owner[0]} found {len(classes)} times")
        start, end, indent = classes[0], _block_end(lines, classes[0], ""), "    "
    defs = [i for i in range(start, end) if re.match(rf"{indent}def {name}\(", lines[i])]
    if len(defs) != 1:
        raise LookupError(f"{mutant.id}: {mutant.where} found {len(defs)} times")
    stop = _block_end(lines, defs[0], indent)
    hits = [i for i in range(defs[0], stop) if lines[i].strip() == mutant.original]
    if mutant.nth is not None and len(hits) > mutant.nth:
        hits = [hits[mutant.nth]]
    if len(hits) != 1:
        raise LookupError(
            f"{mutant.id}: the line {mutant.original!r} is in {mutant.where} {len(hits)} times, "
            f"not once: this is not the {mutant.file} the mutants were written for"
        )
    return hits[0]


def mutated(source: str, mutant: Mutant) -> str:
    lines = source.splitlines(keepends=True)
    index = locate(lines, mutant)
    line = lines[index]
    indent = line[: len(line) - len(line.lstrip())]
    lines[index] = indent + mutant.mutant + "\n"
    result = "".join(lines)
    if result == source:
        raise ValueError(f"{mutant.id}: the mutant is the original line")
    return result


def check_all(engine: Engine, package: Path) -> None:
    """Every mutant applies, once, to the installed file it names, and compiles."""
    for mutant in engine.mutants:
        compile(mutated((package / mutant.file).read_text(), mutant), mutant.file, "exec")


class Target:
    """The engine's files the test processes import, and how to put them back.

    ``overlay``: a private tree of symlinks to the installed package with its own copies of
    the files under mutation; the installed files are the pristine copies, never written.
    ``in place``: the installed files, each with a copy kept aside (``.yardstick-orig``)."""

    def __init__(self, engine: Engine, package: Path, work: Path, in_place: bool) -> None:
        self.engine, self.package, self.in_place = engine, package, in_place
        self.overlay = work / "overlay"
        self.pythonpath = [] if in_place else [str(self.overlay)]

    @property
    def base(self) -> Path:
        """The package directory the test processes import."""
        return self.package if self.in_place else self.overlay / self.package.name

    def live(self, file: str) -> Path:
        """The copy of ``file`` the test processes import."""
        return self.base / file

    def pristine(self, file: str) -> Path:
        installed = self.package / file
        return installed.with_name(installed.name + BACKUP_SUFFIX) if self.in_place else installed

    def prepare(self) -> None:
        for file, digest in self.engine.files.items():
            installed = self.package / file
            if sha256(installed) == digest:
                continue
            kept = self.pristine(file)
            if self.in_place and kept.exists() and sha256(kept) == digest:
                print(f"restoring {installed} from a copy left by an interrupted run")
                shutil.copy2(kept, installed)
            else:
                raise SystemExit(
                    f"{installed} is not {self.engine.package} {self.engine.version}'s "
                    f"(sha256 {sha256(installed)})"
                )
        if self.in_place:
            for file in self.engine.files:
                shutil.copy2(self.package / file, self.pristine(file))
        else:
            if self.overlay.exists():
                shutil.rmtree(self.overlay)
            for directory, subdirs, names in os.walk(self.package):
                subdirs[:] = [d for d in subdirs if d != "__pycache__"]
                mirror = (
                    self.overlay / self.package.name / Path(directory).relative_to(self.package)
                )
                mirror.mkdir(parents=True, exist_ok=True)
                for name in names:
                    if not name.endswith((".pyc", BACKUP_SUFFIX)):
                        (mirror / name).symlink_to(Path(directory) / name)
            for file in self.engine.files:
                self.live(file).unlink()
                shutil.copy2(self.package / file, self.live(file))
        self.check_pristine()

    def write(self, file: str, text: str, serial: int) -> None:
        path = self.live(file)
        path.write_text(text)
        # A modification time of its own for each content: no stale bytecode can be taken
        # for it (bytecode is checked by mtime and size).
        stamp = self.pristine(file).stat().st_mtime + 10 + serial
        os.utime(path, (stamp, stamp))

    def restore(self) -> None:
        for file in self.engine.files:
            shutil.copy2(self.pristine(file), self.live(file))

    def check_pristine(self) -> None:
        for file, digest in self.engine.files.items():
            if sha256(self.live(file)) != digest:
                raise RuntimeError(f"{self.live(file)} is not pristine after a restore")

    def finish(self) -> None:
        self.restore()
        self.check_pristine()
        if self.in_place:
            for file in self.engine.files:
                self.pristine(file).unlink()


# --- running tests -------------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    outcome: str  # "caught", "missed", "timeout", "error" (nothing ran), or "not run"
    seconds: float
    first_failure: str = ""
    tests: int = 0


def junit_outcomes(path: Path, cwd: Path) -> dict[str, str]:
    """pytest node id -> passed / failed / skipped, from a junit xml file of a run in ``cwd``.
    A case's classname is its module's dotted path then its classes: the longest prefix that
    is a file under ``cwd`` is the module (a case's ``file`` would name where the test is
    defined, which for an inherited one is not the module collected)."""
    outcomes: dict[str, str] = {}
    if not path.exists():
        return outcomes
    for case in ElementTree.parse(path).iter("testcase"):
        parts = case.get("classname", "").split(".")
        split = next(
            (
                k
                for k in range(len(parts), 0, -1)
                if (cwd / "/".join(parts[:k])).with_suffix(".py").is_file()
            ),
            None,
        )
        if split is None:
            continue  # not a test of a module (a collection error): judged by the outcomes left
        node = "::".join(["/".join(parts[:split]) + ".py", *parts[split:], case.get("name")])
        if case.find("failure") is not None or case.find("error") is not None:
            outcomes[node] = "failed"
        elif case.find("skipped") is not None:
            outcomes[node] = "skipped"
        else:
            outcomes[node] = "passed"
    return outcomes


def pytest(
    python: str,
    args: list[str],
    cwd: Path,
    env: dict[str, str],
    timeout: int,
    stop_first: bool,
) -> tuple[dict[str, str], float, bool, str]:
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        command = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly"]
        command += [f"--junitxml={xml}"]
        command += ["-x"] if stop_first else []
        start = time.perf_counter()
        try:
            done = subprocess.run(
                command + args, cwd=cwd, env=env, timeout=timeout, capture_output=True, text=True
            )
            timed_out, tail = False, done.stdout[-3000:] + done.stderr[-2000:]
        except subprocess.TimeoutExpired:
            timed_out, tail = True, ""
        return junit_outcomes(xml, cwd), time.perf_counter() - start, timed_out, tail


def judged(outcomes: dict[str, str], seconds: float, timed_out: bool, tail: str) -> Run:
    if timed_out:
        return Run("timeout", seconds)
    failed = [node for node, outcome in outcomes.items() if outcome == "failed"]
    if failed:
        return Run("caught", seconds, failed[0].split("::")[-1], len(outcomes))
    if not outcomes:
        return Run("error", seconds, tail.strip().splitlines()[-1] if tail.strip() else "")
    return Run("missed", seconds, "", len(outcomes))


class Suite:
    """A selection of tests: the ones of ``args`` that pass on the pristine install."""

    def __init__(self, python: str, args: tuple[str, ...], cwd: Path, env: dict[str, str]):
        self.python, self.args, self.cwd, self.env = python, list(args), cwd, env
        self.counts: dict[str, int] = {}
        self.passing: list[str] = []
        self.seconds = 0.0

    def baseline(self, timeout: int) -> None:
        outcomes, self.seconds, timed_out, tail = pytest(
            self.python, self.args, self.cwd, self.env, timeout, False
        )
        if timed_out or not outcomes:
            raise SystemExit(f"the pristine run of {self.args[:3]} did not complete:\n{tail}")
        for outcome in outcomes.values():
            self.counts[outcome] = self.counts.get(outcome, 0) + 1
        self.passing = sorted(node for node, outcome in outcomes.items() if outcome == "passed")

    def run(self, timeout: int) -> Run:
        options = [arg for arg in self.args if arg.startswith("-")]
        return judged(
            *pytest(self.python, options + self.passing, self.cwd, self.env, timeout, True)
        )


def kit_run(suites: dict[str, Suite], mutant: Mutant) -> Run:
    """The kit's selections on each adapter that reaches the mutant, until one catches it."""
    if not mutant.adapters:
        return Run("not run", 0.0, mutant.unreached or "no adapter reaches it")
    total = 0.0
    for adapter in mutant.adapters:
        run = suites[adapter].run(KIT_TIMEOUT)
        total += run.seconds
        if run.outcome in ("caught", "timeout", "error"):
            run.seconds = total
            run.first_failure = run.first_failure or f"{run.outcome} on {adapter}"
            return run
    return Run("missed", total)


def engine_tests(engine: Engine, source: Path | None, commit: str | None, work: Path) -> Path:
    """The engine's test files, copied out of its source tree (a directory, or a git
    directory at ``commit``) into ``work/engine-tests`` once, under a pytest.ini of their own
    (so that neither this repository's settings nor the engine's root conftest apply)."""
    directory = work / "engine-tests"
    if not engine.engine_tests:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "SOURCE").write_text("\n")
        return directory
    if all((directory / path).exists() for path in engine.engine_tests):
        return directory
    if source is None:
        raise SystemExit("the engine's tests are not extracted yet: give --engine-source")
    directory.mkdir(parents=True, exist_ok=True)
    if commit:
        archive = subprocess.run(
            ["git", f"--git-dir={source}", "archive", commit, *engine.engine_files],
            check=True,
            capture_output=True,
        ).stdout
        subprocess.run(["tar", "x", "-C", str(directory)], input=archive, check=True)
    else:
        for path in engine.engine_files:
            (directory / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source / path, directory / path)
    (directory / "pytest.ini").write_text("[pytest]\n")
    (directory / "SOURCE").write_text(f"{source} {commit or ''}".strip() + "\n")
    return directory


# --- the page ------------------------------------------------------------------------------


def verdict(engine: Run, kit: Run) -> str:
    e, k = engine.outcome in ("caught", "timeout"), kit.outcome in ("caught", "timeout")
    return {(True, True): "both", (True, False): "engine only", (False, True): "kit only"}.get(
        (e, k), "neither"
    )


def cell(run: Run) -> str:
    if run.outcome == "caught":
        return f"**caught** ({run.seconds:.0f} s): `{run.first_failure}`"
    if run.outcome == "timeout":
        return f"**caught** (timed out, {run.seconds:.0f} s)"
    if run.outcome == "missed":
        return f"missed ({run.seconds:.0f} s)"
    if run.outcome == "error":
        return f"error: {run.first_failure}"
    return f"not run: {run.first_failure}" if run.first_failure else "not run"


def link(engine: Engine, ref: str) -> str:
    """``kind/N`` on the engine's tracker, or ``owner/repo/kind/N`` on another project's."""
    *repo, kind, number = ref.split("/")
    if repo:
        return f"[{'/'.join(repo)}#{number}](https://github.com/{ref})"
    return f"[#{number}]({engine.tracker}{kind}/{number})"


def section(engine: Engine, results: list[dict], meta: dict) -> str:
    counts: dict[str, int] = {}
    for row in results:
        counts[row["verdict"]] = counts.get(row["verdict"], 0) + 1
    n = len(results)
    by_engine = sum(r["verdict"] in ("both", "engine only") for r in results)
    by_kit = sum(r["verdict"] in ("both", "kit only") for r in results)
    reached = [r for r in results if r["mutant"]["adapters"]]
    by_kit_reached = sum(r["verdict"] in ("both", "kit only") for r in reached)
    name = engine.name
    whose = f"{name}'" if name.endswith("s") else f"{name}'s"
    lines = [
        f"## {name}",
        "",
        f"Written by `{meta['command']}` on {meta['date']} ({name} {meta['version']}, "
        f"{meta['machine']}). Run time: {meta['total_seconds'] / 60:.1f} min.",
        "",
        "| | mutants |",
        "|---|---|",
        f"| caught by both | {counts.get('both', 0)} |",
        f"| caught by {whose} tests only | {counts.get('engine only', 0)} |",
        f"| caught by the kit only | {counts.get('kit only', 0)} |",
        f"| caught by neither | {counts.get('neither', 0)} |",
        f"| caught by {whose} tests | {by_engine} of {n} |",
        f"| caught by the kit | {by_kit} of {n} ({by_kit_reached} of the {len(reached)} "
        "in code an adapter reaches) |",
        "",
        f"**{whose} tests.** "
        + engine.engine_note(meta["engine_counts"], meta["engine_seconds"], meta["source"]),
        "",
        f"**The kit's selection.** {engine.kit_note} Pristine selections: "
        + "; ".join(
            f"{adapter} {passing} tests, {seconds:.0f} s"
            + (f", {failed} failing on the pristine install left out" if failed else "")
            for adapter, passing, failed, seconds in meta["kit_baseline"]
        )
        + ".",
        "",
        f"| id | where | mutant (one line) | inspired by | {whose} tests | kit | caught by |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in results:
        m = row["mutant"]
        diff = f"`{m['original']}` → `{m['mutant']}`".replace("|", "\\|")
        refs = ", ".join(link(engine, ref) for ref in m["inspired_by"])
        where = f"`{m['file']}` `{m['where']}`: {m['what']}"
        lines.append(
            f"| {m['id']} | {where} | {diff} | {refs} | {cell(Run(**row['engine']))} | "
            f"{cell(Run(**row['kit']))} | **{row['verdict']}** |"
        )
    lines += ["", *engine.notes]
    return "\n".join(lines)


INTRO = """# A mutation yardstick of the engines' cache code

<!-- Generated by tools/mutation_yardstick.py; edit the script, not this page. -->

How good is the kit at finding the bugs engines really have? Each mutant below puts ONE bug
into an engine's installed cache code, a line changed as the cited thread of the engine's
tracker shows such a bug or fixes one, not to fit the kit, in code the engine's adapter in
`kvimpl/` runs. For each, `tools/mutation_yardstick.py` runs the engine's own unit tests that
run offline on a CPU and the kit's properties on the adapters that reach the mutated code,
then puts the file back and checks its sha256. A selection is the tests that pass on the
pristine install; a mutant is caught when one of them fails, errors or times out.

Not in CI (see each run time): run it by hand after changing an adapter or the pinned engine,
with the command its section gives, in the engine's own venv (`--python`); `--only M01,M07`
runs a few (the section then holds those alone; `--work` and `--page` elsewhere keep this
one). The mutants go into a private overlay of the installed package (a tree of
symlinks with its own copies of the mutated files, first on `PYTHONPATH` of the test
processes), so that nobody sharing the environment imports one; `--in-place` patches the
installed files instead. The repository's tests check on every run of the extras stage that
each mutant still applies to the installed files (`--check`).
"""


def write_page(page: Path, name: str, text: str) -> None:
    """Replace the engine's section of the page, keep the others (in ENGINES' order)."""
    sections: dict[str, str] = {}
    if page.exists():
        for match in re.finditer(
            r"<!-- section: (\w+) -->\n(.*?)\n<!-- end: \1 -->", page.read_text(), re.DOTALL
        ):
            sections[match.group(1)] = match.group(2)
    sections[name] = text
    body = [
        f"<!-- section: {key} -->\n{sections[key]}\n<!-- end: {key} -->"
        for key in ENGINES
        if key in sections
    ]
    page.write_text(INTRO + "\n" + "\n\n".join(body) + "\n")


# --- main ----------------------------------------------------------------------------------


def load(name: str) -> Engine:
    tools = str(Path(__file__).resolve().parent)
    if tools not in sys.path:
        sys.path.insert(0, tools)
    return importlib.import_module(f"yardstick_{name}").ENGINE


def check_installed(name: str) -> Engine:
    """``--check`` in this process: every mutant of the engine applies to the files of the
    package this interpreter imports (the repository's tests call it)."""
    engine = load(name)
    where = path_env_package(engine)
    check_all(engine, where or Path(importlib.import_module(engine.package).__file__).parent)
    return engine


def path_env_package(engine: Engine) -> Path | None:
    """The package in the folder ``engine.path_env`` names, for an engine found that way."""
    if not engine.path_env:
        return None
    folder = os.environ.get(engine.path_env)
    if not folder:
        raise SystemExit(f"{engine.path_env} is not set: the folder holding {engine.package}/")
    return (Path(folder) / engine.package).resolve()


def installed_package(python: str, package: str) -> Path:
    code = f"import {package}, pathlib; print(pathlib.Path({package}.__file__).parent)"
    out = subprocess.run([python, "-c", code], check=True, capture_output=True, text=True)
    return Path(out.stdout.strip()).resolve()


def installed_version(python: str, package: str, env: dict[str, str], folder=None) -> str:
    if folder is not None:  # found through path_env: its dist-info beside it, not an import
        from importlib.metadata import distributions

        found = [d.version for d in distributions(name=package, path=[str(folder)])]
        code = "import torch; print(torch.__version__)"
        out = subprocess.run([python, "-c", code], check=True, capture_output=True, text=True)
        return f"{found[0] if found else 'unknown'}, torch {out.stdout.strip()}"
    code = f"import {package}, torch; print({package}.__version__, torch.__version__)"
    out = subprocess.run([python, "-c", code], env=env, check=True, capture_output=True, text=True)
    version, torch_version = out.stdout.split()
    return f"{version}, torch {torch_version}"


@contextlib.contextmanager
def sigterm_as_exit():
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("engine", choices=ENGINES)
    parser.add_argument("--python", default=sys.executable, help="the engine's venv's python")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "kv-yardstick")
    parser.add_argument("--engine-source", type=Path, help="its source tree, or a git dir")
    parser.add_argument("--engine-commit", help="with a git dir: the commit to read")
    parser.add_argument("--deps", type=Path, help="a pip --target dir the engine's tests need")
    parser.add_argument("--in-place", action="store_true")
    parser.add_argument("--only", help="comma-separated mutant ids")
    parser.add_argument("--page", type=Path, default=PAGE)
    parser.add_argument("--check", action="store_true", help="check the mutants apply; no runs")
    parser.add_argument(
        "--rewrite", action="store_true", help="rewrite the section from the last results"
    )
    args = parser.parse_args(argv)

    engine = load(args.engine)
    work = args.work / args.engine
    if args.rewrite:  # the page's prose changed, not the runs: no need to run them again
        saved = json.loads((work / "results.json").read_text())
        write_page(args.page, args.engine, section(engine, saved["results"], saved["meta"]))
        return 0
    package = path_env_package(engine) or installed_package(args.python, engine.package)
    if args.check:
        check_all(engine, package)
        print(f"all {len(engine.mutants)} mutants apply to {package}")
        return 0
    chosen = [m for m in engine.mutants if not args.only or m.id in args.only.split(",")]
    work.mkdir(parents=True, exist_ok=True)
    target = Target(engine, package, work, args.in_place)
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    pythonpath = target.pythonpath + ([str(args.deps)] if args.deps else [])
    env |= {"PYTHONPATH": os.pathsep.join(pythonpath), "PYTHONDONTWRITEBYTECODE": "1"}
    if engine.path_env:
        env[engine.path_env] = str(target.base.parent)
    engine_dir = engine_tests(engine, args.engine_source, args.engine_commit, work)

    started = time.perf_counter()
    results: list[dict] = []
    with sigterm_as_exit():
        target.prepare()
        try:
            check_all(engine, target.base)
            folder = package.parent if engine.path_env else None
            version = installed_version(args.python, engine.package, env, folder)
            kit_env = env | {"CI": "true"}  # the kit's ci profile
            adapters = sorted({a for m in chosen for a in m.adapters})
            kit = {a: Suite(args.python, engine.kit_suites[a], ROOT, kit_env) for a in adapters}
            tests = Suite(args.python, engine.engine_tests, engine_dir, env | engine.engine_env)
            print(f"pristine runs: the kit on {', '.join(adapters)}; the engine's tests")
            for suite in kit.values():
                suite.baseline(KIT_TIMEOUT)
            if engine.engine_tests:
                tests.baseline(ENGINE_TIMEOUT)
            for serial, mutant in enumerate(chosen):
                source = target.pristine(mutant.file).read_text()
                target.write(mutant.file, mutated(source, mutant), serial)
                try:
                    engine_run = (
                        tests.run(ENGINE_TIMEOUT)
                        if engine.engine_tests
                        else Run("not run", 0.0, engine.no_tests)
                    )
                    kit_result = kit_run(kit, mutant)
                finally:
                    target.restore()
                    target.check_pristine()
                row = {
                    "mutant": dataclasses.asdict(mutant),
                    "engine": dataclasses.asdict(engine_run),
                    "kit": dataclasses.asdict(kit_result),
                    "verdict": verdict(engine_run, kit_result),
                }
                results.append(row)
                print(
                    f"{mutant.id} {mutant.where}: engine {engine_run.outcome} "
                    f"({engine_run.seconds:.0f} s), kit {kit_result.outcome} "
                    f"({kit_result.seconds:.0f} s) -> {row['verdict']}",
                    flush=True,
                )
        finally:
            target.finish()

    meta = {
        "command": (f"{engine.path_env}=DIR " if engine.path_env else "")
        + f"python tools/mutation_yardstick.py {' '.join(argv or sys.argv[1:])}",
        "date": time.strftime("%Y-%m-%d"),
        "version": version,
        "machine": f"CPU only, {os.cpu_count()} cores shared with other work",
        "total_seconds": time.perf_counter() - started,
        "engine_counts": tests.counts,
        "engine_seconds": tests.seconds,
        "source": (engine_dir / "SOURCE").read_text().strip(),
        "kit_baseline": [
            [a, len(s.passing), s.counts.get("failed", 0), s.seconds] for a, s in kit.items()
        ],
    }
    write_page(args.page, args.engine, section(engine, results, meta))
    (work / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(f"wrote {args.page} ({meta['total_seconds'] / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
