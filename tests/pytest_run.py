"""Run pytest as a user would, in a directory of its own: in a process of its own
(``run_pytest``), or in this one (``run_in_process``) where a fresh interpreter adds nothing.

A process of its own costs some 4 s (torch is imported again); it is needed where the check
is about the process itself: what a run imports, the host's Hypothesis profile, pytest-xdist.
Everything else about a run (its lines, its verdict, its errors) reads the same in this
process, at a tenth of the cost: the kit puts back the settings it applied when the run ends
(``kvcheck.plugin.prepare``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
# A run of this repository's tests may name caches from outside, and runs under xdist; a
# user's run started here sees neither.
DROPPED = ("KV_IMPL", "PYTEST_XDIST_WORKER")

# Imported before any run in this process, as a run's first failure would import it:
# pytester puts sys.modules back after each run, and torch's assert_close imports
# torch.distributed.tensor, whose operators a second import registers again, a crash ("Only
# a single TORCH_LIBRARY"). Once here, every run finds it imported.
torch.testing.assert_close(torch.zeros(1), torch.zeros(1))


def run_pytest(*args: str, cwd: Path = ROOT, extra_path: Path | None = None):
    """pytest in one process (no xdist unless asked), ci profile, no KV_IMPL from outside."""
    # Bytecode is written even where this shell says not to: each of these runs would else
    # compile the whole kit from source again (over a second each).
    env = {k: v for k, v in os.environ.items() if k not in (*DROPPED, "PYTHONDONTWRITEBYTECODE")}
    env["CI"] = "true"
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(extra_path), env.get("PYTHONPATH")]))
    xdist = [] if "-n" in args else ["-p", "no:xdist"]
    command = [sys.executable, "-m", "pytest", *xdist, "-p", "no:cacheprovider", *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def run_in_process(pytester: pytest.Pytester, *args: str) -> subprocess.CompletedProcess:
    """pytest in this process, from ``pytester.path`` (where the test writes its files), as
    ``run_pytest`` runs it: no xdist, ci profile, nothing named from outside; the result in
    the same shape."""
    with pytest.MonkeyPatch.context() as patch:
        for name in DROPPED:
            patch.delenv(name, raising=False)
        patch.setenv("CI", "true")
        # The kit's modules are imported already: too late to rewrite, as pytest warns.
        quiet = ["-W", "ignore::pytest.PytestAssertRewriteWarning"]
        result = pytester.runpytest_inprocess(
            "-p", "no:xdist", "-p", "no:cacheprovider", *quiet, *args
        )
    return subprocess.CompletedProcess(
        args, int(result.ret), "\n".join(result.outlines), "\n".join(result.errlines)
    )
