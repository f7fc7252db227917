"""A packed variable-length batch cache, in the style of flash-attn's varlen kernels
(``flash_attn_varlen_func`` and its ``cu_seqlens``) and the ragged batches of FlashInfer.

Written independently from ``docs/contract.md`` (sections 1-4 and 8.1, 8.3) only, as a third
implementation of rows of their own, in a layout none of the other independent caches uses.

Storage is ONE packed key tensor and ONE packed value tensor per cache, each
(total_tokens, H_kv, D) (the value's last axis its own width), holding every row's tokens back
to back, row 0's first, with no padding anywhere, and an int64 tensor of cumulative lengths
``cu_seqlens`` of B + 1 entries: row b's tokens are ``keys[cu_seqlens[b]:cu_seqlens[b + 1]]``,
oldest first. ``cu_seqlens`` lives on the host (it is read by every call; flash-attn keeps a
device copy for its kernel, which this cache has no use for). Nothing is reserved beyond what
is held: every change builds a new packed tensor of exactly the tokens kept, so ``nbytes`` is
the sum of the rows' lengths, never ``B x length``.

- ``append_rows(key, value, counts)``, ``padding = "left"``: row b's new tokens are the LAST
  ``counts[b]`` of the T input slots (a left-padded batch of prompts, as batch generation
  feeds it); they are picked out by a mask, so the pad slots are never read. The packed buffer
  is rebuilt by splicing: every old token moves to its index plus the counts of the rows
  before it, each row's new tokens land right after its old ones (two ``index_copy_`` into a
  new buffer whose every index is written once). The return is the packed rows scattered into
  a dense, zero-filled (B, H_kv, max(row_lengths), D) tensor, LEFT-aligned (row b's tokens in
  slots 0 .. row_lengths[b] - 1, zeros after them, as flash-attn's ``pad_input`` unpacks),
  and ``valid[b, i] = i < row_lengths[b]``.
- ``append(key, value)``: the batch fed as one, every row all T tokens. Refused while the rows'
  lengths differ (its dense return could not mark their pads); ``append_rows`` then.
- ``truncate_rows`` keeps each segment's head (a mask over the packed tokens), ``select_rows``
  gathers segments by their offsets in the new order, ``join`` concatenates the other cache's
  packed tensors and its offsets shifted by this cache's total.
- ``first_position`` is stored per row (an int64 host tensor) and travels with the rows
  through ``select_rows`` and ``join``; ``reset_at`` sets it, ``reset`` zeroes it. Both go
  back to ``spec.batch`` empty rows. ``spec`` shows the current number of rows as its batch.
- Capacity is per row: no row may hold more than ``spec.max_length`` tokens; a window is
  ignored (every row is kept, which rule 7 allows).

Every bad argument raises ``ValueError`` (``TypeError`` for an argument of the wrong type)
before anything changes. The tensors returned are fresh, never views of the packed storage,
so they stay valid whatever is called later.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor

from kvref import CacheSpec, check_append, check_append_rows

_HOST = torch.device("cpu")


def _whole(x: object) -> bool:
    """An int that is not a bool."""
    return isinstance(x, int) and not isinstance(x, bool)


def _offsets(lengths: Tensor) -> Tensor:
    """cu_seqlens of ``lengths``: 0, then their running sum (int64, host)."""
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=_HOST)
    torch.cumsum(lengths, 0, out=cu[1:])
    return cu


def _ranges(starts: Tensor, sizes: Tensor) -> Tensor:
    """Concatenation of ``arange(starts[i], starts[i] + sizes[i])`` over i (int64, host)."""
    total = int(sizes.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.int64, device=_HOST)
    begin_in_out = torch.cumsum(sizes, 0) - sizes
    step = torch.arange(total, dtype=torch.int64, device=_HOST)
    return step + torch.repeat_interleave(starts - begin_in_out, sizes)


class PackedVarlenCache:
    """One decoder layer's keys and values, every row's tokens packed into one tensor."""

    padding = "left"

    def __init__(self, spec: CacheSpec) -> None:
        if not isinstance(spec, CacheSpec):
            raise TypeError(f"spec must be a kvref.CacheSpec, got {type(spec).__name__}")
        self._built = spec
        self._device = torch.empty(0, device=spec.device).device
        self.reset()

    # ---------------------------------------------------------------- what the cache shows

    @property
    def spec(self) -> CacheSpec:
        return dataclasses.replace(self._built, batch=self._cu.numel() - 1)

    @property
    def row_lengths(self) -> tuple[int, ...]:
        return tuple(int(n) for n in self._cu.diff().tolist())

    @property
    def length(self) -> int:
        return int(self._cu.diff().max())

    @property
    def first_position(self) -> tuple[int, ...]:
        return tuple(int(p) for p in self._first.tolist())

    @property
    def cu_seqlens(self) -> Tensor:
        """Row b's tokens are packed rows ``cu_seqlens[b]`` to ``cu_seqlens[b + 1] - 1``."""
        return self._cu.clone()

    @property
    def nbytes(self) -> int:
        return int(self._keys.nbytes + self._values.nbytes)

    # ---------------------------------------------------------------- resets

    def reset(self) -> None:
        self._empty(torch.zeros(self._built.batch, dtype=torch.int64, device=_HOST))

    def reset_at(self, first_position: int | Sequence[int]) -> None:
        rows = self._built.batch
        if _whole(first_position):
            if first_position < 0:
                raise ValueError(f"reset_at: first_position must be >= 0, got {first_position}")
            firsts = [first_position] * rows
        elif isinstance(first_position, (tuple, list)):
            if len(first_position) != rows:
                raise ValueError(
                    f"reset_at: {len(first_position)} first positions for a batch of B={rows} "
                    f"rows: {list(first_position)}"
                )
            bad = [p for p in first_position if not _whole(p) or p < 0]
            if bad:
                raise ValueError(
                    f"reset_at: first positions must be ints >= 0, got {list(first_position)}"
                )
            firsts = list(first_position)
        else:
            raise TypeError(
                "reset_at: first_position must be an int or a tuple of ints, got "
                f"{type(first_position).__name__}"
            )
        self._empty(torch.tensor(firsts, dtype=torch.int64, device=_HOST))

    def _empty(self, firsts: Tensor) -> None:
        s = self._built
        like = {"dtype": s.dtype, "device": self._device}
        self._keys = torch.empty((0, s.kv_heads, s.head_dim), **like)
        self._values = torch.empty((0, s.kv_heads, s.value_width), **like)
        self._cu = torch.zeros(firsts.numel() + 1, dtype=torch.int64, device=_HOST)
        self._first = firsts

    # ---------------------------------------------------------------- feeding

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """Every row takes all T tokens; the rows must hold one length."""
        held = self.row_lengths
        new = check_append(self.spec, max(held), key, value, capacity=self._built.max_length)
        if min(held) != max(held):
            raise ValueError(
                f"append: the rows hold different lengths {list(held)}, and a dense return "
                "cannot mark their padding; feed them with append_rows"
            )
        keys, values, _ = self._splice(key, value, (new,) * len(held))
        return keys, values

    def append_rows(
        self, key: Tensor, value: Tensor, counts: Sequence[int]
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Row b takes the last ``counts[b]`` of the T slots; returns left-aligned rows."""
        counts = check_append_rows(
            self._built, self.row_lengths, key, value, counts, capacity=self._built.max_length
        )
        return self._splice(key, value, counts)

    def _splice(
        self, key: Tensor, value: Tensor, counts: tuple[int, ...]
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Write validated tokens: a new packed buffer, each row's new tokens after its old."""
        slots = key.shape[2]
        fed = torch.tensor(counts, dtype=torch.int64, device=_HOST)
        old_lengths = self._cu.diff()
        new_lengths = old_lengths + fed
        new_cu = _offsets(new_lengths)
        # The new tokens, row by row, oldest first: each row's last counts[b] slots.
        take = torch.arange(slots, device=_HOST).unsqueeze(0) >= (slots - fed).unsqueeze(1)
        take = take.to(self._device)
        new_keys = key.transpose(1, 2)[take]  # (sum(counts), H, D)
        new_values = value.transpose(1, 2)[take]
        # Where every packed token goes: old ones after the new tokens of the rows before
        # theirs, new ones right after their row's old ones.
        old_to = _ranges(new_cu[:-1], old_lengths)
        new_to = _ranges(new_cu[:-1] + old_lengths, fed)
        total = int(new_cu[-1])
        keys = torch.empty((total, *self._keys.shape[1:]), dtype=key.dtype, device=self._device)
        values = torch.empty(
            (total, *self._values.shape[1:]), dtype=value.dtype, device=self._device
        )
        for buf, old, new in ((keys, self._keys, new_keys), (values, self._values, new_values)):
            buf.index_copy_(0, old_to.to(self._device), old)
            buf.index_copy_(0, new_to.to(self._device), new)
        self._keys, self._values, self._cu = keys, values, new_cu
        return self._unpacked()

    def _unpacked(self) -> tuple[Tensor, Tensor, Tensor]:
        """The packed rows as a dense, left-aligned, zero-padded batch, and ``valid``."""
        lengths = self._cu.diff()
        rows, width = lengths.numel(), int(lengths.max())
        row_of = torch.repeat_interleave(torch.arange(rows, device=_HOST), lengths)
        slot_of = torch.arange(int(self._cu[-1]), device=_HOST) - torch.repeat_interleave(
            self._cu[:-1], lengths
        )
        row_of, slot_of = row_of.to(self._device), slot_of.to(self._device)
        out = []
        for packed in (self._keys, self._values):
            dense = packed.new_zeros((rows, packed.shape[1], width, packed.shape[2]))
            dense[row_of, :, slot_of] = packed  # advanced indices first: (tokens, H, D)
            out.append(dense)
        valid = torch.arange(width, device=self._device).unsqueeze(0) < lengths.to(
            self._device
        ).unsqueeze(1)
        return out[0], out[1], valid

    # ---------------------------------------------------------------- per-row changes

    def truncate_rows(self, lengths: Sequence[int]) -> None:
        """Row b keeps its first ``lengths[b]`` tokens; the others leave the packed buffer."""
        held = self.row_lengths
        if isinstance(lengths, Tensor) or not isinstance(lengths, (tuple, list)):
            raise TypeError(
                f"truncate_rows: lengths must be a tuple of ints, got {type(lengths).__name__}"
            )
        if len(lengths) != len(held):
            raise ValueError(
                f"truncate_rows: {len(lengths)} lengths for a batch of B={len(held)} rows: "
                f"{list(lengths)}"
            )
        for row, (keep, now) in enumerate(zip(lengths, held, strict=True)):
            if not _whole(keep) or not 0 <= keep <= now:
                raise ValueError(
                    f"truncate_rows: row {row} holds {now} tokens; it can keep an int from 0 "
                    f"to {now}, got {keep!r}"
                )
        kept = torch.tensor(list(lengths), dtype=torch.int64, device=_HOST)
        index = _ranges(self._cu[:-1], kept).to(self._device)
        self._keys = self._keys.index_select(0, index)
        self._values = self._values.index_select(0, index)
        self._cu = _offsets(kept)

    def select_rows(self, indices: Tensor) -> None:
        """The batch becomes rows ``indices``, in that order, each segment gathered whole."""
        rows = self._cu.numel() - 1
        if not isinstance(indices, Tensor):
            raise TypeError(
                f"select_rows: indices must be a torch.Tensor, got {type(indices).__name__}"
            )
        if indices.dtype != torch.int64:
            raise ValueError(
                f"select_rows: indices must have dtype torch.int64, got {indices.dtype}"
            )
        if indices.ndim != 1 or indices.numel() == 0:
            raise ValueError(
                f"select_rows: indices must be shaped (B',) with B' >= 1, got shape "
                f"{tuple(indices.shape)}"
            )
        if indices.device != self._device:
            raise ValueError(
                f"select_rows: indices are on device {indices.device}; this cache is on "
                f"device {self._device}"
            )
        chosen = [int(i) for i in indices.tolist()]
        if any(not 0 <= i < rows for i in chosen) or len(set(chosen)) != len(chosen):
            raise ValueError(
                f"select_rows: indices must be distinct rows in [0, {rows}), got {chosen}"
            )
        pick = torch.tensor(chosen, dtype=torch.int64, device=_HOST)
        lengths = self._cu.diff()[pick]
        index = _ranges(self._cu[:-1][pick], lengths).to(self._device)
        self._keys = self._keys.index_select(0, index)
        self._values = self._values.index_select(0, index)
        self._cu = _offsets(lengths)
        self._first = self._first[pick].clone()

    def join(self, other: PackedVarlenCache) -> None:
        """The rows of ``other`` become rows after the last: its packed tensors are appended
        to these and its offsets shifted by the tokens held here."""
        if not isinstance(other, PackedVarlenCache):
            raise TypeError(f"join: expects a PackedVarlenCache, got {type(other).__name__}")
        if other is self:
            raise ValueError("join: a cache cannot join itself")
        mine, theirs = self._built, other._built
        for field in ("kv_heads", "head_dim", "value_width", "dtype"):
            if getattr(mine, field) != getattr(theirs, field):
                raise ValueError(
                    f"join: the other cache has {field} {getattr(theirs, field)}, this one "
                    f"{getattr(mine, field)}"
                )
        if other._device != self._device:
            raise ValueError(
                f"join: the other cache is on device {other._device}, this one on {self._device}"
            )
        longest = other.length
        if longest > mine.max_length:
            raise ValueError(
                f"join: a joining row holds {longest} tokens, more than this cache's "
                f"max_length {mine.max_length}"
            )
        self._keys = torch.cat((self._keys, other._keys))
        self._values = torch.cat((self._values, other._values))
        self._cu = torch.cat((self._cu, other._cu[1:] + self._cu[-1]))
        self._first = torch.cat((self._first, other._first))
