"""The left-padded batch cache with a context shift per row, as llama.cpp shifts one sequence.

Written from ``docs/contract.md`` (section 8.4, "Shifts per row") only, on top of the
independent ``LeftPaddedBatchCache`` (one dense, left-padded tensor pair, every row's tokens
right-aligned): ``shift(starts, counts)``, a tuple each, makes row b forget its tokens of
indices ``starts[b]`` to ``starts[b] + counts[b] - 1`` and re-rotates its later keys by
``-counts[b]`` positions, then rebuilds the layout right-aligned at the new longest row.

How it differs from the built-in preallocated cache: the rows sit right-aligned behind left
padding (a row's index i at slot ``width - length + i``, every slot moving when the longest
row shrinks), the shifted rows are gathered into a fresh tensor pair rather than moved in
place, and the re-rotation runs in the storage dtype with angles formed in float32, as
llama.cpp's K-shift does (``tests.independent.shifting_list_cache.rotate_in_dtype``), not in
float64 and rounded once.

Two ints shift every row alike, while every row holds the same number of tokens. Every bad
argument raises ``ValueError`` naming the row and the problem, and changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from tests.independent.left_padded_batch_cache import LeftPaddedBatchCache, _is_int
from tests.independent.shifting_list_cache import rotate_in_dtype


class LeftPaddedShiftingCache(LeftPaddedBatchCache):
    """Rows of their own, left-padded, each shifting on its own."""

    keys_stored = "rotated"
    shift_per_row = True

    def shift(self, start: int | Sequence[int], count: int | Sequence[int]) -> None:
        starts, counts = self._spans(start, count)
        w = self._width
        pieces = []
        for b, (s, c) in enumerate(zip(starts, counts, strict=True)):
            n = self._lengths[b]
            keys = self._key[b, :, w - n : w]
            values = self._value[b, :, w - n : w]
            if c:
                moved = rotate_in_dtype(keys[:, s + c :], -c, self._spec.rope_base)
                keys = [keys[:, :s], moved]
                values = [values[:, :s], values[:, s + c :]]
            else:
                keys, values = [keys], [values]
            pieces.append((keys, values))
        new_lengths = [n - c for n, c in zip(self._lengths, counts, strict=True)]
        nw = max(new_lengths)
        k, v = self._alloc(self.batch, self._capacity_for(nw))
        for b, (keys, values) in enumerate(pieces):
            at = nw - new_lengths[b]  # right-aligned behind the row's new padding
            for key_part, value_part in zip(keys, values, strict=True):
                width = key_part.shape[1]
                k[b, :, at : at + width] = key_part
                v[b, :, at : at + width] = value_part
                at += width
        self._key, self._value = k, v
        self._lengths = new_lengths
        self._width = nw

    def _spans(self, start, count) -> tuple[list[int], list[int]]:
        """One (start, count) per row, each within that row's own tokens, some count >= 1."""
        rows = self.batch
        if _is_int(start) and _is_int(count):
            if len(set(self._lengths)) > 1:
                raise ValueError(
                    f"shift({start}, {count}) shifts every row alike, but the rows hold "
                    f"{self.row_lengths} tokens: give a tuple of starts and of counts, one per row"
                )
            if count < 1:
                raise ValueError(f"count must be >= 1 to shift every row, got {count}")
            start, count = (start,) * rows, (count,) * rows
        elif not isinstance(start, (tuple, list)) or not isinstance(count, (tuple, list)):
            raise ValueError(
                f"starts and counts must both be ints or both tuples of one int per row; got "
                f"{type(start).__name__} and {type(count).__name__}"
            )
        for name, values in (("starts", start), ("counts", count)):
            if len(values) != rows:
                raise ValueError(
                    f"{name} must have one entry per batch row: batch B={rows}, got "
                    f"{len(values)} entries {tuple(values)!r}"
                )
            for i, x in enumerate(values):
                if not _is_int(x):
                    raise ValueError(f"{name}[{i}] must be an int, got {type(x).__name__} {x!r}")
        for i, (s, c) in enumerate(zip(start, count, strict=True)):
            n = self._lengths[i]
            if c < 0:
                raise ValueError(f"counts[{i}] = {c} is negative (row {i} holds {n} tokens)")
            if s < 0 or s + c > n:
                raise ValueError(
                    f"row {i} holds {n} tokens: starts[{i}] = {s} with counts[{i}] = {c} is out "
                    f"of range (need 0 <= start and start + count <= {n})"
                )
        if not any(count):
            raise ValueError(f"every count is 0 in {tuple(count)!r}: nothing to shift")
        return list(start), list(count)
