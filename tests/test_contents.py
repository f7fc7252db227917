"""Property 3: each layer holds the rotated keys and the values of the uncached pass."""

from hypothesis import given
from hypothesis import strategies as st

from tests import checks as kvchk
from tests import scenarios as kvst


@given(data=st.data())
def test_contents_equal_uncached_keys_and_values(cache_factory, data):
    scenario = data.draw(kvst.scenarios(), label="scenario")
    kvchk.check_contents(cache_factory, scenario)
