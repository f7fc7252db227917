"""Property 5: bad input raises a clear error and changes nothing.

Each case of ``tests/badinput.py`` is applied to a state Hypothesis draws (a cache at a
random length; a model's caches after a random prefill, with a random layer made
inconsistent), then the caches are read back: same length, and the same rows, bit for bit.
"""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests import badinput as kvbad
from tests import scenarios as kvst


@pytest.mark.parametrize("case", kvbad.BAD_APPENDS, ids=str)
@given(plan=kvst.cache_plans(room=3), new_tokens=st.integers(1, 3))
def test_bad_append_is_rejected_and_changes_nothing(cache_factory, case, plan, new_tokens):
    kvbad.check_bad_append(cache_factory, case, plan, new_tokens)


@given(plan=kvst.cache_plans(), tokens_over=st.integers(1, 3))
def test_append_past_max_length_is_refused_or_held_exactly(cache_factory, plan, tokens_over):
    kvbad.check_overflow(cache_factory, plan, tokens_over)


@pytest.mark.parametrize("case", kvbad.BAD_CALLS, ids=str)
@given(plan=kvbad.model_plans())
def test_bad_model_call_is_rejected_before_any_cache_changes(cache_factory, case, plan):
    kvbad.check_bad_model_call(cache_factory, case, plan)
