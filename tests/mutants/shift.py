"""Broken context shifts and unrotated keys (docs/contract.md, section 8.4): each a
``PreallocatedCache`` with one bug in ``shift``, or an ``UnrotatedCache`` with one bug in how
it keeps keys unrotated."""

from __future__ import annotations

import torch
from torch import Tensor

from kvimpl import PreallocatedCache, UnrotatedCache
from kvref import check_shift, rerotate
from kvref.model import apply_rope


class _Shifted(PreallocatedCache):
    """``shift`` with the moved keys rotated by ``delta(count)`` positions, not -count."""

    def delta(self, count: int) -> int:
        return -count

    def shift(self, start: int, count: int) -> None:
        check_shift(self.length, start, count)
        end, rows = self.length, self._rows()
        moved = slice(start + count, end)
        keys = rerotate(self.key[:rows, :, moved].clone(), self.delta(count), self.spec.rope_base)
        self.key[:rows, :, start : end - count] = keys
        self.value[:rows, :, start : end - count] = self.value[:rows, :, moved].clone()
        self._lengths = [end - count] * rows


class ShiftRotatesByTheWrongDelta(_Shifted):
    """The moved keys are rotated back by one position fewer than the span discarded.

    Stands for a K-shift whose delta is off by one (the span's end taken inclusively, or the
    kept count taken for the discarded one): every moved key sits one position off, so the
    model's attention to the whole kept history is subtly wrong (llama.cpp 4097).
    """

    def delta(self, count: int) -> int:
        return -(count - 1)


class ShiftMovesKeysWithoutRotating(_Shifted):
    """The rows after the span move down, their keys not re-rotated at all.

    Stands for a context shift that moves the cache's rows but forgets the K-shift (or runs
    it on a backend that does not implement it): the moved keys keep their old positions.
    """

    def delta(self, count: int) -> int:
        return 0


class ShiftRecountsPositionsFromZero(_Shifted):
    """The moved keys are rotated to their index counted from 0, forgetting the session's
    first position.

    Stands for positions recounted from zero after a discard: a session resumed at position
    p keeps its first keys at p onwards while the moved ones restart at 0 (ik_llama.cpp 2459,
    sglang 11634).
    """

    def delta(self, count: int) -> int:
        return -count - self._firsts[0]


class ShiftLeavesTheQueryAtTheStaleOffset(PreallocatedCache):
    """After a shift, the first position moves up by the span discarded: the next query is
    rotated where it would have been without the shift.

    Stands for a position counter (llama.cpp's n_past) not lowered after a shift, so new
    queries are rotated at the stale offset while the kept keys were moved down (mlx-vlm
    1983).
    """

    def shift(self, start: int, count: int) -> None:
        super().shift(start, count)
        self._firsts = [first + count for first in self._firsts]


class UnrotatedShiftRotatesTheMovedKeys(UnrotatedCache):
    """A cache that keeps keys unrotated re-rotates the keys a shift moves anyway.

    Stands for a context shift written for rotated keys run on a cache that stores them
    before RoPE (the K-shift applied where the model rotates at read): the moved keys end up
    rotated twice, by the shift and by the model.
    """

    def _moved_keys(self, keys: Tensor, count: int) -> Tensor:
        return rerotate(keys, -count, self.spec.rope_base)


class UnrotatedCacheRotatesWhatItStores(UnrotatedCache):
    """A cache that declares its keys unrotated rotates them at their positions itself as it
    stores them.

    Stands for a cache whose writer applies RoPE while the model, told the keys are kept
    unrotated, rotates them again as it reads them: every key rotated twice.
    """

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        start = self.length
        positions = torch.arange(start, start + key.shape[2], device=key.device)
        return super().append(apply_rope(key, positions, self.spec.rope_base), value)


SHIFT_MUTANTS = (
    ShiftRotatesByTheWrongDelta,
    ShiftMovesKeysWithoutRotating,
    ShiftRecountsPositionsFromZero,
    ShiftLeavesTheQueryAtTheStaleOffset,
    UnrotatedShiftRotatesTheMovedKeys,
    UnrotatedCacheRotatesWhatItStores,
)
