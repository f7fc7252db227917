"""Choosing the caches under test: built-in names, MODULE:ATTR, --kv-impl and KV_IMPL."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvimpl

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = "examples.doubling_cache:DoublingCache"


def run_pytest(*args: str, extra_path: Path | None = None):
    """Run pytest on this project in a subprocess: one process, derandomized, no KV_IMPL."""
    env = {k: v for k, v in os.environ.items() if k not in ("KV_IMPL", "PYTEST_XDIST_WORKER")}
    env["CI"] = "true"
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(extra_path), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", *args]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_builtin_names_resolve_to_the_registry():
    for name, factory in kvimpl.CACHES.items():
        assert kvimpl.load_factory(name) is factory, f"{name!r} does not give CACHES[{name!r}]"


def test_module_attr_resolves_to_the_object():
    from examples.doubling_cache import DoublingCache

    assert kvimpl.load_factory(EXAMPLE) is DoublingCache


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("no_such_module:Cache", "cannot import module 'no_such_module'"),
        ("kvimpl.concat:NoSuchCache", "has no attribute 'NoSuchCache'"),
        ("kvimpl:CACHES", "not a callable"),
        ("concatenated", "neither a built-in cache"),
        ("kvimpl.concat:", "neither a built-in cache"),
    ],
)
def test_a_bad_name_is_refused_with_the_reason(name, reason):
    with pytest.raises(ValueError, match=reason) as raised:
        kvimpl.load_factory(name)
    assert repr(name) in str(raised.value), f"the error does not name {name!r}: {raised.value}"


def test_labels_are_short_unless_two_names_clash():
    names = ["concat", "a.b:Cache", "c.d:Cache", "e:Other"]
    labels = [kvimpl.cache_label(name, names) for name in names]
    assert labels == ["concat", "a.b:Cache", "c.d:Cache", "Other"], labels


def test_with_no_names_every_builtin_is_selected():
    assert kvimpl.select([], None) == {name: (name, f) for name, f in kvimpl.CACHES.items()}
    assert list(kvimpl.select([], " , ")) == list(kvimpl.CACHES), "blank KV_IMPL means none given"


def test_kv_impl_is_comma_separated_and_the_option_wins_over_it():
    from_env = kvimpl.select([], f"concat, {EXAMPLE}")
    assert list(from_env) == ["concat", "DoublingCache"], from_env
    assert list(kvimpl.select(["chunked"], "concat")) == ["chunked"], "--kv-impl must win"


def test_the_run_header_and_test_ids_name_the_caches():
    result = run_pytest(
        "--collect-only", "tests/test_logits.py", "--kv-impl", "chunked", "--kv-impl", EXAMPLE
    )
    assert result.returncode == 0, result.stdout + result.stderr
    header = f"kv caches under test: chunked, DoublingCache ({EXAMPLE}); hypothesis profile: ci"
    assert header in result.stdout, result.stdout
    tests = [line.strip() for line in result.stdout.splitlines() if "<Function" in line]
    assert tests == [
        "<Function test_logits_match_uncached[chunked]>",
        "<Function test_logits_match_uncached[DoublingCache]>",
    ], result.stdout


def test_an_unimportable_name_stops_the_run_with_one_line():
    result = run_pytest("--collect-only", "tests/test_logits.py", "--kv-impl", "nope.mod:Cache")
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert errors == [
        "ERROR: --kv-impl / KV_IMPL: 'nope.mod:Cache': cannot import module 'nope.mod': "
        "ModuleNotFoundError: No module named 'nope'"
    ], result.stderr
