"""Property 1: cached logits equal uncached logits at every new position of every step."""

from hypothesis import example, given

from tests import checks as kvchk
from tests import scenarios as kvst


@given(scenario=kvst.scenarios())
@example(scenario=kvst.PINNED[0])
@example(scenario=kvst.PINNED[1])
@example(scenario=kvst.PINNED[2])
def test_logits_match_uncached(cache_factory, scenario):
    kvchk.check_logits_match_uncached(cache_factory, scenario)
