"""Attention computed block by block (``kvimpl.blockwise``) by the paged and chunked caches,
against the reference attention: blocks the window skips or cuts, chunks of queries that
start, end or straddle a block, grouped-query heads, and scores past exp's overflow."""

import functools

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from kvimpl import ChunkedCache, PagedPool
from kvref import ModelConfig, ReferenceTransformer, attention
from tests.test_paged import BLOCK, fill, rows, spec_of

BLOCK_CACHES = {
    "paged": PagedPool(BLOCK, 1000),
    "chunked": functools.partial(ChunkedCache, chunk_size=BLOCK),
}
CASES = st.tuples(
    st.integers(1, 3 * BLOCK + 1),  # rows before the attend
    st.integers(1, 2 * BLOCK + 1),  # rows of the attend
    st.sampled_from((None, 1, 2, BLOCK, BLOCK + 1, 3 * BLOCK)),  # window
    st.sampled_from((1, 2, 3)),  # query heads per kv head
)


@pytest.mark.parametrize("name", BLOCK_CACHES)
@given(case=CASES, large=st.booleans())
@example(case=(BLOCK, BLOCK, None, 1), large=False)  # the attend starts a new block
@example(case=(BLOCK - 1, 2, BLOCK, 2), large=False)  # it ends one and starts the next
@example(case=(2 * BLOCK + 1, 1, 1, 1), large=True)  # sees its own key only, scores ~1e4
def test_attend_equals_the_reference_attention_across_block_boundaries(name, case, large):
    before, new, window, group = case
    spec = spec_of(window=window)
    cache = BLOCK_CACHES[name](spec)
    history = fill(cache, before, seed=0)
    scale = 100.0 if large else 1.0  # past exp's overflow unless the running max is kept
    key, value = scale * rows(spec, new, seed=1), rows(spec, new, seed=2)
    query = scale * rows(spec_of(kv_heads=2 * group), new, seed=3)
    out = cache.attend(query, key, value)
    keys, values = torch.cat((history[0], key), 2), torch.cat((history[1], value), 2)
    positions = torch.arange(before, before + new)
    expected = attention(query, keys, values, positions, torch.arange(before + new), window)
    assert (out.shape, out.dtype) == (query.shape, query.dtype)
    torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-9)
    assert cache.length == before + new


@pytest.mark.parametrize("name", BLOCK_CACHES)
@pytest.mark.parametrize("window", [None, 3])
def test_the_model_decoding_through_attend_matches_the_uncached_model(name, window):
    config = ModelConfig(11, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4, window=window)
    model = ReferenceTransformer(config, dtype=torch.float64)
    tokens = torch.randint(11, (2, 3 * BLOCK + 2), generator=torch.Generator().manual_seed(0))
    caches = model.new_caches(BLOCK_CACHES[name], batch=2, max_length=tokens.shape[1])
    expected = model(tokens)
    got = [model(tokens[:, : BLOCK + 1], caches)]
    got += [model(tokens[:, step : step + 1], caches) for step in range(BLOCK + 1, tokens.shape[1])]
    torch.testing.assert_close(torch.cat(got, dim=1), expected, rtol=1e-9, atol=1e-9)
