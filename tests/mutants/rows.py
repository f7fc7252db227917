"""Broken caches with rows of their own (docs/contract.md, section 8.1): each a
``PreallocatedCache`` with one bug in ``append_rows`` or ``truncate_rows``."""

from __future__ import annotations

import torch
from torch import Tensor

from kvimpl import PreallocatedCache
from kvref import check_append_rows


class OneOffsetForAllRows(PreallocatedCache):
    """Writes every row's new tokens at the longest row's end: one cache position for the
    whole batch.

    Stands for batched generation that keeps one offset or cache position for all rows, so a
    shorter row's new keys land past a gap of stale slots (unsloth 3699, mlx-vlm 1946).
    """

    def append_rows(self, key: Tensor, value: Tensor, counts) -> tuple[Tensor, Tensor, Tensor]:
        counts = check_append_rows(self.spec, self._lengths, key, value, counts)
        start = self.length
        for row, count in enumerate(counts):
            self.key[row, :, start : start + count] = key[row, :, :count]
            self.value[row, :, start : start + count] = value[row, :, :count]
            self._lengths[row] += count
        end = self.length
        valid = (
            torch.arange(end, device=self.key.device)[None, :]
            < torch.tensor(self._lengths, device=self.key.device)[:, None]
        )
        return self.key[: len(counts), :, :end], self.value[: len(counts), :, :end], valid


class RollbackZeroesRejectedRows(PreallocatedCache):
    """``truncate_rows`` zeroes a row's rejected keys and values instead of removing them: the
    row keeps its length, and attends them.

    Stands for per-row speculative rollbacks that overwrite rejected draft tokens with zeros
    in a dense batch: a zero key still gets softmax weight (sglang-jax 1297).
    """

    def truncate_rows(self, lengths) -> None:
        before = list(self._lengths)
        super().truncate_rows(lengths)
        for row, (old, new) in enumerate(zip(before, self._lengths, strict=True)):
            self.key[row, :, new:old] = 0
            self.value[row, :, new:old] = 0
        self._lengths = before


class IdleRowAdvancedByNeighbour(PreallocatedCache):
    """A row that brings no tokens in a call is advanced by its neighbours' chunk anyway.

    Stands for batch caches that advance every row's offset by the call's length, whatever
    the row brought: an idle row then reads unwritten slots (mlx-vlm 1962).
    """

    def append_rows(self, key: Tensor, value: Tensor, counts) -> tuple[Tensor, Tensor, Tensor]:
        counts = tuple(counts.tolist() if isinstance(counts, Tensor) else counts)
        keys, values, valid = super().append_rows(key, value, counts)
        if 0 in counts and max(counts):
            self._lengths = [
                n + (max(counts) if c == 0 else 0)
                for n, c in zip(self._lengths, counts, strict=True)
            ]
            end = self.length
            valid = (
                torch.arange(end, device=self.key.device)[None, :]
                < torch.tensor(self._lengths, device=self.key.device)[:, None]
            )
            keys, values = self.key[: len(counts), :, :end], self.value[: len(counts), :, :end]
        return keys, values, valid


ROWS_MUTANTS = (OneOffsetForAllRows, RollbackZeroesRejectedRows, IdleRowAdvancedByNeighbour)
