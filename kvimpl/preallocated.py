"""One buffer of ``max_length`` rows per K and V and a write position per batch row; refuses
to overflow.

Rows may hold different numbers of tokens (contract, section 8.1): each row's tokens sit at
the start of its buffer row, ``valid`` marking them; rows leave (``select_rows``) and join
(``join``, up to the ``spec.batch`` rows the buffer was built for).

A context shift (section 8.4) moves the rows after the discarded span down the buffer, each
key re-rotated back by the span's length, as llama.cpp shifts its cache when it fills: the
session then runs on past ``max_length`` tokens. With a tuple of starts and of counts each
row shifts on its own (llama.cpp's ``llama_memory_seq_rm`` and ``seq_add`` of one sequence).

Its rows move to and from other layouts (section 11.2, ``kvimpl.movable``) while every row
holds one length from position 0; an import past ``max_length`` is refused, as an append is.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvimpl.movable import MovableMixin
from kvimpl.rows import RowBook
from kvref.checks import (
    check_append,
    check_append_rows,
    check_reorder,
    check_shift,
    check_shift_rows,
    check_truncate,
    is_row_shift,
)
from kvref.protocol import CacheSpec
from kvref.rope import rerotate


class PreallocatedCache(RowBook, MovableMixin):  # RowBook's _movable first
    keys_stored = "rotated"  # shift re-rotates the keys it moves
    shift_per_row = True  # shift also takes a tuple of starts and of counts (section 8.4)

    def __init__(self, spec: CacheSpec) -> None:
        self.spec = spec
        shape = (spec.batch, spec.kv_heads, spec.max_length, spec.head_dim)
        self.key = torch.zeros(shape, dtype=spec.dtype, device=spec.device)
        self.value = torch.zeros(shape, dtype=spec.dtype, device=spec.device)
        self._lengths = [0] * spec.batch  # per row: its tokens, at the start of its buffer row
        self._firsts = [0] * spec.batch  # per row: the position of its first token

    @property
    def nbytes(self) -> int:
        return self.key.nbytes + self.value.nbytes

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        start = self.length
        self._one_length("append", "append_rows")
        end = start + check_append(
            self._batch_spec, start, key, value, capacity=self.spec.max_length
        )
        self.key[: self._rows(), :, start:end] = key
        self.value[: self._rows(), :, start:end] = value
        self._lengths = [end] * self._rows()
        return self._rows_to_move()

    def append_rows(self, key: Tensor, value: Tensor, counts) -> tuple[Tensor, Tensor, Tensor]:
        counts = check_append_rows(
            self.spec, self._lengths, key, value, counts, capacity=self.spec.max_length
        )
        for row, count in enumerate(counts):
            start = self._lengths[row]
            self.key[row, :, start : start + count] = key[row, :, :count]
            self.value[row, :, start : start + count] = value[row, :, :count]
            self._lengths[row] = start + count
        return self._held_rows()

    def _rows_to_move(self) -> tuple[Tensor, Tensor]:
        """The rows up to the longest row's end: only the rows written since the last reset,
        so that stale rows never leave the cache (what ``append`` returns)."""
        end = self.length
        return self.key[: self._rows(), :, :end], self.value[: self._rows(), :, :end]

    def _import_capacity(self) -> int:
        return self.spec.max_length

    def _held_rows(self) -> tuple[Tensor, Tensor, Tensor]:
        """Every row's buffer up to the longest row, and which of its slots it holds."""
        keys, values = self._rows_to_move()
        held = torch.tensor(self._lengths, device=self.key.device)
        valid = torch.arange(self.length, device=self.key.device)[None, :] < held[:, None]
        return keys, values, valid

    def truncate(self, length: int) -> None:
        self._one_length("truncate", "truncate_rows")
        check_truncate(self.length, length)
        self._lengths = [length] * self._rows()  # rows past it are never returned again

    def truncate_rows(self, lengths) -> None:
        self._lengths = list(self._checked_lengths(lengths))

    def shift(self, start, count) -> None:
        if is_row_shift(start, count):
            self._shift_rows(*check_shift_rows(self._lengths, start, count))
            return
        self._one_length("shift", "a shift per row")
        check_shift(self.length, start, count)
        end, rows = self.length, self._rows()
        moved = slice(start + count, end)
        # Cloned first: the rows moved and the rows they land on overlap.
        self.key[:rows, :, start : end - count] = self._moved_keys(
            self.key[:rows, :, moved].clone(), count
        )
        self.value[:rows, :, start : end - count] = self.value[:rows, :, moved].clone()
        self._lengths = [end - count] * rows

    def _shift_rows(self, starts: tuple[int, ...], counts: tuple[int, ...]) -> None:
        """Row b's span of ``counts[b]`` tokens from ``starts[b]`` gone, its later rows moved
        down its own buffer row and re-rotated by its own count."""
        for row, (start, count) in enumerate(zip(starts, counts, strict=True)):
            if not count:
                continue
            end = self._lengths[row]
            moved = slice(start + count, end)
            keys = self._moved_keys(self.key[row, :, moved].clone(), count)
            self.key[row, :, start : end - count] = keys
            self.value[row, :, start : end - count] = self.value[row, :, moved].clone()
            self._lengths[row] = end - count

    def _moved_keys(self, keys: Tensor, count: int) -> Tensor:
        """The keys a shift moves down by ``count`` positions, re-rotated to their new ones."""
        return rerotate(keys, -count, self.spec.rope_base)

    def reorder(self, indices: Tensor) -> None:
        check_reorder(self._batch_spec, indices)
        self._take(indices)

    def select_rows(self, indices: Tensor) -> None:
        self._checked_selection(indices, self.key.device)
        self._take(indices)

    def _take(self, indices: Tensor) -> None:
        """Rows ``indices`` (repeats allowed) become rows 0, 1, ... with their lengths."""
        picked = indices.tolist()
        written = self.length  # only the rows written, not the whole buffer
        for buffer in (self.key, self.value):
            buffer[: len(picked), :, :written] = buffer[:, :, :written].index_select(0, indices)
        self._lengths = [self._lengths[row] for row in picked]
        self._firsts = [self._firsts[row] for row in picked]

    def join(self, other: PreallocatedCache) -> None:
        self._check_joinable(other, PreallocatedCache, "another PreallocatedCache")
        rows, more = self._rows(), other._rows()
        if rows + more > self.spec.batch:
            raise ValueError(
                f"join: {rows} rows and {more} more exceed the {self.spec.batch} this cache "
                f"was built for"
            )
        written = other.length
        self.key[rows : rows + more, :, :written] = other.key[:more, :, :written]
        self.value[rows : rows + more, :, :written] = other.value[:more, :, :written]
        self._lengths += other._lengths
        self._firsts += other._firsts

    def reset(self) -> None:
        self._lengths = [0] * self._rows()
        self._firsts = [0] * self._rows()

    def reset_at(self, first_position) -> None:
        firsts = self._checked_firsts(first_position, self._rows())
        self.reset()
        self._firsts = firsts
