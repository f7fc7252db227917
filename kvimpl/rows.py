"""What a built-in with rows of their own keeps per batch row (contract, sections 8.1 and
8.3): each row's length and first position, and the checks of the per-row calls. The
built-ins that offer rows (``preallocated``, ``paged``) keep their storage their own way and
share this bookkeeping, and what it allows of a move (section 11.2: ``_movable``, which
overrides ``kvimpl.movable.MovableMixin``'s where a cache lists ``RowBook`` before it)."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from kvref.protocol import CacheSpec, is_count


class RowBook:
    """Per-row lengths and first positions; ``_lengths`` and ``_firsts`` are set by the cache."""

    padding = "right"  # append_rows: a row's new tokens in its first slots
    spec: CacheSpec
    _lengths: list[int]
    _firsts: list[int]

    @property
    def length(self) -> int:
        return max(self._lengths, default=0)

    # The batch's one length, for the calls that take the rows together (and the subclasses
    # in tests/mutants, written before rows had lengths of their own).
    @property
    def _length(self) -> int:
        return self.length

    @_length.setter
    def _length(self, length: int) -> None:
        self._lengths = [length] * self._rows()

    @property
    def row_lengths(self) -> tuple[int, ...]:
        return tuple(self._lengths)

    @property
    def first_position(self) -> tuple[int, ...]:
        return tuple(self._firsts)

    def _rows(self) -> int:
        return len(self._lengths)

    @property
    def _batch_spec(self) -> CacheSpec:
        """The spec, for the rows held now (``select_rows`` and ``join`` change how many)."""
        return dataclasses.replace(self.spec, batch=self._rows())

    def _movable(self, call: str) -> CacheSpec:
        """The spec rows moving in or out must fit (contract, section 11.2): the rows held
        now. ``kvref.CacheRows`` is one run of rows for the whole batch from position 0, so
        ``call`` is refused while the rows hold different numbers of tokens, or start at
        positions other than 0 (``reset_at``): rows of their own do not move yet."""
        if len(set(self._lengths)) > 1:
            raise ValueError(
                f"{call}: the rows hold different numbers of tokens {self._lengths}; rows of "
                f"their own do not move (kvref.CacheRows has one length for the batch)"
            )
        if any(self._firsts):
            raise ValueError(
                f"{call}: the rows start at positions {self._firsts} (reset_at); "
                f"kvref.CacheRows starts every row at position 0"
            )
        return self._batch_spec

    def _one_length(self, call: str, per_row: str) -> None:
        """Refuse ``call`` of the whole batch while rows hold different numbers of tokens."""
        if len(set(self._lengths)) > 1:
            raise ValueError(
                f"{call}: the rows hold different numbers of tokens {self._lengths}; "
                f"{per_row} takes one per row"
            )

    def _checked_lengths(self, lengths) -> tuple[int, ...]:
        """``truncate_rows``' argument: one length per row, each at most what the row holds."""
        lengths = tuple(lengths) if isinstance(lengths, (list, tuple)) else lengths
        if not isinstance(lengths, tuple) or len(lengths) != self._rows():
            raise ValueError(f"truncate_rows: give one length per row ({self._rows()})")
        for row, length in enumerate(lengths):
            if not is_count(length) or length > self._lengths[row]:
                raise ValueError(
                    f"truncate_rows: row {row} holds {self._lengths[row]} tokens; it cannot "
                    f"keep {length!r}"
                )
        return lengths

    def _checked_selection(self, indices: Tensor, device: torch.device) -> list[int]:
        """``select_rows``' argument: distinct rows held, int64, shaped (rows kept,)."""
        rows = self._rows()
        if not isinstance(indices, Tensor):
            raise TypeError(f"select_rows: indices must be a tensor, got {type(indices).__name__}")
        shaped = indices.dtype == torch.int64 and indices.ndim == 1 and indices.numel() > 0
        if not shaped or indices.device.type != device.type:
            raise ValueError(
                f"select_rows: indices must be int64 of shape (rows kept,), at least one, on "
                f"{device}; got {indices.dtype} {tuple(indices.shape)} on {indices.device}"
            )
        picked = indices.tolist()
        if min(picked) < 0 or max(picked) >= rows or len(set(picked)) != len(picked):
            raise ValueError(
                f"select_rows: indices must be distinct rows of the {rows} held, got {picked}"
            )
        return picked

    def _check_joinable(self, other: object, kind: type, needs: str) -> None:
        """``join``'s argument: another cache of ``kind`` (``needs`` says which, for the
        message), built for the same spec but the batch."""
        if not isinstance(other, kind) or other is self:
            raise ValueError(f"join: needs {needs}, got {type(other).__name__}")
        mine, theirs = (dataclasses.replace(s, batch=1) for s in (self.spec, other.spec))
        if mine != theirs:
            raise ValueError(f"join: built for {other.spec}, this cache for {self.spec}")

    @staticmethod
    def _checked_firsts(first_position, rows: int) -> list[int]:
        """``reset_at``'s argument as one position per row: an int >= 0, or ``rows`` of them."""
        firsts = (first_position,) * rows if is_count(first_position) else first_position
        if not isinstance(firsts, (list, tuple)) or len(firsts) != rows:
            raise ValueError(
                f"reset_at: first_position must be an int >= 0 or {rows} of them, got "
                f"{first_position!r}"
            )
        if not all(is_count(first) for first in firsts):
            raise ValueError(f"reset_at: positions must be ints >= 0, got {list(firsts)}")
        return list(firsts)
