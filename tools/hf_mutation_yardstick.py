"""A mutation yardstick of transformers' own cache code: which one-bug mutants of the layer
classes in ``transformers/cache_utils.py`` transformers' own unit tests catch, and which the
kit catches through the adapters of ``kvimpl/hf.py``.

Each mutant replaces ONE line of ``cache_utils.py`` (transformers 5.24.0, checked by hash) in a
method the adapters reach, written as transformers' tracker shows such bugs (each cites the
thread it follows), not to fit the kit. For each mutant the script

1. writes the mutant (the original line must be where it says, once, or the script stops),
2. runs (a) a fixed, short selection of the kit's properties that reach the mutated method, on
   the adapters that reach it (ci profile, stop at the first failure), and (b) the offline CPU
   tests of transformers' ``tests/utils/test_cache_utils.py`` that pass on the pristine file,
3. puts the original file back (``try``/``finally``; SIGTERM is turned into an exception so
   that it restores too), and checks its hash.

Before any mutant it checks that the file is pristine (its hash is the pinned 5.24.0 one; a
copy left by an interrupted in-place run is put back first) and runs both selections on the
pristine file: a test that fails there is dropped from the selection, and said so.

Where the mutants go: by default into a PRIVATE overlay of the installed package (a tree of
symlinks to the installed ``transformers`` with its own copy of ``cache_utils.py``, first on
``PYTHONPATH`` of the test processes only), so that nobody else using the same environment
ever imports a mutant. ``--in-place`` patches the installed file itself, as a plain yardstick
would; use it only on an environment of your own.

The engine's tests: transformers' sdist carries no ``tests/utils``, so they come from a git
checkout of transformers (``--transformers-git DIR --engine-commit REV``; the commit used is
recorded on the page), extracted once into ``--work``. They need ``parameterized``, which the
kit's environment lacks: ``--deps DIR`` is put on their ``PYTHONPATH`` (``pip install --target
DIR parameterized``). Writes ``docs/yardstick.md`` (``--page``) and the raw results as JSON
beside the work directory.

    python tools/hf_mutation_yardstick.py --transformers-git /path/to/transformers/.git \\
        --engine-commit c7e57f79348480f73d3ef0ad8c47f807ef1378c8 --deps /tmp/kv-yardstick/deps

``--only M01,M07`` runs some mutants (the page is then written for those alone), ``--check``
only checks that every mutant applies to the installed file (what the repository's test does).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTED_WITH = "5.24.0"
# sha256 of transformers 5.24.0's src/transformers/cache_utils.py (the wheel's and the sdist's)
PRISTINE_SHA256 = "29651e0d89cc34d1af4b7d5d7f2c5dd81b584c8c5336f15652218640ea8465e5"
BACKUP_SUFFIX = ".yardstick-orig"
TRACKER = "https://github.com/huggingface/transformers/"

# The kit's properties, by the group of operations they reach.
VALID = ("test_length_invariants", "test_logits_match_uncached")
TRUNCATE = (
    "test_rollbacks_and_rewinds_act_on_the_history_left",
    "test_truncates_and_reorders_mixed_act_on_the_history_left",
)
REORDER = ("test_reorders_act_on_the_permuted_histories",)
RESET = ("test_rows_from_before_a_reset_never_come_back",)

KIT_TIMEOUT = 900
ENGINE_TIMEOUT = 600


@dataclasses.dataclass(frozen=True)
class Mutant:
    id: str
    where: str  # "Class.method": the original line is searched for inside that method only
    original: str  # the line, without its indentation
    mutant: str
    what: str
    inspired_by: tuple[str, ...]  # "issues/N" or "pull/N" of huggingface/transformers
    kit: tuple[tuple[str, tuple[str, ...]], ...]  # (adapter of kvimpl.hf, properties)


MUTANTS = (
    Mutant(
        "M01",
        "DynamicLayer.crop",
        "self.keys = self.keys[..., : -abs(tokens_to_remove), :]",
        "self.keys = self.keys[..., : self.keys.shape[-2] - abs(tokens_to_remove) + 1, :]",
        "crop keeps one key too many",
        ("issues/47433", "pull/36616"),
        (("HFDynamicLayer", TRUNCATE),),
    ),
    Mutant(
        "M02",
        "DynamicLayer.crop",
        "self.values = self.values[..., : -abs(tokens_to_remove), :]",
        "self.values = self.values",
        "crop cuts the keys only",
        ("issues/47433",),
        (("HFDynamicLayer", TRUNCATE),),
    ),
    Mutant(
        "M03",
        "DynamicLayer.crop",
        "if tokens_to_remove == 0 or not self.is_initialized:",
        "if tokens_to_remove >= -1 or not self.is_initialized:",
        "a crop of one token is taken for crop(0) and does nothing",
        ("pull/47720", "pull/36616"),
        (("HFDynamicLayer", TRUNCATE),),
    ),
    Mutant(
        "M04",
        "DynamicLayer.update",
        "self.values = torch.cat([self.values, value_states], dim=-2)",
        "self.values = torch.cat([value_states, self.values], dim=-2)",
        "update puts the new values before the old ones",
        ("issues/37574",),
        (("HFDynamicLayer", VALID),),
    ),
    Mutant(
        "M05",
        "DynamicLayer.batch_repeat_interleave",
        "self.keys = self.keys.repeat_interleave(repeats, dim=0)",
        "self.keys = self.keys.repeat(repeats, 1, 1, 1)",
        "batch_repeat_interleave tiles the keys instead of interleaving them",
        ("pull/36083",),
        (("HFDynamicLayerExpand", REORDER),),
    ),
    Mutant(
        "M06",
        "DynamicLayer.batch_select_indices",
        "self.values = self.values[indices, ...]",
        "self.values = self.values",
        "batch_select_indices selects the keys only",
        ("pull/20213",),
        (("HFDynamicLayerSelect", REORDER),),
    ),
    Mutant(
        "M07",
        "CacheLayerMixin.reorder_cache",
        "self.values = self.values.index_select(0, beam_idx.to(self.values.device))",
        "self.values = self.values",
        "reorder_cache reorders the keys only",
        ("issues/46612", "pull/48700"),
        (("HFDynamicLayer", REORDER), ("HFStaticLayer", REORDER)),
    ),
    Mutant(
        "M08",
        "CacheLayerMixin.reorder_cache",
        "if self.get_seq_length() > 0:",
        "if self.get_seq_length() > 1:",
        "reorder_cache skips a cache holding one token",
        ("issues/46612",),
        (("HFDynamicLayer", REORDER),),
    ),
    Mutant(
        "M09",
        "StaticLayer.update",
        "cache_position = torch.arange(kv_length, device=self.device) + self.cumulative_length",
        "cache_position = torch.arange(1, kv_length + 1, device=self.device)"
        " + self.cumulative_length",
        "update writes one slot late (cache_position off by one)",
        ("issues/30400", "pull/44181"),
        (("HFStaticLayer", VALID),),
    ),
    Mutant(
        "M10",
        "StaticLayer.update",
        "self.cumulative_length.add_(kv_length)",
        "self.cumulative_length.add_(1)",
        "cumulative_length counts updates, not tokens",
        ("pull/46446", "pull/35299"),
        (("HFStaticLayer", VALID),),
    ),
    Mutant(
        "M11",
        "StaticLayer.update",
        "self.values.index_copy_(2, cache_position, value_states)",
        "self.values.index_copy_(2, cache_position, key_states)",
        "update writes the keys into the value buffer",
        ("pull/30476",),
        (("HFStaticLayer", VALID),),
    ),
    Mutant(
        "M12",
        "StaticLayer.lazy_initialization",
        "(self.batch_size, self.num_heads, self.max_cache_len, self.k_head_dim),",
        "(self.batch_size, self.num_heads, self.max_cache_len - 1, self.k_head_dim),",
        "the key buffer is one row short of max_cache_len",
        ("pull/32932",),
        (("HFStaticLayer", VALID),),
    ),
    Mutant(
        "M13",
        "StaticLayer.get_seq_length",
        "return self.cumulative_length if self.is_initialized else 0",
        "return self.keys[0, 0].any(dim=-1).sum() if self.is_initialized else 0",
        "get_seq_length counts the non-zero rows (the pre-4.42 way)",
        ("issues/30377",),
        (("HFStaticLayer", VALID + RESET),),
    ),
    Mutant(
        "M14",
        "StaticLayer.crop",
        "self.cumulative_length.sub_(abs(tokens_to_remove))",
        "self.cumulative_length.sub_(abs(tokens_to_remove) - 1)",
        "crop keeps one token too many",
        ("pull/45745",),
        (("HFStaticLayer", TRUNCATE),),
    ),
    Mutant(
        "M15",
        "StaticLayer.crop",
        "if tokens_to_remove > 0:",
        "if tokens_to_remove >= 0:",
        "crop(0) is refused",
        ("pull/47720",),
        (("HFStaticLayer", TRUNCATE),),
    ),
    Mutant(
        "M16",
        "DynamicSlidingWindowLayer.update",
        "self.keys = full_key_states[:, :, -self.sliding_window + 1 :, :]",
        "self.keys = full_key_states[:, :, -self.sliding_window + 2 :, :]",
        "the window trims a key one token early",
        ("issues/37574", "pull/38046"),
        (("HFDynamicSlidingWindowLayer", VALID),),
    ),
    Mutant(
        "M17",
        "DynamicSlidingWindowLayer.update",
        "self.cumulative_length += key_states.shape[-2]",
        "self.cumulative_length += 1",
        "cumulative_length counts updates, not tokens",
        ("pull/35299",),
        (("HFDynamicSlidingWindowLayer", VALID),),
    ),
    Mutant(
        "M18",
        "DynamicSlidingWindowLayer.get_seq_length",
        "return self.cumulative_length",
        "return self.keys.shape[-2] if self.is_initialized else 0",
        "get_seq_length returns the rows held, never more than the window",
        ("pull/38156", "pull/34352"),
        (("HFDynamicSlidingWindowLayer", VALID),),
    ),
    Mutant(
        "M19",
        "DynamicSlidingWindowLayer.update",
        "num_visible = self.sliding_window - 1 + key_states.shape[-2]",
        "num_visible = self.sliding_window - 2 + key_states.shape[-2]",
        "while recording the past, update returns one row too few",
        ("pull/47447",),
        (("HFDynamicSlidingWindowLayerRecording", VALID),),
    ),
    Mutant(
        "M20",
        "DynamicSlidingWindowLayer.crop",
        "self.keys = self.keys[:, :, -self.sliding_window + 1 - tokens_to_remove"
        " : -tokens_to_remove, :]",
        "self.keys = self.keys[:, :, -self.sliding_window + 2 - tokens_to_remove"
        " : -tokens_to_remove, :]",
        "crop past the window keeps one key too few",
        ("pull/47447",),
        (("HFDynamicSlidingWindowLayerRecording", TRUNCATE),),
    ),
    Mutant(
        "M21",
        "DynamicSlidingWindowLayer.crop",
        "self.cumulative_length = self.keys.shape[-2]",
        "self.cumulative_length = self.cumulative_length",
        "crop within the window leaves the length as it was",
        ("issues/47433",),
        (("HFDynamicSlidingWindowLayerRecording", TRUNCATE),),
    ),
    Mutant(
        "M22",
        "StaticSlidingWindowLayer.update",
        "is_full = current_length >= self.max_cache_len",
        "is_full = current_length > self.max_cache_len",
        "the buffer counts as full one token late (strict inequality)",
        ("pull/38046", "issues/37574"),
        (("HFStaticSlidingWindowLayer", VALID),),
    ),
    Mutant(
        "M23",
        "StaticSlidingWindowLayer.update",
        "new_keys = self.keys.roll(-1, dims=-2)",
        "new_keys = self.keys.roll(1, dims=-2)",
        "a full buffer rolls its keys the wrong way",
        ("pull/30970",),
        (("HFStaticSlidingWindowLayer", VALID),),
    ),
    Mutant(
        "M24",
        "StaticSlidingWindowLayer.update",
        "full_key_states = torch.cat((self.keys[:, :, 1:, :], key_states), dim=-2)",
        "full_key_states = torch.cat((self.keys[:, :, 2:, :], key_states), dim=-2)",
        "several tokens onto a full buffer drop one key too many",
        ("pull/40893",),
        (("HFStaticSlidingWindowLayer", VALID),),
    ),
    Mutant(
        "M25",
        "StaticSlidingWindowLayer.reset",
        "self.cumulative_length_int = 0",
        "self.cumulative_length_int = self.cumulative_length_int",
        "reset leaves the python-int length as it was",
        ("pull/48809", "pull/48509"),
        (("HFStaticSlidingWindowLayer", RESET),),
    ),
    Mutant(
        "M26",
        "StaticSlidingWindowLayer.crop",
        "self.cumulative_length_int -= abs(tokens_to_remove)",
        "self.cumulative_length_int -= abs(tokens_to_remove) - 1",
        "crop keeps one token too many in the python-int length",
        ("pull/45745",),
        (),  # no adapter offers this crop (kvimpl/hf.py: is_croppable is False there)
    ),
    Mutant(
        "M27",
        "CacheLayerMixin.offload",
        'self.values = self.values.to("cpu", non_blocking=True)',
        'self.values = self.keys.to("cpu", non_blocking=True)',
        "offload moves the keys into the values",
        ("pull/46748",),
        (("HFDynamicLayerOffloaded", VALID),),
    ),
)


# --- the file under mutation -------------------------------------------------------------


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def locate(lines: list[str], mutant: Mutant) -> int:
    """The index of ``mutant.original`` inside method ``mutant.where``; it must be there once."""
    cls, method = mutant.where.split(".")
    starts = [i for i, line in enumerate(lines) if line.startswith(f"class {cls}(")]
    if len(starts) != 1:
        raise LookupError(f"{mutant.id}: class {cls} found {len(starts)} times")
    end = next(
        (i for i in range(starts[0] + 1, len(lines)) if lines[i].startswith("class ")),
        len(lines),
    )
    defs = [
        i
        for i in range(starts[0], end)
        if lines[i].lstrip().startswith(f"def {method}(") and lines[i].startswith("    def ")
    ]
    if len(defs) != 1:
        raise LookupError(f"{mutant.id}: {mutant.where} found {len(defs)} times")
    stop = next(
        (i for i in range(defs[0] + 1, end) if lines[i].startswith(("    def ", "    @"))),
        end,
    )
    hits = [i for i in range(defs[0], stop) if lines[i].strip() == mutant.original]
    if len(hits) != 1:
        raise LookupError(
            f"{mutant.id}: the line {mutant.original!r} is in {mutant.where} {len(hits)} times, "
            "not once: this is not the cache_utils.py the mutants were written for"
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


def check_all(source: str) -> None:
    for mutant in MUTANTS:
        mutated(source, mutant)
        compile(mutated(source, mutant), "cache_utils.py", "exec")


class Target:
    """The cache_utils.py the test processes import, and how to put it back.

    ``overlay``: a private tree of symlinks to the installed package with its own copy of
    cache_utils.py; the installed file is the pristine copy and is never written.
    ``in place``: the installed file, with a copy kept aside (``.yardstick-orig``)."""

    def __init__(self, installed: Path, work: Path, in_place: bool) -> None:
        self.installed = installed
        self.in_place = in_place
        if in_place:
            self.path = installed
            self.pristine = installed.with_name(installed.name + BACKUP_SUFFIX)
            self.pythonpath: list[str] = []
        else:
            self.overlay = work / "overlay"
            self.path = self.overlay / "transformers" / "cache_utils.py"
            self.pristine = installed
            self.pythonpath = [str(self.overlay)]

    def prepare(self) -> None:
        if self.in_place:
            if sha256(self.installed) != PRISTINE_SHA256:
                if self.pristine.exists() and sha256(self.pristine) == PRISTINE_SHA256:
                    print(f"restoring {self.installed} from a copy left by an interrupted run")
                    shutil.copy2(self.pristine, self.installed)
                else:
                    raise SystemExit(
                        f"{self.installed} is not transformers {TESTED_WITH}'s cache_utils.py "
                        f"(sha256 {sha256(self.installed)}), and no pristine copy is kept aside"
                    )
            shutil.copy2(self.installed, self.pristine)
        else:
            if sha256(self.installed) != PRISTINE_SHA256:
                raise SystemExit(
                    f"{self.installed} is not transformers {TESTED_WITH}'s cache_utils.py "
                    f"(sha256 {sha256(self.installed)})"
                )
            package = self.installed.parent
            if self.overlay.exists():
                shutil.rmtree(self.overlay)
            for directory, subdirs, files in os.walk(package):
                subdirs[:] = [d for d in subdirs if d != "__pycache__"]
                mirror = self.overlay / "transformers" / Path(directory).relative_to(package)
                mirror.mkdir(parents=True, exist_ok=True)
                for name in files:
                    if name.endswith((".pyc", BACKUP_SUFFIX)):
                        continue
                    (mirror / name).symlink_to(Path(directory) / name)
            self.path.unlink()
            shutil.copy2(self.installed, self.path)
        self.check_pristine()

    def write(self, text: str, serial: int) -> None:
        self.path.write_text(text)
        # A modification time of its own for each content: no stale bytecode can be taken
        # for it (bytecode is checked by mtime and size).
        stamp = self.pristine.stat().st_mtime + 10 + serial
        os.utime(self.path, (stamp, stamp))

    def restore(self) -> None:
        shutil.copy2(self.pristine, self.path)

    def check_pristine(self) -> None:
        if sha256(self.path) != PRISTINE_SHA256:
            raise RuntimeError(f"{self.path} is not pristine after a restore")

    def finish(self) -> None:
        self.restore()
        self.check_pristine()
        if self.in_place:
            self.pristine.unlink()


# --- running tests -----------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    outcome: str  # "caught", "missed", "timeout", "error" (nothing ran), or "not run"
    seconds: float
    first_failure: str = ""
    tests: int = 0


def junit_outcomes(path: Path) -> dict[str, str]:
    """test id -> passed / failed / skipped, from a junit xml file."""
    outcomes: dict[str, str] = {}
    if not path.exists():
        return outcomes
    for case in ElementTree.parse(path).iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            outcomes[name] = "failed"
        elif case.find("skipped") is not None:
            outcomes[name] = "skipped"
        else:
            outcomes[name] = "passed"
    return outcomes


def pytest(
    python: str, args: list[str], cwd: Path, env: dict[str, str], timeout: int, stop_first: bool
) -> tuple[dict[str, str], float, bool, str]:
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        command = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}"]
        command += ["-x"] if stop_first else []
        start = time.perf_counter()
        try:
            done = subprocess.run(
                command + args, cwd=cwd, env=env, timeout=timeout, capture_output=True, text=True
            )
            timed_out, tail = False, done.stdout[-3000:] + done.stderr[-2000:]
        except subprocess.TimeoutExpired:
            timed_out, tail = True, ""
        return junit_outcomes(xml), time.perf_counter() - start, timed_out, tail


def judged(outcomes: dict[str, str], seconds: float, timed_out: bool, tail: str) -> Run:
    if timed_out:
        return Run("timeout", seconds)
    failed = [name for name, outcome in outcomes.items() if outcome == "failed"]
    if failed:
        return Run("caught", seconds, failed[0].split("::")[-1], len(outcomes))
    if not outcomes:
        return Run("error", seconds, tail.strip().splitlines()[-1] if tail.strip() else "")
    return Run("missed", seconds, "", len(outcomes))


class Kit:
    """The kit's properties on the adapters of kvimpl/hf.py, ci profile."""

    def __init__(self, python: str, env: dict[str, str]) -> None:
        self.python = python
        self.env = env | {"CI": "true"}
        self.selected: dict[tuple[str, str], bool] = {}  # (adapter, property): passes pristine

    def node(self, adapter: str, prop: str) -> str:
        return f"{ROOT / 'kvcheck' / 'test_conformance.py'}::TestConformance::{prop}[{adapter}]"

    def args(self, adapter: str, props: list[str]) -> list[str]:
        return [f"--kv-impl=kvimpl.hf:{adapter}", "--kv-profile=ci"] + [
            self.node(adapter, prop) for prop in props
        ]

    def baseline(self, pairs: set[tuple[str, str]]) -> dict[str, float]:
        times: dict[str, float] = {}
        for adapter in sorted({a for a, _ in pairs}):
            props = sorted(p for a, p in pairs if a == adapter)
            outcomes, seconds, timed_out, _ = pytest(
                self.python, self.args(adapter, props), ROOT, self.env, KIT_TIMEOUT, False
            )
            times[adapter] = seconds
            for prop in props:
                key = f"kvcheck.test_conformance.TestConformance::{prop}[{adapter}]"
                self.selected[adapter, prop] = not timed_out and outcomes.get(key) == "passed"
        return times

    def run(self, mutant: Mutant) -> Run:
        if not mutant.kit:
            return Run("not run", 0.0, "no adapter reaches it")
        total, runs = 0.0, []
        for adapter, props in mutant.kit:
            kept = [p for p in props if self.selected.get((adapter, p))]
            if not kept:
                continue
            run = judged(
                *pytest(self.python, self.args(adapter, kept), ROOT, self.env, KIT_TIMEOUT, True)
            )
            total += run.seconds
            if run.outcome in ("caught", "timeout"):
                run.seconds = total
                run.first_failure = run.first_failure or f"{adapter}: timed out"
                return run
            runs.append(run)
        if not runs:
            return Run("not run", 0.0, "its selection fails on the pristine file")
        errors = [r for r in runs if r.outcome == "error"]
        return Run(
            "error" if errors else "missed", total, errors[0].first_failure if errors else ""
        )


class Engine:
    """transformers' tests/utils/test_cache_utils.py, offline, on the CPU."""

    FILE = "tests/utils/test_cache_utils.py"

    def __init__(self, python: str, env: dict[str, str], directory: Path | None) -> None:
        self.python = python
        self.env = env | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "CI": "true"}
        self.directory = directory
        self.counts: dict[str, int] = {}
        self.passing: list[str] = []

    def baseline(self) -> float:
        if self.directory is None:
            return 0.0
        outcomes, seconds, _, tail = pytest(
            self.python, ["-rA", self.FILE], self.directory, self.env, ENGINE_TIMEOUT, False
        )
        if not outcomes:
            raise SystemExit(f"transformers' tests did not run:\n{tail}")
        for outcome in outcomes.values():
            self.counts[outcome] = self.counts.get(outcome, 0) + 1
        self.passing = sorted(name for name, outcome in outcomes.items() if outcome == "passed")
        return seconds

    def node(self, name: str) -> str:
        classname, test = name.split("::")
        return f"{self.FILE}::{classname.rsplit('.', 1)[-1]}::{test}"

    def run(self, mutant: Mutant) -> Run:
        if self.directory is None or not self.passing:
            return Run("not run", 0.0)
        args = [self.node(name) for name in self.passing]
        return judged(*pytest(self.python, args, self.directory, self.env, ENGINE_TIMEOUT, True))


def engine_tests(args: argparse.Namespace) -> Path | None:
    directory = args.work / "engine-tests"
    if (directory / Engine.FILE).exists():
        return directory
    if args.transformers_git is None:
        return None
    directory.mkdir(parents=True, exist_ok=True)
    paths = ["tests/__init__.py", "tests/utils/__init__.py", Engine.FILE]
    archive = subprocess.run(
        ["git", f"--git-dir={args.transformers_git}", "archive", args.engine_commit, *paths],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "x", "-C", str(directory)], input=archive, check=True)
    # An empty pytest.ini: the file runs under its own rootdir, not under this repository's
    # settings, and without transformers' root conftest (which needs its whole test tree).
    (directory / "pytest.ini").write_text("[pytest]\n")
    (directory / "SOURCE").write_text(f"{args.transformers_git} {args.engine_commit}\n")
    return directory


# --- the page ----------------------------------------------------------------------------


def link(ref: str) -> str:
    kind, number = ref.split("/")
    return f"[#{number}]({TRACKER}{kind}/{number})"


def cell(run: Run) -> str:
    if run.outcome == "caught":
        return f"**caught** ({run.seconds:.0f} s): `{run.first_failure}`"
    if run.outcome == "timeout":
        return f"**caught** (timed out, {run.seconds:.0f} s)"
    if run.outcome == "missed":
        return f"missed ({run.seconds:.0f} s)"
    if run.outcome == "error":
        return f"error: {run.first_failure}"
    return f"not run{': ' + run.first_failure if run.first_failure else ''}"


def verdict(engine: Run, kit: Run) -> str:
    e, k = engine.outcome in ("caught", "timeout"), kit.outcome in ("caught", "timeout")
    return {(True, True): "both", (True, False): "engine only", (False, True): "kit only"}.get(
        (e, k), "neither"
    )


def page(results: list[dict], meta: dict) -> str:
    counts: dict[str, int] = {}
    for row in results:
        counts[row["verdict"]] = counts.get(row["verdict"], 0) + 1
    n = len(results)
    engine_caught = sum(r["verdict"] in ("both", "engine only") for r in results)
    kit_caught = sum(r["verdict"] in ("both", "kit only") for r in results)
    lines = [
        "# A mutation yardstick of transformers' cache layers",
        "",
        "<!-- Generated by tools/hf_mutation_yardstick.py; edit the script, not this page. -->",
        "",
        f"Written by `{meta['command']}` on {meta['date']} "
        f"(transformers {meta['transformers']}, torch {meta['torch']}, CPU only; "
        f"{meta['machine']}). Total run time: {meta['total_seconds'] / 60:.1f} min.",
        "",
        "Each mutant replaces one line of transformers' installed `cache_utils.py` (5.24.0, "
        "checked by its sha256) in a layer method that the adapters of `kvimpl/hf.py` reach, "
        "written as the bug the cited thread of transformers' tracker shows or fixes, not to "
        "fit the kit. For each, the script runs transformers' own offline CPU tests of the "
        "cache and a fixed, short selection of the kit's properties that reach the mutated "
        "method (ci profile), each stopping at its first failure, then puts the original file "
        "back and checks its hash. The mutants go into a private overlay of the package (a "
        "tree of symlinks with its own copy of `cache_utils.py`, first on `PYTHONPATH` of the "
        "test processes), so that nobody sharing the environment imports one; `--in-place` "
        "patches the installed file instead.",
        "",
        "## Summary",
        "",
        "| | mutants |",
        "|---|---|",
        f"| caught by both | {counts.get('both', 0)} |",
        f"| caught by transformers' tests only | {counts.get('engine only', 0)} |",
        f"| caught by the kit only | {counts.get('kit only', 0)} |",
        f"| caught by neither | {counts.get('neither', 0)} |",
        f"| caught by transformers' tests | {engine_caught} of {n} |",
        f"| caught by the kit | {kit_caught} of {n} |",
        "",
        "## The engine's tests",
        "",
        meta["engine_note"],
        "",
        "## The kit's selection",
        "",
        meta["kit_note"],
        "",
        "## Per mutant",
        "",
        "| id | where | mutant (one line) | inspired by | transformers' tests | kit | caught by |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in results:
        m = row["mutant"]
        diff = f"`{m['original']}` → `{m['mutant']}`".replace("|", "\\|")
        refs = ", ".join(link(ref) for ref in m["inspired_by"])
        adapters = ", ".join(a for a, _ in m["kit"]) or "none"
        lines.append(
            f"| {m['id']} | `{m['where']}`: {m['what']} | {diff} | {refs} | "
            f"{cell(Run(**row['engine']))} | {cell(Run(**row['kit']))} ({adapters}) | "
            f"**{row['verdict']}** |"
        )
    lines += ["", "## Notes", "", *meta["notes"], ""]
    return "\n".join(lines)


# --- main --------------------------------------------------------------------------------


def installed_cache_utils(python: str) -> Path:
    out = subprocess.run(
        [python, "-c", "import transformers.cache_utils as c; print(c.__file__)"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    return Path(out).resolve()


def versions(python: str, env: dict[str, str]) -> dict[str, str]:
    code = "import transformers, torch; print(transformers.__version__, torch.__version__)"
    out = subprocess.run([python, "-c", code], env=env, check=True, capture_output=True, text=True)
    transformers_version, torch_version = out.stdout.split()
    return {"transformers": transformers_version, "torch": torch_version}


@contextlib.contextmanager
def sigterm_as_exit():
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "kv-yardstick")
    parser.add_argument("--transformers-git", type=Path)
    parser.add_argument("--engine-commit", default="c7e57f79348480f73d3ef0ad8c47f807ef1378c8")
    parser.add_argument("--deps", type=Path, help="a --target dir holding parameterized")
    parser.add_argument("--in-place", action="store_true")
    parser.add_argument("--only", help="comma-separated mutant ids")
    parser.add_argument("--page", type=Path, default=ROOT / "docs" / "yardstick.md")
    parser.add_argument("--check", action="store_true", help="check the mutants apply; no runs")
    args = parser.parse_args(argv)

    installed = installed_cache_utils(args.python)
    if args.check:
        check_all(installed.read_text())
        print(f"all {len(MUTANTS)} mutants apply to {installed}")
        return 0
    chosen = [m for m in MUTANTS if not args.only or m.id in args.only.split(",")]
    args.work.mkdir(parents=True, exist_ok=True)
    target = Target(installed, args.work, args.in_place)
    pythonpath = target.pythonpath + ([str(args.deps)] if args.deps else [])
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env |= {"PYTHONPATH": os.pathsep.join(pythonpath), "PYTHONDONTWRITEBYTECODE": "1"}

    started = time.perf_counter()
    results: list[dict] = []
    with sigterm_as_exit():
        target.prepare()
        try:
            check_all(target.path.read_text())
            meta = versions(args.python, env)
            kit = Kit(args.python, env)
            engine = Engine(args.python, env, engine_tests(args))
            pairs = {(a, p) for m in chosen for a, props in m.kit for p in props}
            print(f"baseline: {len(pairs)} kit selections, transformers' tests")
            kit_baseline = kit.baseline(pairs)
            engine_baseline = engine.baseline()
            for serial, mutant in enumerate(chosen):
                target.write(mutated(target.pristine.read_text(), mutant), serial)
                try:
                    engine_run = engine.run(mutant)
                    kit_run = kit.run(mutant)
                finally:
                    target.restore()
                    target.check_pristine()
                row = {
                    "mutant": dataclasses.asdict(mutant),
                    "engine": dataclasses.asdict(engine_run),
                    "kit": dataclasses.asdict(kit_run),
                    "verdict": verdict(engine_run, kit_run),
                }
                results.append(row)
                print(
                    f"{mutant.id} {mutant.where}: engine {engine_run.outcome} "
                    f"({engine_run.seconds:.0f} s), kit {kit_run.outcome} "
                    f"({kit_run.seconds:.0f} s) -> {row['verdict']}",
                    flush=True,
                )
        finally:
            target.finish()

    total = time.perf_counter() - started
    dropped = sorted(f"{p}[{a}]" for (a, p), ok in kit.selected.items() if not ok)
    counts = engine.counts
    if engine.directory is None:
        engine_note = (
            "Not run: no checkout of transformers' tests was given (`--transformers-git`)."
        )
    else:
        source = (engine.directory / "SOURCE").read_text().split()
        engine_note = (
            f"`{Engine.FILE}` of transformers at commit `{source[-1]}` "
            f"(upstream main of 2026-08-10, 5.16.0.dev0: the nearest to v5.24.0 that could be "
            f"fetched here, see the notes), run against the installed 5.24.0 with the Hub "
            f"offline (`HF_HUB_OFFLINE=1`) on the CPU. Of its {sum(counts.values())} tests, "
            f"{counts.get('passed', 0)} pass on the pristine file and are the selection; "
            f"{counts.get('skipped', 0)} skip (an accelerator needed, or skipped by the file "
            f"itself) and {counts.get('failed', 0)} fail or error without a mutant (models and "
            f"tokenizers from the Hub, `torch.export`, and the positive `crop` 5.18 removed). "
            f"Pristine run: {engine_baseline:.0f} s."
        )
    kit_note = (
        "Per mutant, on the adapters whose layer runs the mutated line: "
        f"`{', '.join(VALID)}` for `update`, `lazy_initialization`, `get_seq_length` and "
        f"`offload`; `{', '.join(TRUNCATE)}` for `crop`; `{', '.join(REORDER)}` for "
        f"`reorder_cache`, `batch_select_indices` and `batch_repeat_interleave`; "
        f"`{', '.join(RESET)}` for `reset` (the table names the adapters). Pristine run of "
        f"each adapter's selection: "
        + ", ".join(f"{a} {s:.0f} s" for a, s in sorted(kit_baseline.items()))
        + ". "
        + (
            f"Dropped because they fail on the pristine file: {', '.join(dropped)}."
            if dropped
            else "Every selected property passes on the pristine file."
        )
    )
    meta |= {
        "command": "python tools/hf_mutation_yardstick.py " + " ".join(argv or sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()} cores shared with other work",
        "total_seconds": total,
        "engine_note": engine_note,
        "kit_note": kit_note,
        "notes": NOTES,
    }
    args.page.write_text(page(results, meta))
    (args.work / "results.json").write_text(
        json.dumps({"meta": meta, "results": results}, indent=1)
    )
    print(f"wrote {args.page} ({total / 60:.1f} min)")
    return 0


NOTES = [
    "- **Too long for CI** as a whole (see the total above): run it by hand after changing "
    "`kvimpl/hf.py` or the pinned transformers, with the command above; `--only M01,M07` runs "
    "a few. `tests/test_found_in_the_wild.py` checks on every run that each mutant still "
    "applies to the installed file (`--check`).",
    "- **Where the engine's tests come from.** transformers' sdist of 5.24.0 ships only the "
    "top-level test mixins, not `tests/utils`, and the repository's snapshot is too large to "
    "fetch here (1.3 GB), so v5.24.0's own tag could not be read. The file comes from a fork "
    "that carries upstream main up to 2026-08-10 (`rwkv-rs/transformers-rwkv`, commit "
    "`c7e57f79`, 5.16.0.dev0). Its model-level generation tests (`tests/models/*`, "
    "`tests/generation/test_utils.py`) do not import against 5.24.0's `testing_utils`, so "
    "they are not in the selection either; the model tests would reach the layers through "
    "`generate` (beam search, assisted decoding), and may catch some of the mutants the "
    "unit tests miss.",
    "- **What counts as caught**: a test of the selection fails or errors, or the run times "
    "out. A mutant that only breaks a test that already fails on the pristine file counts as "
    "missed.",
    "- **Mutants the kit cannot see, by what they are** (not by chance of the draw): M13 "
    "counts a row as held when it is not all zeros, which no row the kit draws is, and which "
    "only an all-zero embedding (#30377) shows. M22 makes a buffer that is exactly full take "
    'the "becoming full" branch once: the rows it returns are all right, one more than '
    "transformers' own mask then expects (`get_mask_sizes` still says full), so the contract "
    "accepts them (rule 7 allows more rows) while a model would fail on the mask's shape; the "
    "adapters do not go through the mask. M26 mutates a method no adapter offers "
    "(`StaticSlidingWindowLayer.crop`: the layer's `is_croppable` is False whenever its "
    "window is shorter than the cache, and `kvimpl/hf.py` offers no `truncate` there).",
    "- **A mutant the kit could see but did not draw**: M08 (no reorder of a cache holding "
    "one token): the reorder property's 20 ci examples hold more than one token whenever "
    "they reorder. A dev or thorough run may draw it.",
    "- **The recording sliding layer's rollbacks** fail on the pristine file (a defect, "
    "docs/found-in-the-wild.md), so that adapter's `crop` is judged by the mixed truncate "
    "and reorder property alone.",
]


if __name__ == "__main__":
    raise SystemExit(main())
