"""Property 1: cached logits equal uncached logits at every new position of every step."""

from hypothesis import given
from hypothesis import strategies as st

from tests import checks as kvchk
from tests import scenarios as kvst


@given(data=st.data())
def test_logits_match_uncached(cache_factory, data):
    scenario = data.draw(kvst.scenarios(), label="scenario")
    kvchk.check_logits_match_uncached(cache_factory, scenario)
