"""Broken ``attend``: caches whose ``append`` is right and whose attention is wrong in one
condition only (half precision, after a reset, any cache but a pool's first, past the first
block, a batch row other than 0).

Each is a few lines away from the built-in ``kvimpl.chunked`` cache or ``kvimpl.paged`` pool,
with exactly one bug. The rows ``append`` returns are right, so the checks that read rows
(lengths, contents, isolation, stale rows) cannot see any of them: only a property that runs
``attend``, directly or through the model, can. As in ``tests/mutants/caches.py``, the first
paragraph of each docstring names the bug and the rest the real failure it stands for.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from kvimpl import ChunkedCache
from kvimpl.blockwise import BlockwiseAttention, attend_blocks
from kvref import CacheSpec, check_attend
from tests.mutants.paged import _MutantCache, _MutantPool

HALF = (torch.bfloat16, torch.float16)


class _ChunkedAttend(ChunkedCache):
    """The built-in chunked ``attend`` with two of its inputs named: the position its first
    new query is given, and how it reads a chunk. Each chunked mutant below changes one."""

    def attend(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        new_tokens = check_attend(self.spec, self._length, query, key, value)
        first = self._length
        self._store(key, value, new_tokens)
        size = self.chunk_size
        return attend_blocks(
            query, self.spec, self._query_start(first), self._length, size, self._chunk
        )

    def _query_start(self, first: int) -> int:
        return first

    def _chunk(self, index: int) -> tuple[Tensor, Tensor]:
        return self.chunks[index]


class HalfPrecisionCausalTopLeft(_ChunkedAttend):
    """In bfloat16 and float16, ``attend`` aligns its causal mask top-left: the i-th new query
    sees keys 0..i, not the keys up to its own position. Right for a prompt on an empty cache,
    and in float64 and float32 always; on a warm half-precision cache a decode step sees key 0
    alone.

    Stands for a half-precision fast path with other mask semantics than the general one:
    ``scaled_dot_product_attention(is_causal=True)`` and flash-attention before 2.1 align a
    non-square causal mask top-left, and such kernels are picked for half precision only
    (torch's flash backend takes float16 and bfloat16 alone), so a suite that checks attention
    in float32 passes the path every bfloat16 model takes.
    """

    def _query_start(self, first: int) -> int:
        return 0 if self.spec.dtype in HALF else first


class AttendReadsBatchRowZero(_ChunkedAttend):
    """``attend`` reads batch row 0's keys and values for every batch row.

    Stands for attention kernels whose per-sequence key/value pointer loses the batch stride
    (flash-attention 772, ``flash_attn_with_kvcache`` touching the wrong batch row once the
    stride overflowed; sglang-jax 1297, a window slid onto a neighbour's pages, "batch=1 is
    immune"): each sequence attends to the first one's history, invisible with batch 1 and in
    the rows ``append`` returns.
    """

    def _chunk(self, index: int) -> tuple[Tensor, Tensor]:
        keys, values = self.chunks[index]
        return keys[:1].expand_as(keys), values[:1].expand_as(values)


class _CountsTokensAcrossResets(_MutantCache):
    before = 0  # tokens written before the last reset, still in the count attend numbers from

    def reset(self) -> None:
        self.before += self._length  # the count of tokens written goes on; length goes to 0
        super().reset()

    def attend(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        def merge(query: Tensor, kv_heads: int, first: int, window: int | None):
            return BlockwiseAttention(query, kv_heads, self.before + first, window)

        return self._attend(query, key, value, merge=merge)


class AttendPositionsSurviveReset(_MutantPool):
    """``attend`` gives its queries positions from a count of the tokens written that
    ``reset()`` does not zero: after a reset of a cache that held n tokens, every query sits
    n positions late, so a prompt's queries see up to n of its later tokens, and a window's
    edge moves by n.

    Stands for position counters kept beside the length and missed by reset
    (transformers 48509: after ``DynamicCache.reset()`` the length still read 6), which only
    the attention path reads: the first session of every cache is right, and so is each
    decode step without a window, since a late query still sees every key.
    """

    cache_class = _CountsTokensAcrossResets


class _ScaledByHeadDim(BlockwiseAttention):
    def __init__(self, query: Tensor, kv_heads: int, first: int, window: int | None) -> None:
        super().__init__(query, kv_heads, first, window)
        self.query = self.query / math.sqrt(query.shape[-1])  # 1 / D in all, not 1 / sqrt(D)


class _ScaleOfFirstCacheOnly(_MutantCache):
    first = False  # set by the pool on the first cache it builds

    def attend(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        merge = BlockwiseAttention if self.first else _ScaledByHeadDim
        return self._attend(query, key, value, merge=merge)


class LaterCachesScaleByHeadDim(_MutantPool):
    """Every cache but the first one the pool builds scales its attention scores by
    1 / head_dim instead of 1 / sqrt(head_dim).

    Stands for per-layer attention settings filled in for the first layer only (the
    softmax scale is a parameter of each layer's attention in engines), the later ones left
    at a default from another convention (1 / head_dim is muP's): a one-layer model, or a
    test that builds one cache per pool, never sees it.
    """

    cache_class = _ScaleOfFirstCacheOnly
    built = 0

    def __call__(self, spec: CacheSpec) -> _ScaleOfFirstCacheOnly:
        cache = super().__call__(spec)
        cache.first = not self.built
        self.built += 1
        return cache


class _ReadsFirstBlockOnly(_MutantCache):
    def attend(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        return self._attend(query, key, value, lambda length, size: 1)


class AttendReadsFirstBlockOnly(_MutantPool):
    """``attend`` reads block 0 only: once a cache holds more than one block, its queries
    ignore every key past the first block, their own included.

    Stands for split-KV (flash-decoding) reductions that merge only the first split's
    partial result, or a grid sized for one block per sequence: right for every context up
    to a block (16 tokens here, the prompts a quick test tries), and ``append``, which
    returns the rows, never shows it.
    """

    cache_class = _ReadsFirstBlockOnly


ATTEND_MUTANTS = (
    HalfPrecisionCausalTopLeft,
    AttendPositionsSurviveReset(),
    LaterCachesScaleByHeadDim(),
    AttendReadsFirstBlockOnly(),
    AttendReadsBatchRowZero,
)
