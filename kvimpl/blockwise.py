"""Attention over keys and values held in fixed-size blocks, read where they lie.

A cache whose rows lie in separate blocks or chunks computes attention one piece at a time
and merges the pieces with a running log-sum-exp, as paged and flash attention kernels do,
instead of joining its whole history into one tensor per step. For each query row it keeps
the largest score seen so far (so exp never overflows), the sum of exp(score - max) and the
weighted sum of values; a new piece with a larger max rescales what was kept by
exp(old max - new max). The result equals softmax attention over all the pieces at once
(``kvref.attention``) up to rounding.

Grouped-query heads are handled without repeating keys: query head h reads kv head
h // (H // H_kv), so the query (B, H, T, D) is viewed as (B, H_kv, (H // H_kv) x T, D) and
each kv head serves its whole group in one matmul.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from kvref.protocol import CacheSpec

# Block ``index`` of a cache: its keys and values, (B, H_kv, >= rows held there, D).
ReadBlock = Callable[[int], tuple[Tensor, Tensor]]


class BlockwiseAttention:
    """Softmax attention of the new tokens' queries over pieces of keys and values.

    ``query`` is (B, H, T, D) at absolute positions ``first_position`` .. + T - 1; each piece
    given to ``add`` is keys and values (B, H_kv, rows, D) of the consecutive positions
    ``start`` .. ``start + rows - 1``. Pieces may come in any order; every key the queries
    may see (causal, and ``window``) must be given once. ``result()`` is shaped and typed like
    ``query``.
    """

    def __init__(self, query: Tensor, kv_heads: int, first_position: int, window: int | None):
        batch, heads, new_tokens, head_dim = query.shape
        self.shape, self.dtype = query.shape, query.dtype
        self.first = first_position
        self.last = first_position + new_tokens - 1
        self.window = window
        group = heads // kv_heads
        # Half precision is accumulated in float32 and rounded once in result(), as
        # attention kernels do: a running sum in bfloat16 loses a bit per block.
        self.wide = torch.promote_types(query.dtype, torch.float32)
        # Scaled once here rather than every piece's scores.
        scaled = query.to(self.wide) * (1.0 / math.sqrt(head_dim))
        self.query = scaled.reshape(batch, kv_heads, group * new_tokens, head_dim)
        positions = torch.arange(first_position, self.last + 1, device=query.device)
        self.query_positions = positions.repeat(group)  # row i of a group is token i % T
        self.max: Tensor | None = None  # (B, H_kv, group x T, 1), -inf where nothing seen yet
        self.sum: Tensor | None = None
        self.out: Tensor | None = None
        self.every_query_saw_a_key = False  # then no max is -inf any more

    def sees(self, start: int, rows: int) -> bool:
        """Whether any new query sees any of positions start .. start + rows - 1."""
        if start > self.last:
            return False
        return self.window is None or start + rows - 1 > self.first - self.window

    def add(self, keys: Tensor, values: Tensor, start: int) -> None:
        """Merge one piece, keys and values of positions ``start`` .. ``start + rows - 1``."""
        # In place where the tensor is this call's own: a decode step merges many pieces of
        # tiny tensors, so the cost is in the number of operations, not their size.
        keys, values = keys.to(self.wide), values.to(self.wide)  # no copy unless half
        scores = self.query @ keys.transpose(-2, -1)
        allowed = self._allowed(start, keys.shape[-2])
        if allowed is not None:
            scores.masked_fill_(~allowed, float("-inf"))
        piece_max = scores.amax(-1, keepdim=True)
        new_max = piece_max if self.max is None else torch.maximum(self.max, piece_max)
        shift = new_max
        if allowed is not None and not self.every_query_saw_a_key:
            # A query that has seen no key yet has max -inf: shift by 0 there, so that
            # exp(-inf - shift) is 0 rather than nan.
            shift = new_max.masked_fill(new_max == float("-inf"), 0.0)
        weights = scores.sub_(shift).exp_()
        if self.max is None:
            self.sum, self.out = weights.sum(-1, keepdim=True), weights @ values
        else:
            rescale = (self.max - shift).exp_()
            self.sum.mul_(rescale).add_(weights.sum(-1, keepdim=True))
            self.out.mul_(rescale).add_(weights @ values)
        self.max = new_max
        self.every_query_saw_a_key |= allowed is None

    def result(self) -> Tensor:
        """The attention output, shaped and typed like the query."""
        if self.out is None:
            raise ValueError("attention over no keys: every query sees at least its own key")
        return (self.out / self.sum).reshape(self.shape).to(self.dtype)

    def _allowed(self, start: int, rows: int) -> Tensor | None:
        """(group x T, rows) booleans, or None when every query sees the whole piece."""
        end = start + rows - 1
        causal_cut = end > self.first  # some key is later than the earliest query
        window_cut = self.window is not None and start <= self.last - self.window
        if not (causal_cut or window_cut):
            return None
        keys = torch.arange(start, end + 1, device=self.query.device)
        allowed = keys[None, :] <= self.query_positions[:, None]
        if self.window is not None:
            allowed &= keys[None, :] > self.query_positions[:, None] - self.window
        return allowed


def attend_blocks(
    query: Tensor, spec: CacheSpec, first_position: int, length: int, size: int, read: ReadBlock
) -> Tensor:
    """Attention of ``query`` (the tokens at ``first_position`` onwards) over the ``length``
    rows of a cache that keeps position p in block p // ``size``, reading only the blocks
    some query sees, each where it lies."""
    attention = BlockwiseAttention(query, spec.kv_heads, first_position, spec.window)
    for index in range(-(-length // size)):
        start = index * size
        rows = min(size, length - start)
        if attention.sees(start, rows):
            keys, values = read(index)
            attention.add(keys[:, :, :rows], values[:, :, :rows], start)
    return attention.result()
