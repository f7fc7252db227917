"""Style: a request-to-token table. Each batch row is a slot id into a dict of per-slot
tensors; the batch is the list of slot ids in row order (rows of their own, contract 8.1).

``_store[slot]`` is that row's ``(keys, values)``, (H, n, D) and (H, n, Dv), grown by
concatenation; ``_order[b]`` is the slot of batch row b. ``append_rows`` writes each row's
first ``counts[b]`` slots (right padding) to its own slot and returns the rows packed
densely, left-aligned, with ``valid`` marking each row's real slots. ``truncate_rows`` cuts
slots, ``select_rows`` drops the slots of rows that leave and reorders ``_order``, ``join``
moves the other cache's slots in under new ids. ``reset`` goes back to ``spec.batch`` empty
rows in slots 0 .. B-1.

The one bug (``JoinReusesLiveSlot``): ``join`` numbers a joining row's slot by the batch's
row count (``len(_order)``), which is a free id only while no row has left.

- First event: ``select_rows`` that lets a row leave (a finished request), leaving "slot ids
  that are no longer 0 .. B-1" (rows 0 and 2 of three stay: slots 0 and 2).
- Second event: ``join`` (a request prefilled alone enters the running batch).
- A correct cache gives the joining row a slot no row holds; this one gives it slot 2, which
  row 1 (once row 2) still holds: the joining row's rows replace that row's, and both read
  the same slot from then on. A ``join`` into a batch no row left is right (the ids are
  0 .. B-1 and the count is free), and so is any ``select_rows`` alone.

Stands for continuous-batching caches that index per-request storage by batch position
and take "the next index" after the batch was filtered (BUGS.md class 6 of its table, batch
split and merge, and section 1: mlx-lm's ``BatchKVCache`` filter and ``extend``, mlx-lm#1141):
a merged request reads, and overwrites, another's cache. The twin (``JoinTakesFreeSlot``)
takes the lowest id no row holds.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from kvref import check_append, check_append_rows


def _int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class JoinReusesLiveSlot:
    padding = "right"
    free_slot = False  # the bug: a joining row's slot id is the batch's row count

    def __init__(self, spec) -> None:
        self._spec = spec
        self.reset()

    def reset(self) -> None:
        self._order = list(range(self._spec.batch))
        self._store: dict[int, tuple[Tensor, Tensor]] = {s: self._empty() for s in self._order}

    def _empty(self) -> tuple[Tensor, Tensor]:
        s, like = self._spec, {"dtype": self._spec.dtype, "device": self._spec.device}
        return (
            torch.zeros((s.kv_heads, 0, s.head_dim), **like),
            torch.zeros((s.kv_heads, 0, s.value_width), **like),
        )

    @property
    def spec(self):
        """The spec, its batch the rows held now (``select_rows`` and ``join`` change it)."""
        return dataclasses.replace(self._spec, batch=len(self._order))

    @property
    def row_lengths(self) -> tuple[int, ...]:
        return tuple(self._store[slot][0].shape[1] for slot in self._order)

    @property
    def length(self) -> int:
        return max(self.row_lengths, default=0)

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self._store.values())

    def _packed(self) -> tuple[Tensor, Tensor, Tensor]:
        s, lengths = self._spec, self.row_lengths
        width, batch = max(lengths, default=0), len(self._order)
        like = {"dtype": s.dtype, "device": s.device}
        keys = torch.zeros((batch, s.kv_heads, width, s.head_dim), **like)
        values = torch.zeros((batch, s.kv_heads, width, s.value_width), **like)
        valid = torch.zeros((batch, width), dtype=torch.bool, device=s.device)
        for row, slot in enumerate(self._order):
            k, v = self._store[slot]
            n = k.shape[1]
            keys[row, :, :n], values[row, :, :n], valid[row, :n] = k, v, True
        return keys, values, valid

    def append_rows(self, key: Tensor, value: Tensor, counts) -> tuple[Tensor, Tensor, Tensor]:
        counts = check_append_rows(self._spec, self.row_lengths, key, value, counts)
        for row, (slot, count) in enumerate(zip(self._order, counts, strict=True)):
            if count:
                k, v = self._store[slot]
                self._store[slot] = (
                    torch.cat((k, key[row, :, :count]), dim=1),
                    torch.cat((v, value[row, :, :count]), dim=1),
                )
        return self._packed()

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        lengths = self.row_lengths
        new = check_append(self.spec, self.length, key, value)
        if len(set(lengths)) > 1:
            raise ValueError(
                f"append: the rows hold different lengths {list(lengths)}; a dense append "
                f"cannot say which slots are padding: use append_rows"
            )
        keys, values, _ = self.append_rows(key, value, (new,) * len(lengths))
        return keys, values

    def truncate_rows(self, lengths) -> None:
        held = self.row_lengths
        if not isinstance(lengths, (tuple, list)) or len(lengths) != len(held):
            raise ValueError(
                f"truncate_rows: lengths must be a tuple of {len(held)} ints (one per row), "
                f"got {lengths!r}"
            )
        for row, (n, now) in enumerate(zip(lengths, held, strict=True)):
            if not _int(n) or not 0 <= n <= now:
                raise ValueError(
                    f"truncate_rows: row {row} holds {now} tokens; its length must be an int "
                    f"from 0 to {now}, got {n!r}"
                )
        for slot, n in zip(self._order, lengths, strict=True):
            k, v = self._store[slot]
            self._store[slot] = (k[:, :n].clone(), v[:, :n].clone())

    def select_rows(self, indices) -> None:
        if not isinstance(indices, Tensor):
            raise TypeError(f"select_rows: indices must be a tensor, got {type(indices).__name__}")
        batch = len(self._order)
        if indices.dtype != torch.int64 or indices.ndim != 1 or not 1 <= len(indices) <= batch:
            raise ValueError(
                f"select_rows: indices must be int64 shaped (B',) with 1 <= B' <= {batch}, got "
                f"{indices.dtype} {tuple(indices.shape)}"
            )
        if indices.device.type != torch.device(self._spec.device).type:
            raise ValueError(f"select_rows: indices on {indices.device}, not {self._spec.device}")
        chosen = indices.tolist()
        if min(chosen) < 0 or max(chosen) >= batch or len(set(chosen)) != len(chosen):
            raise ValueError(
                f"select_rows: indices must be distinct rows in [0, {batch}), got {chosen}"
            )
        kept = [self._order[b] for b in chosen]
        for slot in set(self._order) - set(kept):
            del self._store[slot]  # the rows that leave give their slots back
        self._order = kept

    def _new_slot(self) -> int:
        if self.free_slot:
            return min(set(range(len(self._store) + 1)) - set(self._store))
        return len(self._order)  # Bug (free_slot False): a live slot once a row has left

    def join(self, other: JoinReusesLiveSlot) -> None:
        if not isinstance(other, JoinReusesLiveSlot) or other is self:
            raise ValueError(
                f"join: expects another cache of this kind, got {type(other).__name__}"
            )
        mine, theirs = self._spec, other._spec
        if (mine.kv_heads, mine.head_dim, mine.value_width, mine.dtype) != (
            theirs.kv_heads,
            theirs.head_dim,
            theirs.value_width,
            theirs.dtype,
        ):
            raise ValueError("join: the other cache holds rows of another shape or dtype")
        for slot in other._order:
            new = self._new_slot()
            self._store[new] = other._store[slot]
            self._order.append(new)
        other._order, other._store = [], {}  # not used again


class JoinTakesFreeSlot(JoinReusesLiveSlot):
    """The twin: a joining row takes the lowest slot id no row holds."""

    free_slot = True
