"""Property 4: after reset() or on fresh caches, an unrelated prompt gives the uncached
model's logits, even when the session before left nan, inf, -inf or huge rows behind."""

from hypothesis import example, given

from tests import checks as kvchk
from tests import scenarios as kvst


@given(scenario=kvst.scenarios(min_sessions=2, poison=True))
@example(scenario=kvst.PINNED[0])
def test_poisoned_session_leaves_no_trace(cache_factory, scenario):
    kvchk.check_logits_match_uncached(cache_factory, scenario)
