"""The README's "Use it in your own repository", kept true: the worked example passes the
whole kit through a class of its own, and a user's broken cache, in a directory outside this
repository, fails by either route with a message that points at the bug and a verdict."""

import json

from examples.doubling_cache import DoublingCache
from kvcheck import CacheTests
from tests.pytest_run import run_pytest


class TestDoublingCache(CacheTests):
    factory = DoublingCache


NO_RESET = '''
from kvimpl.concat import ConcatCache

class NoReset(ConcatCache):
    """reset() forgets to empty the cache after the first time."""
    def reset(self):
        if not hasattr(self, "key"):
            super().reset()
'''
USER_TEST_FILE = """
from kvcheck import CacheTests
from users_cache import NoReset

class TestNoReset(CacheTests):
    factory = NoReset
"""
ONLY = ["-k", "length_invariants or bad_append_is and rank"]  # a few tests are enough here


def assert_caught(result, test_id: str) -> None:
    output = result.stdout + result.stderr
    assert result.returncode == 1, f"expected test failures:\n{output}"
    assert f"FAILED {test_id}" in result.stdout, output
    assert "tokens on fresh or reset caches; it must hold 0" in result.stdout, output
    assert "NoReset (users_cache:NoReset): 1 FAIL (1 of 2 pass)" in result.stdout, output
    assert "FAIL     lengths [data loss or corruption] (1 of 1 tests): layer 0: holds" in (
        result.stdout
    ), output


def test_a_users_broken_cache_fails_by_the_pyargs_route(tmp_path):
    (tmp_path / "users_cache.py").write_text(NO_RESET)
    report = tmp_path / "verdict.json"
    args = ["--pyargs", "kvcheck", "--kv-impl", "users_cache:NoReset", "--kv-report", str(report)]
    result = run_pytest(*args, *ONLY, "-n", "2", cwd=tmp_path, extra_path=tmp_path)
    assert_caught(result, "test_conformance.py::TestConformance::test_length_invariants[NoReset]")
    verdict = json.loads(report.read_text())["caches"]["NoReset"]
    assert verdict["properties"]["lengths"]["severity"] == "data loss or corruption", verdict
    assert verdict["properties"]["bad append"]["result"] == "pass", verdict


def test_a_users_broken_cache_fails_by_the_test_file_route(tmp_path):
    (tmp_path / "users_cache.py").write_text(NO_RESET)
    (tmp_path / "test_my_cache.py").write_text(USER_TEST_FILE)
    result = run_pytest(*ONLY, cwd=tmp_path, extra_path=tmp_path)
    # The class binds the factory, so its label is the factory's name, its name module:attr.
    assert_caught(result, "test_my_cache.py::TestNoReset::test_length_invariants[NoReset]")
