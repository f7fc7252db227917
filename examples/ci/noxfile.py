"""kvcache-verify's kit on your caches, the way CI runs it (docs/ci.md).

Copy this file to the root of your repository, beside your pyproject.toml, then::

    nox -s kit                                 # every push: the ci profile, verdict.json
    nox -s nightly                             # the thorough search, its examples kept
    nox -s exhaustive                          # every plan to each property's N tokens
    nox -s compare -- last.json verdict.json   # what changed; fails on a regression

``kit``, ``nightly`` and ``exhaustive`` install torch (a CPU build), then kvcache-verify, then
your package (this directory, where it has a pyproject.toml or setup.py), and run pytest on
your kit tests under pytest-xdist; what follows ``--`` goes to pytest (``-k logits``, ``-x``,
a path, a later ``--kv-profile`` that overrides the session's). ``compare`` reads two reports
and needs no torch. The environment variables, all optional:

``KVCHECK_TESTS``
    your kit tests, paths separated by spaces (default ``tests/``)
``KVCHECK_REPORT``
    where the verdict is written (default ``verdict.json``; removed first)
``KVCHECK_DATABASE``
    the example database (default the directory ``.kvcheck-examples``; a Redis URL works too,
    docs/search.md): ``nightly`` writes what it finds there, ``kit`` replays it first,
    read-only, where it exists
``KVCHECK_TORCH``
    what ``pip install`` is given for torch (default: the CPU build from PyTorch's index)
``KVCHECK_INSTALL``
    what ``pip install`` is given for the kit (default ``kvcache-verify``: a version pin, a
    wheel's path)
``KV_CONTRACT``
    the contract version your caches are held to (read by the kit itself; docs/using.md)
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import nox

nox.options.sessions = ["kit"]

TORCH = os.environ.get("KVCHECK_TORCH", "torch --index-url https://download.pytorch.org/whl/cpu")
KIT = os.environ.get("KVCHECK_INSTALL", "kvcache-verify")
TESTS = os.environ.get("KVCHECK_TESTS", "tests/")
REPORT = os.environ.get("KVCHECK_REPORT", "verdict.json")
DATABASE = os.environ.get("KVCHECK_DATABASE", ".kvcheck-examples")


def install(session: nox.Session) -> None:
    """torch first (else the kit's dependency on it pulls a CUDA build), the kit, yours."""
    session.install(*shlex.split(TORCH))
    session.install(*shlex.split(KIT))
    if Path("pyproject.toml").exists() or Path("setup.py").exists():
        session.install(".")


def run_kit(session: nox.Session, *options: str) -> None:
    # A report left by an earlier run must not pass for this run's: a run that stops before
    # its tests (a usage error, an import error) writes none.
    Path(REPORT).unlink(missing_ok=True)
    # python -m pytest: this directory is importable even where nothing was installed.
    session.run(
        "python",
        "-m",
        "pytest",
        "-n",
        "auto",
        *shlex.split(TESTS),
        "--kv-report",
        REPORT,
        *options,
        *session.posargs,
    )


@nox.session
def kit(session: nox.Session) -> None:
    """The kit at its ci profile (20 examples a property, derandomized), replaying first
    what the nightly job found, where its database is here."""
    install(session)
    replay = ["--kv-database", DATABASE, "--kv-database-read-only"]
    here = Path(DATABASE).is_dir() or "://" in DATABASE  # a directory, or a Redis URL
    run_kit(session, "--kv-profile", "ci", *(replay if here else []))


@nox.session
def nightly(session: nox.Session) -> None:
    """The thorough search (2,000 examples a property), writing what fails to the database
    (and deleting what no longer fails)."""
    install(session)
    run_kit(session, "--kv-profile", "thorough", "--kv-database", DATABASE)


@nox.session
def exhaustive(session: nox.Session) -> None:
    """The bounded-exhaustive mode (docs/exhaustive.md): every plan of up to each
    property's own N tokens, resuming where a run that was stopped left off (pytest's cache,
    ``.pytest_cache``, kept between runs)."""
    install(session)
    run_kit(session, "--kv-exhaustive", "auto", "--kv-exhaustive-resume")


@nox.session
def compare(session: nox.Session) -> None:
    """``python -m kvcheck.verdict OLD NEW``: prints what changed; fails on a regression."""
    if len(session.posargs) != 2:
        session.error("usage: nox -s compare -- OLD.json NEW.json")
    # Reading two reports needs pytest and the kit, not torch.
    session.install("pytest")
    session.install("--no-deps", *shlex.split(KIT))
    session.run("python", "-m", "kvcheck.verdict", *session.posargs)
