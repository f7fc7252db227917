"""The chunked cache at other chunk sizes: 1 (every token its own chunk) and small odd
sizes, so that the drawn chunk plans cross many boundaries in short sessions."""

import functools

import pytest
from hypothesis import given

from kvimpl import ChunkedCache
from tests import checks as kvchk
from tests import scenarios as kvst


@pytest.mark.parametrize("chunk_size", [1, 3, 5])
@given(scenario=kvst.scenarios(max_sessions=2))
def test_chunked_cache_at_any_chunk_size(chunk_size, scenario):
    factory = functools.partial(ChunkedCache, chunk_size=chunk_size)
    kvchk.check_lengths(factory, scenario)
    kvchk.check_logits_match_uncached(factory, scenario)


@pytest.mark.parametrize("chunk_size", [0, -1, 1.5, True])
def test_a_chunk_size_that_is_not_a_positive_int_is_refused(chunk_size):
    spec = kvst.PINNED[0].model().cache_spec(batch=1, max_length=4)
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        ChunkedCache(spec, chunk_size=chunk_size)
