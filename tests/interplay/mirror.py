"""Style: rows kept twice, once as appended and once transposed for the attention kernel,
the transposed copy brought up to date lazily.

``append`` must hand rows back as (B, H, T, D), but a decode kernel wants each head's keys
as a (D, T) matrix so that ``q @ K^T`` is a plain matmul over contiguous memory. This cache
keeps ``_k``/``_v`` (B, H, capacity, D) for ``append`` and a mirror ``_kt`` (B, H, D,
capacity) for ``attend``. Copying every appended row into the mirror would cost the append
path for nothing when the model never attends through the cache, so the mirror is synced
lazily: ``attend`` copies the keys from ``_synced`` up to the length into it, and attends
over the mirror.

The one bug (``MirrorSyncedMarkSurvivesTruncate``): ``truncate`` shortens the rows but
leaves ``_synced`` where the last ``attend`` put it.

- First event: an ``attend`` (the mirror synced to length L), then a ``truncate`` to
  length < L: the state "mirror marked synced past the length".
- Second event: an ``attend`` after new rows were written at the positions the truncate
  freed (by that attend itself, or by appends before it).
- A correct cache syncs from the truncated length, so the mirror holds the new keys; this
  one syncs only from the old mark, so the attention reads the rolled-back draft's keys at
  those positions. ``append`` after the truncate returns the right rows (it never reads the
  mirror), and a truncate of a cache never attended through is harmless.

Stands for engines whose kernel layout is a second buffer with its own fill mark (a decode
layout beside a prefill layout, a device copy beside a host copy, a "computed up to" mark of
a CUDA-graph buffer) that the rollback path of speculative decoding does not rewind
(BUGS.md class 2 of its table: "stale draft tokens stay in the cache"). The twin
(``MirrorSyncedMarkRewound``) lowers the mark on truncate.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from kvref import check_append, check_attend, check_truncate


class MirrorSyncedMarkSurvivesTruncate:
    rewind_mark = False  # the bug: truncate leaves the mirror's synced mark alone

    def __init__(self, spec) -> None:
        self.spec = spec
        self._n = 0
        self._synced = 0  # the mirror holds the keys of positions [0, _synced)
        self._allocate(0)

    def _allocate(self, capacity: int) -> None:
        s, like = self.spec, {"dtype": self.spec.dtype, "device": self.spec.device}
        self._k = torch.zeros((s.batch, s.kv_heads, capacity, s.head_dim), **like)
        self._v = torch.zeros((s.batch, s.kv_heads, capacity, s.value_width), **like)
        self._kt = torch.zeros((s.batch, s.kv_heads, s.head_dim, capacity), **like)

    @property
    def length(self) -> int:
        return self._n

    @property
    def nbytes(self) -> int:
        return self._k.nbytes + self._v.nbytes + self._kt.nbytes

    def _room(self, needed: int) -> None:
        if needed <= self._k.shape[2]:
            return
        old_k, old_v, old_kt = self._k, self._v, self._kt
        self._allocate(64 * math.ceil(needed / 64))  # grows in steps of 64 rows
        self._k[:, :, : self._n] = old_k[:, :, : self._n]
        self._v[:, :, : self._n] = old_v[:, :, : self._n]
        # The mirror as it is, up to its mark (which, with the bug, may lie past the length).
        mark = min(self._synced, old_kt.shape[3])
        self._kt[..., :mark] = old_kt[..., :mark]

    def _write(self, key: Tensor, value: Tensor, new: int) -> None:
        self._room(self._n + new)
        self._k[:, :, self._n : self._n + new] = key
        self._v[:, :, self._n : self._n + new] = value
        self._n += new

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        new = check_append(self.spec, self._n, key, value)
        self._write(key, value, new)
        return self._k[:, :, : self._n], self._v[:, :, : self._n]

    def _sync(self) -> None:
        if self._synced < self._n:
            rows = self._k[:, :, self._synced : self._n]
            self._kt[..., self._synced : self._n] = rows.transpose(-1, -2)
            self._synced = self._n

    def attend(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        new = check_attend(self.spec, self._n, query, key, value)
        first = self._n
        self._write(key, value, new)
        self._sync()
        return self._attention(query, first, new)

    def _attention(self, query: Tensor, first: int, new: int) -> Tensor:
        """softmax(q K^T / sqrt(D)) V over the mirror, accumulated in float32 (float64 for
        float64), its running maximum subtracted, masked causally and by the window."""
        s, n = self.spec, self._n
        batch, heads, _, width = query.shape
        group = heads // s.kv_heads
        wide = torch.float64 if query.dtype == torch.float64 else torch.float32
        # Query heads h = kv * group + j: the group's queries stacked as rows of one matmul.
        q = query.to(wide).reshape(batch, s.kv_heads, group * new, width)
        scores = (q @ self._kt[..., :n].to(wide)) / math.sqrt(width)
        scores = scores.view(batch, s.kv_heads, group, new, n)
        at = torch.arange(first, first + new, device=query.device)[:, None]
        keys = torch.arange(n, device=query.device)[None, :]
        seen = keys <= at
        if s.window is not None:
            seen &= keys > at - s.window
        scores = scores.masked_fill(~seen, float("-inf"))
        weights = torch.exp(scores - scores.amax(-1, keepdim=True))
        weights = weights / weights.sum(-1, keepdim=True)
        out = weights @ self._v[:, :, None, :n].to(wide)
        return out.reshape(batch, heads, new, -1).to(query.dtype)

    def truncate(self, length: int) -> None:
        check_truncate(self._n, length)
        self._n = length
        if self.rewind_mark:
            self._synced = min(self._synced, length)
        # Bug (rewind_mark False): the mirror still claims positions length.. are synced.

    def reset(self) -> None:
        self._n = 0
        self._synced = 0


class MirrorSyncedMarkRewound(MirrorSyncedMarkSurvivesTruncate):
    """The twin: truncate lowers the mirror's mark to the new length."""

    rewind_mark = True
