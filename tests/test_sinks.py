"""Attention sinks (docs/contract.md, section 8.5): the reference model's sink mask against
attention written out query by query, the built-in ``streaming`` against the uncached model
with its memory bounded, and the declaration a cache makes. The kit's property, ``attention
sinks``, is in kvcheck/properties/sinks.py."""

import math

import pytest
import torch

from kvcheck import Domain
from kvimpl import StreamingCache, WindowCache
from kvref import CacheSpec, ModelConfig, ReferenceTransformer
from kvref.protocol import kept_rows, rows_needed
from kvref.rope import apply_rope


def test_kept_rows_are_the_sinks_then_the_most_recent():
    assert kept_rows(0, 3, 10) == [7, 8, 9]
    assert kept_rows(2, 5, 10) == [0, 1, 7, 8, 9]
    assert kept_rows(4, 3, 3) == [0, 1, 2]  # a session shorter than its sinks
    assert kept_rows(2, 10, 10) == list(range(10))
    assert rows_needed(3, 10, 1, sinks=2) == 2 + 2 + 1
    assert rows_needed(3, 4, 1, sinks=2) == 4


def sink_attention_by_hand(model: ReferenceTransformer, tokens: torch.Tensor) -> torch.Tensor:
    """Layer 0's attention output, each query over exactly the keys it may see, each key
    rotated where the query sees it: at its own position, or, with the sinks' positions in
    the cache (StreamingLLM), sink j at j + max(0, p - W + 1 - S), just before the window."""
    c, layer = model.config, model.blocks[0]
    x = layer.attention_norm(model.embedding(tokens))
    attention = layer.attention
    batch, length, _ = x.shape
    q = attention.query(x).view(batch, length, c.num_heads, c.head_dim).transpose(1, 2)
    k = attention.key(x).view(batch, length, c.num_kv_heads, c.head_dim).transpose(1, 2)
    v = attention.value(x).view(batch, length, c.num_kv_heads, c.head_dim).transpose(1, 2)
    out = torch.empty_like(q)
    for p in range(length):
        seen = sorted({*range(min(c.sinks, p + 1)), *range(max(0, p - c.window + 1), p + 1)})
        gap = max(0, p - c.window + 1 - c.sinks) if c.sink_positions == "in cache" else 0
        at = torch.tensor([j + gap if j < c.sinks else j for j in seen])
        keys = apply_rope(k[:, :, seen], at, c.rope_base)
        query = apply_rope(q[:, :, p : p + 1], torch.tensor([p]), c.rope_base)
        scores = query @ keys.transpose(-2, -1) / math.sqrt(c.head_dim)
        out[:, :, p : p + 1] = scores.softmax(-1) @ v[:, :, seen]
    return out


@pytest.mark.parametrize("positions", ["original", "in cache"])
@pytest.mark.parametrize(("sinks", "window"), [(1, 1), (4, 3), (2, 7)])
def test_the_sink_mask_is_the_sinks_and_the_window(sinks, window, positions):
    config = ModelConfig(num_layers=1, window=window, sinks=sinks, sink_positions=positions)
    model = ReferenceTransformer(config)
    seeded = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config.vocab_size, (2, 17), generator=seeded)
    captured = {}
    out = model.blocks[0].attention.out
    handle = out.register_forward_hook(lambda module, args, result: captured.update(x=args[0]))
    try:
        model(tokens)
    finally:
        handle.remove()
    by_hand = sink_attention_by_hand(model, tokens)
    torch.testing.assert_close(captured["x"], by_hand.transpose(1, 2).reshape(2, 17, -1))


def test_sinks_at_their_positions_in_the_cache_change_what_a_query_computes():
    # Else the convention would be a name: past the window's first wrap the two differ.
    seeded = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 64, (1, 20), generator=seeded)
    logits = [
        ReferenceTransformer(ModelConfig(window=3, sinks=2, sink_positions=positions))(tokens)
        for positions in ("original", "in cache")
    ]
    torch.testing.assert_close(logits[0][:, :5], logits[1][:, :5])  # no gap yet
    assert not torch.allclose(logits[0][:, 6:], logits[1][:, 6:])


@pytest.mark.parametrize("sinks", [0, 1, 4])
@pytest.mark.parametrize("window", [1, 3, 17])
def test_streaming_equals_the_uncached_sink_model_with_memory_bounded(sinks, window):
    config = ModelConfig(num_layers=2, window=window, sinks=sinks, window_layers="alternate")
    model = ReferenceTransformer(config)
    tokens = torch.randint(
        0, config.vocab_size, (2, 60), generator=torch.Generator().manual_seed(2)
    )
    caches = model.new_caches(StreamingCache, batch=2, max_length=8)  # streams past max_length
    chunks, start = [], 0
    for size in (5, 1, 1, 9, 1, 2, 16, 1, 1, 23):
        chunks.append(model(tokens[:, start : start + size], caches=caches))
        start += size
    torch.testing.assert_close(torch.cat(chunks, 1), model(tokens), rtol=1e-12, atol=1e-12)
    spec = model.cache_spec(2, 8, layer=0)
    row = 2 * 2 * spec.kv_heads * spec.head_dim * 8  # keys and values, float64
    assert caches[0].nbytes <= (sinks + window - 1 + 23) * row  # the largest append was 23


def test_sinks_survive_a_rollback_and_the_ring_refuses_one_past_what_it_holds():
    spec = CacheSpec(1, 1, 2, 16, torch.float64, torch.device("cpu"), window=2, sinks=2)
    cache = StreamingCache(spec)
    rows = torch.arange(20.0, dtype=torch.float64).view(1, 1, 10, 2)
    for index in range(10):  # one at a time: a ring of 2 slots past the sinks, wrapped often
        cache.append(rows[:, :, index : index + 1], rows[:, :, index : index + 1])
    cache.truncate(9)  # the query at 9 needs 8 and the sinks: all held
    keys, _ = cache.append(rows[:, :, 9:], rows[:, :, 9:])
    assert torch.equal(keys, rows[:, :, [0, 1, 8, 9]])
    with pytest.raises(ValueError, match="truncate"):
        cache.truncate(5)  # the query at 5 needs 4, long overwritten
    assert cache.length == 10


def test_a_window_cache_declares_no_sinks_and_sink_declarations_are_checked():
    assert Domain().sink_counts == (0,)
    assert not Domain().offers_sinks
    assert not hasattr(WindowCache, "kv_sizes")
    assert Domain.of(StreamingCache.kv_sizes["supports"]).offers_sinks
    for bad in ((1, 4), (-1, 0), (0, True)):
        with pytest.raises(ValueError, match="sinks"):
            Domain(sinks=bad)
    with pytest.raises(ValueError, match="windows is False"):
        Domain(sinks=(0, 1), windows=False)
    spec = CacheSpec(1, 1, 2, 8, torch.float32, torch.device("cpu"), window=4, sinks=2)
    assert "2 attention sinks" in Domain(sinks=(0, 1)).refuses(spec)
    with pytest.raises(ValueError, match="sinks need a window"):
        CacheSpec(1, 1, 2, 8, torch.float32, torch.device("cpu"), sinks=2)
    with pytest.raises(ValueError, match="sinks need a window"):
        ModelConfig(sinks=1)


class _CountsAttends(StreamingCache):
    calls = 0

    def attend(self, query, key, value):
        type(self).calls += 1
        return super().attend(query, key, value)


@pytest.mark.parametrize("sink_positions", ["original", "in cache"])
def test_streaming_attends_itself_where_its_sinks_sit_at_their_original_positions(
    sink_positions,
):
    config = ModelConfig(num_layers=2, window=3, sinks=2, sink_positions=sink_positions)
    model = ReferenceTransformer(config)
    tokens = torch.randint(
        0, config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(3)
    )
    caches = model.new_caches(_CountsAttends, batch=2, max_length=8)
    _CountsAttends.calls = 0
    chunks = [model(tokens[:, :6], caches=caches)]
    chunks += [model(tokens[:, i : i + 1], caches=caches) for i in range(6, 20)]
    torch.testing.assert_close(torch.cat(chunks, 1), model(tokens), rtol=1e-12, atol=1e-12)
    # Under "in cache" the sinks' scores need the model's rotation of the query: it appends.
    assert _CountsAttends.calls == (15 * 2 if sink_positions == "original" else 0)
