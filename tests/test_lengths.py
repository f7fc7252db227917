"""Property 2: lengths grow by each chunk in every layer alike, and append returns exactly
the rows held: the new ones last, the earlier ones unchanged, nothing stale or unwritten."""

from hypothesis import example, given

from tests import checks as kvchk
from tests import scenarios as kvst


@given(scenario=kvst.scenarios())
@example(scenario=kvst.PINNED[0])
@example(scenario=kvst.PINNED[1])
@example(scenario=kvst.PINNED[2])
def test_length_invariants(cache_factory, scenario):
    kvchk.check_lengths(cache_factory, scenario)
