"""A left-padded dense batch cache, in the style of batch generation in Hugging Face
transformers and MLX-LM.

Written independently from ``docs/contract.md`` (sections 1-4 and 8.1, 8.3) only, as a second
implementation of per-row lengths to hold the kit's future checks against.

Storage is what those libraries keep for one decoder layer of a batch: ONE dense key tensor and
ONE dense value tensor, each (B, H_kv, capacity, D), and a per-row left-padding count. The
slots in use are ``[0, width)``; every row's real tokens are right-aligned, ending at ``width``,
with ``width - row_lengths[b]`` pad slots in front of them (the "left padding" of a batch of
prompts of different lengths). Storage is reserved in steps of 256 slots, as MLX-LM's caches
grow, up to ``spec.max_length``; a ragged append, a per-row truncation, a selection of rows or a
join rebuild the layout so that ``width == max(row_lengths)`` always (the longest row has no
padding). Pad slots hold zeros, never a row that was given (nothing stale, nothing from the
caller's pad slots).

Members (contract section 1, 8.1 and 8.3):

- ``padding = "left"``: in ``append_rows(key, value, counts)`` row b's new tokens are the LAST
  ``counts[b]`` of the T slots; the other slots are the caller's padding and are never read.
- ``append(key, value)``: every row gets all T tokens. Its dense return cannot say which slots
  are padding, so it refuses (``ValueError``) while the rows have different lengths: use
  ``append_rows`` then.
- ``row_lengths``, ``first_position``, ``length`` (= ``max(row_lengths)``), ``nbytes`` (the
  bytes of both tensors as reserved), ``truncate_rows``, ``select_rows``, ``join``,
  ``reset()`` and ``reset_at(first_position)``.
- ``spec``: the constructor's spec with ``batch`` set to the current number of rows, which
  ``select_rows`` and ``join`` change; ``reset`` and ``reset_at`` go back to ``spec.batch``
  rows, as a new cache has.

Every bad argument raises ``ValueError`` (``TypeError`` for an argument of the wrong type) and
changes nothing: each method validates everything before it writes. A row may never exceed
``spec.max_length`` tokens; an append that would make one do so is refused. Input is always
copied; the tensors returned are views of the storage, valid until the next call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor

from kvref import CacheSpec

_STEP = 256  # slots reserved at a time, as MLX-LM's caches grow


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class LeftPaddedBatchCache:
    """One decoder layer's keys and values for a batch whose rows have lengths of their own."""

    padding = "left"

    def __init__(self, spec: CacheSpec) -> None:
        if not isinstance(spec, CacheSpec):
            raise TypeError(f"spec must be a kvref.CacheSpec, got {type(spec).__name__}")
        self._spec = spec
        # The device as tensors report it ("cuda" -> "cuda:0"), for comparisons.
        self._device = torch.empty(0, device=spec.device).device
        self.reset()

    # ------------------------------------------------------------------ state and properties

    @property
    def spec(self) -> CacheSpec:
        return self._cur_spec

    @property
    def batch(self) -> int:
        return len(self._lengths)

    @property
    def length(self) -> int:
        return max(self._lengths)

    @property
    def row_lengths(self) -> tuple[int, ...]:
        return tuple(self._lengths)

    @property
    def first_position(self) -> tuple[int, ...]:
        return tuple(self._first)

    @property
    def left_padding(self) -> tuple[int, ...]:
        """Pad slots in front of each row's tokens in the returned keys and values."""
        return tuple(self._width - n for n in self._lengths)

    @property
    def nbytes(self) -> int:
        return int(self._key.nbytes + self._value.nbytes)

    def reset(self) -> None:
        self._set_empty(self._spec.batch)

    def reset_at(self, first_position: int | Sequence[int]) -> None:
        b = self._spec.batch
        if _is_int(first_position):
            if first_position < 0:
                raise ValueError(f"first_position must be >= 0, got {first_position}")
            first = [first_position] * b
        elif isinstance(first_position, (tuple, list)):
            if len(first_position) != b:
                raise ValueError(
                    f"first_position must have one entry per batch row: batch B={b}, "
                    f"got {len(first_position)} entries {tuple(first_position)!r}"
                )
            for i, p in enumerate(first_position):
                if not _is_int(p):
                    raise ValueError(
                        f"first_position[{i}] must be an int, got {type(p).__name__} {p!r}"
                    )
                if p < 0:
                    raise ValueError(f"first_position[{i}] must be >= 0, got {p}")
            first = list(first_position)
        else:
            raise TypeError(
                "first_position must be an int or a tuple of ints, got "
                f"{type(first_position).__name__}"
            )
        self._set_empty(b)
        self._first = first

    def _set_empty(self, batch: int) -> None:
        self._lengths = [0] * batch
        self._first = [0] * batch
        self._width = 0
        self._key, self._value = self._alloc(batch, 0)
        self._cur_spec = dataclasses.replace(self._spec, batch=batch)

    # ------------------------------------------------------------------ appends

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """Every row gets all T tokens; returns (B, H_kv, length, D), every slot a real row.

        Raises ValueError while the rows' lengths differ: a dense return cannot show which
        slots are padding then (use ``append_rows``)."""
        t = self._check_kv(key, value)
        if len(set(self._lengths)) > 1:
            raise ValueError(
                f"rows have different lengths {self.row_lengths}: append's dense return cannot "
                "mark their padding; use append_rows"
            )
        counts = (t,) * self.batch
        self._check_room(counts)
        self._store(key, value, counts)
        w = self._width
        return self._key[:, :, :w], self._value[:, :, :w]

    def append_rows(
        self, key: Tensor, value: Tensor, counts: Sequence[int]
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Row b stores the last ``counts[b]`` of the T slots of ``key`` and ``value``.

        Returns keys and values (B, H_kv, L, D) and ``valid`` (B, L): row b's True slots are
        its rows since the reset, oldest first."""
        t = self._check_kv(key, value)
        counts = self._check_counts(counts, t)
        self._check_room(counts)
        self._store(key, value, counts)
        return self._views()

    def _check_kv(self, key: Tensor, value: Tensor) -> int:
        s = self._spec
        for name, x in (("key", key), ("value", value)):
            if not isinstance(x, Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
            if x.ndim != 4:
                raise ValueError(
                    f"{name} must have rank 4 (B, H_kv, T, D), got ndim {x.ndim} with shape "
                    f"{tuple(x.shape)}"
                )
            if x.dtype != s.dtype:
                raise ValueError(f"{name} has dtype {x.dtype}; this cache holds dtype {s.dtype}")
            if x.device != self._device:
                raise ValueError(
                    f"{name} is on device {x.device}; this cache holds device {self._device}"
                )
        if key.shape != value.shape:
            raise ValueError(
                f"key {tuple(key.shape)} and value {tuple(value.shape)} must have the same shape"
            )
        t = key.shape[2]
        want = (self.batch, s.kv_heads, t, s.head_dim)
        if tuple(key.shape) != want:
            got = tuple(key.shape)
            for axis, label in ((0, "batch B"), (1, "kv_heads H_kv"), (3, "head_dim D")):
                if got[axis] != want[axis]:
                    raise ValueError(
                        f"key and value have {label}={got[axis]}!={want[axis]}: shape {got}, "
                        f"expected (B, H_kv, T, D) = {want}"
                    )
        if t == 0:
            raise ValueError(
                f"zero new tokens (T = 0) in shape {tuple(key.shape)}: give at least 1"
            )
        return t

    def _check_counts(self, counts: Sequence[int], t: int) -> tuple[int, ...]:
        if not isinstance(counts, (tuple, list)):
            raise TypeError(f"counts must be a tuple of ints, got {type(counts).__name__}")
        if len(counts) != self.batch:
            raise ValueError(
                f"counts must have one entry per batch row: batch B={self.batch}, got "
                f"{len(counts)} counts {tuple(counts)!r}"
            )
        for i, c in enumerate(counts):
            if not _is_int(c):
                raise ValueError(f"counts[{i}] must be an int, got {type(c).__name__} {c!r}")
            if c < 0 or c > t:
                raise ValueError(f"counts[{i}] = {c} is out of range 0..T={t}")
        return tuple(counts)

    def _check_room(self, counts: tuple[int, ...]) -> None:
        m = self._spec.max_length
        for i, (n, c) in enumerate(zip(self._lengths, counts, strict=True)):
            if n + c > m:
                raise ValueError(
                    f"row {i} holds {n} tokens; {c} more would exceed max_length {m} "
                    f"(at most {m - n} more fit)"
                )

    def _store(self, key: Tensor, value: Tensor, counts: tuple[int, ...]) -> None:
        """Write validated rows. Keeps every row right-aligned at width = max(row_lengths)."""
        tmax = max(counts)
        if tmax == 0:
            return
        t_slots = key.shape[2]
        w = self._width
        new_lengths = [n + c for n, c in zip(self._lengths, counts, strict=True)]
        if all(c == tmax for c in counts):
            # Every row gets the same number: the rows stay where they are and the new tokens
            # go after them (the decode step's path).
            if w + tmax > self._key.shape[2]:
                k, v = self._alloc(self.batch, self._capacity_for(w + tmax))
                k[:, :, :w] = self._key[:, :, :w]
                v[:, :, :w] = self._value[:, :, :w]
                self._key, self._value = k, v
            self._key[:, :, w : w + tmax] = key[:, :, t_slots - tmax :]
            self._value[:, :, w : w + tmax] = value[:, :, t_slots - tmax :]
        else:
            # Ragged: rebuild, each row right-aligned at the new width.
            nw = max(new_lengths)
            k, v = self._alloc(self.batch, self._capacity_for(nw))
            for b, (n, c) in enumerate(zip(self._lengths, counts, strict=True)):
                start = nw - n - c
                if n:
                    k[b, :, start : start + n] = self._key[b, :, w - n : w]
                    v[b, :, start : start + n] = self._value[b, :, w - n : w]
                if c:
                    k[b, :, nw - c : nw] = key[b, :, t_slots - c :]
                    v[b, :, nw - c : nw] = value[b, :, t_slots - c :]
            self._key, self._value = k, v
        self._lengths = new_lengths
        self._width = max(new_lengths)

    # ------------------------------------------------------------------ per-row changes

    def truncate_rows(self, lengths: Sequence[int]) -> None:
        """Row b keeps its first ``lengths[b]`` tokens; the rest are gone (their slots become
        zeroed padding)."""
        if not isinstance(lengths, (tuple, list)):
            raise TypeError(f"lengths must be a tuple of ints, got {type(lengths).__name__}")
        if len(lengths) != self.batch:
            raise ValueError(
                f"lengths must have one entry per batch row: batch B={self.batch}, got "
                f"{len(lengths)} lengths {tuple(lengths)!r}"
            )
        for i, n in enumerate(lengths):
            if not _is_int(n):
                raise ValueError(f"lengths[{i}] must be an int, got {type(n).__name__} {n!r}")
            if n < 0 or n > self._lengths[i]:
                raise ValueError(
                    f"lengths[{i}] = {n} is out of range 0..{self._lengths[i]} "
                    f"(row {i} holds {self._lengths[i]} tokens)"
                )
        new_lengths = list(lengths)
        if new_lengths == self._lengths:
            return
        w = self._width
        nw = max(new_lengths)
        k, v = self._alloc(self.batch, self._capacity_for(nw))
        for b, (old, n) in enumerate(zip(self._lengths, new_lengths, strict=True)):
            if n:
                k[b, :, nw - n : nw] = self._key[b, :, w - old : w - old + n]
                v[b, :, nw - n : nw] = self._value[b, :, w - old : w - old + n]
        self._key, self._value = k, v
        self._lengths = new_lengths
        self._width = nw

    def select_rows(self, indices: Tensor) -> None:
        """The batch becomes rows ``indices`` (int64, (B',), distinct, in [0, B)), in order."""
        if not isinstance(indices, Tensor):
            raise TypeError(f"indices must be a torch.Tensor, got {type(indices).__name__}")
        if indices.dtype != torch.int64:
            raise ValueError(f"indices must have dtype torch.int64, got {indices.dtype}")
        if indices.ndim != 1:
            raise ValueError(
                f"indices must have rank 1, shape (B',), got shape {tuple(indices.shape)}"
            )
        if indices.device != self._device:
            raise ValueError(
                f"indices are on device {indices.device}; this cache is on device {self._device}"
            )
        if indices.numel() == 0:
            raise ValueError("indices are empty: select at least one row (B' >= 1)")
        idx = [int(i) for i in indices.tolist()]
        bad = [i for i in idx if i < 0 or i >= self.batch]
        if bad:
            raise ValueError(f"indices {bad} are out of range [0, B={self.batch})")
        if len(set(idx)) != len(idx):
            raise ValueError(f"indices {idx} have repeats; each row may be selected once")
        new_lengths = [self._lengths[i] for i in idx]
        new_first = [self._first[i] for i in idx]
        w = self._width
        nw = max(new_lengths)
        k, v = self._alloc(len(idx), self._capacity_for(nw))
        if nw:
            sel = torch.tensor(idx, dtype=torch.int64, device=self._device)
            k[:, :, :nw] = self._key[:, :, w - nw : w].index_select(0, sel)
            v[:, :, :nw] = self._value[:, :, w - nw : w].index_select(0, sel)
        self._key, self._value = k, v
        self._lengths = new_lengths
        self._first = new_first
        self._width = nw
        self._cur_spec = dataclasses.replace(self._spec, batch=len(idx))

    def join(self, other: LeftPaddedBatchCache) -> None:
        """Append ``other``'s rows (with their lengths and first positions) after the last.

        ``other`` must be another LeftPaddedBatchCache for the same kv_heads, head_dim, dtype,
        device and window (batch and max_length may differ); its rows are copied and it is
        left as it was."""
        if not isinstance(other, LeftPaddedBatchCache):
            raise TypeError(f"can only join a LeftPaddedBatchCache, got {type(other).__name__}")
        if other is self:
            raise ValueError("cannot join a cache with itself")
        mine, theirs = self._spec, other._spec
        for field in ("kv_heads", "head_dim", "dtype", "window"):
            a, b = getattr(mine, field), getattr(theirs, field)
            if a != b:
                raise ValueError(f"cannot join: other cache has {field} {b}, this one {a}")
        if other._device != self._device:
            raise ValueError(
                f"cannot join: other cache is on device {other._device}, this one on {self._device}"
            )
        m = mine.max_length
        long = [n for n in other._lengths if n > m]
        if long:
            raise ValueError(
                f"cannot join: other cache has rows of {long} tokens, more than this cache's "
                f"max_length {m}"
            )
        b1, b2 = self.batch, other.batch
        w1, w2 = self._width, other._width
        nw = max(w1, w2)
        k, v = self._alloc(b1 + b2, self._capacity_for(nw))
        if w1:
            k[:b1, :, nw - w1 : nw] = self._key[:, :, :w1]
            v[:b1, :, nw - w1 : nw] = self._value[:, :, :w1]
        if w2:
            k[b1:, :, nw - w2 : nw] = other._key[:, :, :w2]
            v[b1:, :, nw - w2 : nw] = other._value[:, :, :w2]
        self._key, self._value = k, v
        self._lengths = self._lengths + list(other._lengths)
        self._first = self._first + list(other._first)
        self._width = nw
        self._cur_spec = dataclasses.replace(self._spec, batch=b1 + b2)

    # ------------------------------------------------------------------ helpers

    def _views(self) -> tuple[Tensor, Tensor, Tensor]:
        w = self._width
        pads = torch.tensor([w - n for n in self._lengths], dtype=torch.int64, device=self._device)
        valid = torch.arange(w, device=self._device).unsqueeze(0) >= pads.unsqueeze(1)
        return self._key[:, :, :w], self._value[:, :, :w], valid

    def _capacity_for(self, width: int) -> int:
        # width <= max_length always: no row may exceed it, and the longest row has no pad.
        steps = -(-width // _STEP) * _STEP
        return max(width, min(steps, self._spec.max_length))

    def _alloc(self, batch: int, capacity: int) -> tuple[Tensor, Tensor]:
        s = self._spec
        shape = (batch, s.kv_heads, capacity, s.head_dim)
        return (
            torch.zeros(shape, dtype=s.dtype, device=self._device),
            torch.zeros(shape, dtype=s.dtype, device=self._device),
        )
