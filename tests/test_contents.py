"""Property 3: each layer holds the rotated keys and the values of the uncached pass."""

from hypothesis import example, given

from tests import checks as kvchk
from tests import scenarios as kvst


@given(scenario=kvst.scenarios())
@example(scenario=kvst.PINNED[0])
@example(scenario=kvst.PINNED[1])
@example(scenario=kvst.PINNED[2])
def test_contents_equal_uncached_keys_and_values(cache_factory, scenario):
    kvchk.check_contents(cache_factory, scenario)
