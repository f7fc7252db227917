"""Run pytest in a subprocess, as a user would from their own directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_pytest(*args: str, cwd: Path = ROOT, extra_path: Path | None = None):
    """pytest in one process (no xdist unless asked), ci profile, no KV_IMPL from outside."""
    # Bytecode is written even where this shell says not to: each of these runs would else
    # compile the whole kit from source again (over a second each).
    dropped = ("KV_IMPL", "PYTEST_XDIST_WORKER", "PYTHONDONTWRITEBYTECODE")
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    env["CI"] = "true"
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(extra_path), env.get("PYTHONPATH")]))
    xdist = [] if "-n" in args else ["-p", "no:xdist"]
    command = [sys.executable, "-m", "pytest", *xdist, "-p", "no:cacheprovider", *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
