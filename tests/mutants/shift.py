"""Broken context shifts and unrotated keys (docs/contract.md, section 8.4): each a
``PreallocatedCache`` with one bug in ``shift`` (of the whole batch or per row), an
``UnrotatedCache`` with one bug in how it keeps keys unrotated, or the independent
``ShiftingListCache`` with one bug in how it re-rotates."""

from __future__ import annotations

import torch
from torch import Tensor

from kvimpl import PreallocatedCache, UnrotatedCache
from kvref import check_shift, check_shift_rows, rerotate
from kvref.checks import is_row_shift
from kvref.rope import apply_rope
from tests.independent.shifting_list_cache import ShiftingListCache, rotate_in_dtype


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


class _ListShifted(ShiftingListCache):
    """``ShiftingListCache`` whose moved keys are rotated by ``rotate`` (its own: in the
    storage dtype, the angles from float32)."""

    def rotate(self, keys: Tensor, delta: int) -> Tensor:
        return rotate_in_dtype(keys, delta, self.spec.rope_base)

    def shift(self, start: int, count: int) -> None:
        check_shift(self.length, start, count)
        end = start + count
        moved = self._keys[end:]
        if moved:
            rotated = self.rotate(torch.stack(moved, dim=2), -count)
            moved = [t.clone(memory_format=torch.contiguous_format) for t in rotated.unbind(dim=2)]
        self._keys[start:] = moved
        del self._values[start:end]


class ShiftRerotatesAtBase10000(_ListShifted):
    """The moved keys are re-rotated with a RoPE base of 10,000 written in, not the model's.

    Stands for a K-shift that builds its own frequencies from the common default (a
    rope_theta / freq_base left at 10,000): right for Llama 2 and Mistral, wrong by far for
    Llama 3's 500,000 and Qwen 2's 1,000,000, where every moved key lands at another angle.
    """

    def rotate(self, keys: Tensor, delta: int) -> Tensor:
        return rotate_in_dtype(keys, delta, 10_000.0)


def rotate_with_angles_in(keys: Tensor, delta: int, base: float) -> Tensor:
    """``keys`` rotated by ``delta`` positions with the inverse frequencies, the angles, cos
    and sin all rounded into the keys' dtype (the frequencies first formed in float32)."""
    head_dim, dtype = keys.shape[-1], keys.dtype
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=keys.device)
    inverse = (base ** (-exponents / head_dim)).to(dtype)
    angles = delta * inverse  # in the keys' dtype: rounds with the angle's size
    cos, sin = angles.cos(), angles.sin()
    first, second = keys[..., : head_dim // 2], keys[..., head_dim // 2 :]
    return torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)


class ShiftAnglesInHalfPrecision(_ListShifted):
    """The re-rotation's angles are formed in the storage dtype (bfloat16 or float16), not
    in float32.

    Stands for RoPE frequencies cast with the model to half precision (the inverse
    frequencies a buffer that .to(bfloat16) rounds, positions times them in bfloat16, as
    transformers' Llama did before it forced float32, transformers#29285): an angle of count
    x frequency rounded to 8 or 11 bits is off by a share of its size, so a far shift's keys
    land beside their positions (tests/measure_shift.py).
    """

    def rotate(self, keys: Tensor, delta: int) -> Tensor:
        if keys.dtype not in (torch.bfloat16, torch.float16):
            return super().rotate(keys, delta)
        return rotate_with_angles_in(keys, delta, self.spec.rope_base)


class ShiftCountRoundedToHalfPrecision(_ListShifted):
    """The shift's count is held in the storage dtype before the angles are formed: bfloat16
    rounds a count past 256 to an even one.

    Stands for positions made in the frequencies' dtype (transformers' Llama built its
    position range with the dtype of an inverse-frequency buffer cast to bfloat16, so
    positions past 256 merged, transformers#29285): a discard of 259 tokens moves the keys
    back by 260.
    """

    def rotate(self, keys: Tensor, delta: int) -> Tensor:
        held = int(torch.tensor(float(delta), dtype=keys.dtype).item())
        return super().rotate(keys, held)


class RowShiftMovesTheWrongRow(PreallocatedCache):
    """A shift per row cuts each row's span out of the buffer row in reverse order (row b's
    from row B - 1 - b), the lengths following the right rows.

    Stands for a per-sequence removal and K-shift resolved to the wrong sequence's cells (a
    cell index taken for a position or a sequence id, llama.cpp 3840, 15226): one sequence
    of the batch loses and re-rotates tokens another was told to discard.
    """

    def _shift_rows(self, starts: tuple[int, ...], counts: tuple[int, ...]) -> None:
        rows = self._rows()
        for row, (start, count) in enumerate(zip(starts, counts, strict=True)):
            if not count:
                continue
            end, wrong = self._lengths[row], rows - 1 - row
            moved = slice(start + count, end)
            keys = self._moved_keys(self.key[wrong, :, moved].clone(), count)
            self.key[wrong, :, start : end - count] = keys
            self.value[wrong, :, start : end - count] = self.value[wrong, :, moved].clone()
            self._lengths[row] = end - count


class RowShiftRerotatesEveryRowByTheFirstDelta(PreallocatedCache):
    """A shift per row re-rotates every row's moved keys by the first shifted row's count,
    not by its own.

    Stands for a K-shift run once for the batch with one sequence's delta (llama.cpp's
    K-shift applied to the first stream's positions only, 14742): the other rows' moved keys
    sit where that row's shift would have put them.
    """

    def _moved_keys(self, keys: Tensor, count: int) -> Tensor:
        return rerotate(keys, -getattr(self, "_first_delta", count), self.spec.rope_base)

    def _shift_rows(self, starts: tuple[int, ...], counts: tuple[int, ...]) -> None:
        self._first_delta = next(count for count in counts if count)
        try:
            super()._shift_rows(starts, counts)
        finally:
            del self._first_delta


class RowShiftShortensTheUntouchedRows(PreallocatedCache):
    """A shift per row lowers every untouched row's length by the largest count too.

    Stands for one position counter kept for the batch (n_past) lowered by a shift of one
    sequence (ik_llama.cpp 2459: the removal and the token count drifting apart): the other
    rows lose their newest tokens.
    """

    def _shift_rows(self, starts: tuple[int, ...], counts: tuple[int, ...]) -> None:
        super()._shift_rows(starts, counts)
        most = max(counts)
        self._lengths = [
            max(0, n - most) if not count else n
            for n, count in zip(self._lengths, counts, strict=True)
        ]


class RowShiftChecksAgainstTheLongestRow(PreallocatedCache):
    """A shift per row checks each row's span against the longest row's length, not its
    own: a span past a short row's end is taken, cut to what the row holds.

    Stands for a removal bounded by the batch's positions rather than the sequence's
    (llama.cpp 12160: a miscomputed bound removes valid tokens): a caller's span past a
    row's end silently discards that row's tail instead of being refused.
    """

    def shift(self, start, count) -> None:
        if not is_row_shift(start, count):
            return super().shift(start, count)
        starts, counts = check_shift_rows((self.length,) * self._rows(), start, count)
        # Each row's span cut to what it holds, as a bound from the batch leaves it.
        fitted = [min(n, c) for n, c in zip(self._lengths, counts, strict=True)]
        starts = [min(s, n - c) for s, n, c in zip(starts, self._lengths, fitted, strict=True)]
        self._shift_rows(tuple(starts), tuple(fitted))
        return None


SHIFT_MUTANTS = (
    ShiftRotatesByTheWrongDelta,
    ShiftMovesKeysWithoutRotating,
    ShiftRecountsPositionsFromZero,
    ShiftLeavesTheQueryAtTheStaleOffset,
    UnrotatedShiftRotatesTheMovedKeys,
    UnrotatedCacheRotatesWhatItStores,
    ShiftRerotatesAtBase10000,
    ShiftAnglesInHalfPrecision,
    ShiftCountRoundedToHalfPrecision,
    RowShiftMovesTheWrongRow,
    RowShiftRerotatesEveryRowByTheFirstDelta,
    RowShiftShortensTheUntouchedRows,
    RowShiftChecksAgainstTheLongestRow,
)
