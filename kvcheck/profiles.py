"""How the kit's tests run: their Hypothesis settings and torch threads, chosen per run.

The kit never loads a Hypothesis profile or sets torch's threads for the process that hosts
it (a user's own tests keep theirs); each kit test takes these while it runs. Choose with
``--kv-profile``: by default ``ci`` where Hypothesis detects a CI service (and ``CI`` is not
``0``, ``false`` or ``no``), else ``dev``; and with ``--kv-torch-threads`` (default 1).
``--kv-database`` names where the searches keep the examples that failed (``kvcheck.database``;
with none named, each profile's own: Hypothesis's default, none in ``ci``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from hypothesis import HealthCheck, settings

# Built on Hypothesis's own "default" profile, not on whatever is loaded when this is
# imported (with CI set, Hypothesis has already loaded its "ci" profile by then).
_BASE = settings.get_profile("default")
PROFILES = {
    "dev": settings(_BASE, max_examples=20, deadline=None, derandomize=False),
    "ci": settings(
        _BASE,
        max_examples=20,
        derandomize=True,
        deadline=None,
        database=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow],
    ),
    "thorough": settings(_BASE, max_examples=2_000, deadline=None, derandomize=False),
}
_chosen: list[str] = []  # set once per run by the plugin
# The suite's tensors are tiny: more threads only add synchronisation (measured: 5 ms vs
# 480 ms per forward of the small model with 2 threads, each core already running a worker).
_threads: list[int | None] = [1]  # None: leave torch's setting as it is
# The run's example database (--kv-database), built by the plugin: none, each profile's own.
_database: list = []
# The key of the test running now (kvcheck.database.key_of), set by the plugin around each
# kit test's call: its examples are kept apart from every other test's.
_test_key: list[bytes] = []


def default_name() -> str:
    # Hypothesis takes any value of CI (or a CI vendor's variables) as CI; CI=false is not.
    in_ci = settings.get_current_profile_name() == "ci" or bool(os.environ.get("CI"))
    return "ci" if in_ci and os.environ.get("CI", "").lower() not in ("0", "false", "no") else "dev"


def choose(name: str | None) -> str:
    if name is not None and name not in PROFILES:
        raise ValueError(f"unknown kit profile {name!r}; choose one of {', '.join(PROFILES)}")
    _chosen[:] = [name or default_name()]
    return _chosen[0]


def current_name() -> str:
    return _chosen[0] if _chosen else default_name()


def current() -> settings:
    """The kit's settings for this run, with the verbosity Hypothesis was given, and the
    database named for the run (``--kv-database``; else the profile's own), keyed by the
    test running now: every property searches through one function of the kit, and
    Hypothesis keys examples by the function."""
    chosen = settings(PROFILES[current_name()], verbosity=settings.default.verbosity)
    database = _database[0] if _database else chosen.database
    if _test_key and database is not None:
        from kvcheck.database import Keyed

        database = Keyed(database, _test_key[0])
    return settings(chosen, database=database)


def choose_database(database) -> None:
    """The run's example database (a Hypothesis ``ExampleDatabase``), or None: each
    profile's own."""
    _database[:] = [] if database is None else [database]


def choose_threads(value: str | None) -> None:
    if value in (None, "keep"):
        _threads[:] = [1 if value is None else None]
        return
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{value!r} is not a positive number of threads or 'keep'")
    _threads[:] = [int(value)]


@contextmanager
def torch_threads() -> Iterator[None]:
    """The kit's torch threads while a kit test runs, then the host's again."""
    wanted, before = _threads[0], torch.get_num_threads()
    if wanted is None or wanted == before:
        yield
        return
    torch.set_num_threads(wanted)
    try:
        yield
    finally:
        torch.set_num_threads(before)
