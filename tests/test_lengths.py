"""Property 2: lengths grow by each chunk in every layer alike, and append returns exactly
the rows held: the new ones last, the earlier ones unchanged, nothing stale or unwritten."""

from hypothesis import given
from hypothesis import strategies as st

from tests import checks as kvchk
from tests import scenarios as kvst


@given(data=st.data())
def test_length_invariants(cache_factory, data):
    scenario = data.draw(kvst.scenarios(), label="scenario")
    kvchk.check_lengths(cache_factory, scenario)
