"""The README's "Adding a cache" section, kept true: the worked example passes the core
properties, bad input and memory accounting, and a cache with a bug, named from outside the
project, fails with a message that points at the bug."""

from hypothesis import given
from hypothesis import strategies as st

from examples.doubling_cache import DoublingCache
from tests import badinput as kvbad
from tests import checks as kvchk
from tests import scenarios as kvst
from tests.test_selection import run_pytest

NO_RESET = '''
from kvimpl.concat import ConcatCache

class NoReset(ConcatCache):
    """reset() forgets to empty the cache after the first time."""
    def reset(self):
        if not hasattr(self, "key"):
            super().reset()
'''


@given(scenario=kvst.scenarios())
def test_the_worked_example_matches_the_uncached_model(scenario):
    kvchk.check_logits_match_uncached(DoublingCache, scenario)
    kvchk.check_lengths(DoublingCache, scenario)


@given(plan=kvst.cache_plans(room=3), new_tokens=st.integers(1, 3))
def test_the_worked_example_refuses_bad_input_and_counts_its_bytes(plan, new_tokens):
    kvbad.check_every_bad_append(DoublingCache, plan, new_tokens)
    kvbad.check_overflow(DoublingCache, plan, new_tokens)
    kvchk.check_nbytes(DoublingCache, plan)


def test_a_users_broken_cache_fails_with_a_message_that_points_at_the_bug(tmp_path):
    (tmp_path / "users_cache.py").write_text(NO_RESET)
    result = run_pytest(
        "-q", "tests/test_lengths.py", "--kv-impl", "users_cache:NoReset", extra_path=tmp_path
    )
    assert result.returncode == 1, f"expected test failures:\n{result.stdout}{result.stderr}"
    assert "FAILED tests/test_lengths.py::test_length_invariants[NoReset]" in result.stdout
    assert "at the start of a session on reset caches; it must hold 0" in result.stdout, (
        result.stdout
    )
