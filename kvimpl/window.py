"""A ring buffer for sliding-window layers: memory bounded by the window, not the session.

With ``spec.window = W`` the query at position p sees keys p - W + 1 .. p, so an append of T
tokens needs the W - 1 rows before them and the T new ones; nothing older is ever seen again.
The rows live in a ring of ``capacity`` slots, position p in slot p % capacity, so writing
position p overwrites position p - capacity: a row no later query sees as long as
capacity >= W - 1 + T. The ring starts with no slots and, when an append of T would break
that, moves to W - 1 + T slots, copying only the rows still needed. It therefore holds
W - 1 + (the largest append so far) rows, whatever the length of the session.

``append`` returns every row the ring still holds, oldest first (at least the W - 1 + T the
new queries need, fewer only while the session is shorter): a view when they lie in one run
of slots, a joined copy when they wrap past the end. ``length`` counts every token since the
reset, and the cache never refuses for overflow. With ``window=None`` nothing is ever
overwritten: the ring keeps every row and doubles when full.

``export_rows`` gives the rows the ring holds, its recent run, and ``import_rows`` takes such
a run (at least the ``spec.rows_needed`` last rows), each row into the slot of its position
(section 11.2, ``kvimpl.movable.RecentRunMixin``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from kvimpl.movable import RecentRunMixin
from kvref.checks import check_append, check_reorder, check_truncate
from kvref.protocol import CacheSpec


class WindowCache(RecentRunMixin):
    def __init__(self, spec: CacheSpec) -> None:
        self.spec = spec
        # The rows before the new ones that an append must keep: each new query looks back
        # W - 1 positions; without a window, to the start.
        self.lookback = math.inf if spec.window is None else spec.window - 1
        self.key, self.value = self._storage(0), self._storage(0)
        self.reset()

    @property
    def length(self) -> int:
        return self._length

    @property
    def capacity(self) -> int:
        return self.key.shape[2]

    @property
    def nbytes(self) -> int:
        return self.key.nbytes + self.value.nbytes

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        new_tokens = check_append(self.spec, self._length, key, value)
        self._make_room(new_tokens)
        self._write(self.key, self._length, key)
        self._write(self.value, self._length, value)
        self._length += new_tokens
        self._held = min(self._held + new_tokens, self.capacity)
        return self._rows_to_move()

    def _rows_to_move(self) -> tuple[Tensor, Tensor]:
        first = self._length - self._held
        return self._read(self.key, first, self._held), self._read(self.value, first, self._held)

    def truncate(self, length: int) -> None:
        """Forget positions >= ``length``; refused when the query at ``length`` would need a
        position the ring has already overwritten."""
        check_truncate(self._length, length)
        oldest = self._length - self._held
        needed = max(0, length - self.lookback)  # the oldest position the next query sees
        if needed < length and oldest > needed:
            raise ValueError(
                f"truncate: cannot go back to {length} tokens: positions {needed}..{oldest - 1} "
                f"are gone (this window cache holds {oldest}..{self._length - 1}), and the "
                f"query at position {length} needs {needed}..{length - 1}"
            )
        self._held = max(0, length - oldest)
        self._length = length

    def reorder(self, indices: Tensor) -> None:
        check_reorder(self.spec, indices)
        for buffer in (self.key, self.value):
            for start, end in self._runs(self._length - self._held, self._held):
                buffer[:, :, start:end] = buffer[:, :, start:end].index_select(0, indices)

    def reset(self) -> None:
        self._length = 0
        self._held = 0  # rows of the most recent positions still in the ring

    def _make_room(self, new_tokens: int) -> None:
        """Grow the ring if writing ``new_tokens`` rows would overwrite a row still needed."""
        keep = min(self._held, self.lookback)
        if keep + new_tokens <= self.capacity:
            return
        if self.spec.window is None:
            capacity = max(keep + new_tokens, 2 * self.capacity)
        else:
            capacity = self.lookback + new_tokens
        first = self._length - keep
        kept = [self._read(buffer, first, keep) for buffer in (self.key, self.value)]
        self.key, self.value = self._storage(capacity), self._storage(capacity)
        self._write(self.key, first, kept[0])
        self._write(self.value, first, kept[1])
        self._held = keep

    def _write(self, buffer: Tensor, first: int, rows: Tensor) -> None:
        """Store the rows of positions first, first + 1, ... in their slots."""
        done = 0
        for start, end in self._runs(first, rows.shape[2]):
            buffer[:, :, start:end] = rows[:, :, done : done + end - start]
            done += end - start

    def _read(self, buffer: Tensor, first: int, count: int) -> Tensor:
        """The rows of positions first .. first + count - 1, oldest first."""
        parts = [buffer[:, :, start:end] for start, end in self._runs(first, count)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)

    def _runs(self, first: int, count: int) -> list[tuple[int, int]]:
        """The one or two slot ranges holding positions first .. first + count - 1."""
        start = first % self.capacity if self.capacity else 0
        end = start + count
        if end <= self.capacity:
            return [(start, end)]
        return [(start, self.capacity), (0, end - self.capacity)]

    def _storage(self, rows: int) -> Tensor:
        s = self.spec
        shape = (s.batch, s.kv_heads, rows, s.head_dim)
        return torch.zeros(shape, dtype=s.dtype, device=s.device)
