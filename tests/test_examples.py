"""The README's "Test your cache", kept true: the worked example passes the
whole kit through a class of its own, and a user's broken cache, in a directory outside this
repository, fails by either route with a message that points at the bug and a verdict."""

import json
from typing import ClassVar

import pytest
import torch
from hypothesis import settings

from examples.doubling_cache import DoublingCache
from kvcheck import CacheTests
from tests import depth
from tests.pytest_run import run_in_process, run_pytest

# Built on the kit's device (--kv-device): skipped where this machine lacks it.
pytestmark = pytest.mark.kv_device


class TestDoublingCache(CacheTests):
    factory = DoublingCache
    examples_scale = depth.pick(0.1, soak=1.0)  # tests/depth.py


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
# A test of the user's own, run beside the kit: its Hypothesis profile is left alone (in a
# process of its own: Hypothesis's, for CI or not; in this one, the profile loaded here).
HOST_TEST_FILE = """
from hypothesis import settings

def test_the_kit_leaves_my_hypothesis_profile_alone():
    assert settings.get_current_profile_name() in {names!r}
    assert settings().max_examples == {examples}
"""
ONLY = ["-k", "length_invariants or bad_append_is and rank or my_hypothesis"]


# In this process by default; in a process of its own under pytest-xdist in the soak tier
# (some 10 s: torch imported again, and the workers).
@pytest.mark.parametrize(
    "workers", [0, pytest.param(1, marks=[pytest.mark.soak, pytest.mark.long])]
)
def test_a_users_broken_cache_fails_by_either_route_with_a_verdict(pytester, workers):
    """Both routes in one run: the user's own test file, and the kit's package with
    --kv-impl; outside this repository, with the caches' module on the path."""
    here = pytester.path
    (here / "users_cache.py").write_text(NO_RESET)
    (here / "test_my_cache.py").write_text(USER_TEST_FILE)
    report = here / "verdict.json"
    args = ["test_my_cache.py", "test_host.py", "--pyargs", "kvcheck"]
    args += ["--kv-impl", "users_cache:NoReset", "--kv-report", str(report), *ONLY]
    if workers:
        host = HOST_TEST_FILE.format(names=("default", "ci"), examples=100)
        (here / "test_host.py").write_text(host)
        result = run_pytest("-n", str(workers), *args, cwd=here, extra_path=here)
    else:
        host = HOST_TEST_FILE.format(
            names=(settings.get_current_profile_name(),), examples=settings().max_examples
        )
        (here / "test_host.py").write_text(host)
        result = run_in_process(pytester, *args)
    output = result.stdout + result.stderr
    assert result.returncode == 1, f"expected test failures:\n{output}"
    for failed in (
        "test_my_cache.py::TestNoReset::test_length_invariants[NoReset]",
        "test_conformance.py::TestConformance::test_length_invariants[NoReset]",
    ):
        assert f"FAILED {failed}" in result.stdout, output
    assert "2 failed, 5 passed" in result.stdout, output  # the host's own test passed
    assert "tokens on fresh or reset caches; it must hold 0" in result.stdout, output
    header = "kv caches under test: NoReset (users_cache:NoReset); "
    if workers:  # the workers collect: their kit line opens the verdict
        verdict = result.stdout.split(" kv cache verdict ")[-1].splitlines()
        assert verdict[1].startswith(header), output
    else:  # after the count of tests collected
        lines = result.stdout.splitlines()
        collected = next(i for i, line in enumerate(lines) if line.startswith("collected"))
        assert lines[collected + 1].startswith(header), output
    # Only bad append's cases of a wrong rank ran (-k): partly run, not a pass.
    assert "NoReset (users_cache:NoReset): 1 FAIL (0 of 2 pass)" in result.stdout, output
    assert "FAIL         lengths [data loss or corruption] (2 of 2 tests): layer 0: holds" in (
        result.stdout
    ), output
    verdict = json.loads(report.read_text())["caches"]["NoReset"]["properties"]
    assert verdict["lengths"]["severity"] == "data loss or corruption", verdict
    bad_append = {"result": "partly run", "tests": 4, "failed": 0, "since": "1.0"}
    assert {key: verdict["bad append"][key] for key in bad_append} == bad_append, verdict
    assert verdict["bad append"]["cases"]["run"] == 4 < verdict["bad append"]["cases"]["of"]
    assert verdict["bad append"]["reached"], verdict  # the states it was tried on


def test_a_class_can_pin_its_own_regressions():
    """A user pastes a failure's `drawn=` into `pinned`; every run then tries it first."""
    from kvcheck import strategies as kvst
    from kvimpl import ConcatCache
    from kvref import ModelConfig

    config = ModelConfig(vocab_size=11, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4)
    pasted = kvst.Scenario(config, 1, torch.float64, (kvst.Session((7,), 1, "fresh"),), slack=70)
    built_for = []

    def factory(spec):
        built_for.append(spec.max_length)
        return ConcatCache(spec)

    class TestPinned(CacheTests):
        pinned: ClassVar = {"lengths": (pasted,)}
        examples_scale = 0.01  # one drawn example: the pinned one is what is looked for

    TestPinned().test_length_invariants(factory, kv_block=None)  # None: a search
    assert 77 in built_for, "the class's pinned scenario (max_length 77) was not run"
