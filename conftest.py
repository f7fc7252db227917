"""Which caches are under test, Hypothesis profiles, and one torch thread per xdist worker.

Select caches with ``--kv-impl NAME`` (repeatable) or ``KV_IMPL=NAME,NAME``, where NAME is a
built-in (concat, preallocated, chunked) or any importable ``MODULE:ATTR`` factory. With
neither, every built-in is tested. A test asks for the ``cache_factory`` argument and is run
once per selected cache, with the cache's name in its id.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

import kvimpl

SELECTED = pytest.StashKey[dict[str, tuple[str, object]]]()  # test id -> (name, factory)

settings.register_profile("dev", max_examples=20, deadline=None)
settings.register_profile(
    "ci",
    max_examples=20,
    derandomize=True,
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("thorough", max_examples=2_000, deadline=None)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--kv-impl",
        action="append",
        default=[],
        metavar="NAME",
        help="cache to test: a built-in name or MODULE:ATTR (repeatable; default: every "
        "built-in; the KV_IMPL environment variable takes a comma-separated list)",
    )


def pytest_configure(config: pytest.Config) -> None:
    # One thread: the suite's tensors are tiny, and with xdist every core already runs a
    # worker. More threads only add synchronisation (measured: 5 ms vs 480 ms per forward).
    torch.set_num_threads(1)
    in_ci = os.environ.get("CI", "").lower() not in ("", "0", "false", "no")
    profile = config.getoption("--hypothesis-profile", None) or ("ci" if in_ci else "dev")
    settings.load_profile(profile)

    try:
        selected = kvimpl.select(config.getoption("--kv-impl"), os.environ.get("KV_IMPL"))
    except ValueError as error:
        raise pytest.UsageError(f"--kv-impl / KV_IMPL: {error}") from None
    config.stash[SELECTED] = selected


def pytest_report_header(config: pytest.Config) -> str:
    described = [
        label if label == name else f"{label} ({name})"
        for label, (name, _) in config.stash[SELECTED].items()
    ]
    return (
        f"kv caches under test: {', '.join(described)}; "
        f"hypothesis profile: {settings.get_current_profile_name()}"
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "cache_factory" in metafunc.fixturenames:
        selected = metafunc.config.stash[SELECTED]
        factories = [factory for _, factory in selected.values()]
        metafunc.parametrize("cache_factory", factories, ids=list(selected))
