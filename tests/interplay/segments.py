"""Style: a list of segments (one per append), shared between forks because a segment is
never written once made, and a context shift that re-rotates the segments after the span.

``append`` copies the new rows into a segment of their own and returns the concatenation.
``fork`` copies the list, not the segments: both caches point at the same tensors, which is
safe while nothing writes a segment. ``truncate`` and ``shift`` cut segments into new,
cloned pieces. A context shift (contract 8.4) drops the span and re-rotates every later key
by -count; a segment wholly after the span is re-rotated in place (``copy_``), which saves
an allocation per segment on the path a full context takes at every shift.

The one bug (``ShiftRotatesSharedSegments``): that in-place re-rotation writes into a
segment a fork still holds.

- First event: ``fork`` (parallel samples of one prompt, each to run long), leaving
  "segments shared by two caches".
- Second event: a ``shift`` of either side that moves a shared segment (that side's context
  filled and it discarded a span before the shared segment's rows).
- A correct cache gives the shifting side new tensors; this one rotates the other side's
  keys too, by a shift it never made: its next step attends over keys at the wrong
  positions. A shift of a cache that shares nothing is right, and so is a fork whose sides
  only append, truncate or reset (none of which writes a segment).

Stands for llama.cpp's K-shift, which rotates its cells in place: a cell shared by several
sequences moves for all of them (the reason ``llama_memory_seq_add`` is documented per
sequence, and the engine-level ``ShiftMovesSharedCells`` mutant), met here at the layer
level, where a fork shares storage. The twin (``ShiftCopiesSegments``) rotates into new
tensors.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvref import check_append, check_shift, check_truncate, rerotate


class ShiftRotatesSharedSegments:
    copy_on_shift = False  # the bug: segments after the span are re-rotated in place

    def __init__(self, spec) -> None:
        self.spec = spec
        self._segments: list[tuple[Tensor, Tensor]] = []
        self._n = 0

    @property
    def length(self) -> int:
        return self._n

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self._segments)

    def _joined(self) -> tuple[Tensor, Tensor]:
        if not self._segments:
            s, like = self.spec, {"dtype": self.spec.dtype, "device": self.spec.device}
            return (
                torch.zeros((s.batch, s.kv_heads, 0, s.head_dim), **like),
                torch.zeros((s.batch, s.kv_heads, 0, s.value_width), **like),
            )
        return (
            torch.cat([k for k, _ in self._segments], dim=2),
            torch.cat([v for _, v in self._segments], dim=2),
        )

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        self._n += check_append(self.spec, self._n, key, value)
        self._segments.append((key.clone(), value.clone()))
        return self._joined()

    def fork(self) -> ShiftRotatesSharedSegments:
        child = type(self)(self.spec)
        child._segments, child._n = list(self._segments), self._n
        return child

    def reset(self) -> None:
        self._segments, self._n = [], 0

    def truncate(self, length: int) -> None:
        check_truncate(self._n, length)
        kept, at = [], 0
        for k, v in self._segments:
            rows = k.shape[2]
            if at + rows <= length:
                kept.append((k, v))
            elif at < length:
                kept.append((k[:, :, : length - at].clone(), v[:, :, : length - at].clone()))
            at += rows
        self._segments, self._n = kept, length

    def shift(self, start: int, count: int) -> None:
        check_shift(self._n, start, count)
        end, base = start + count, self.spec.rope_base
        kept, at = [], 0
        for k, v in self._segments:
            first, last = at, at + k.shape[2]  # this segment holds indices [first, last)
            at = last
            if last <= start:
                kept.append((k, v))  # wholly before the span: unmoved
                continue
            if first >= end:  # wholly after the span: moved down by count
                if self.copy_on_shift:
                    kept.append((rerotate(k, -count, base), v))
                else:
                    # Bug (copy_on_shift False): the segment, shared or not, rotated in place.
                    k.copy_(rerotate(k, -count, base))
                    kept.append((k, v))
                continue
            # The span cuts this segment: the part before it stays, the part after it moves.
            if first < start:
                kept.append((k[:, :, : start - first].clone(), v[:, :, : start - first].clone()))
            if last > end:
                after = end - first
                kept.append((rerotate(k[:, :, after:], -count, base), v[:, :, after:].clone()))
        self._segments, self._n = kept, self._n - count


class ShiftCopiesSegments(ShiftRotatesSharedSegments):
    """The twin: moved segments are re-rotated into new tensors."""

    copy_on_shift = True
