"""Small-scope mutants: one-bug caches that only a conjunction of small exact sizes shows.

Each stands for a real bug class of ../shared/BUGS.md whose trigger is a few exact small
sizes at once (a chunk of one token right after a block filled, one kv head in a batch of
one together with a chunked prefill): the ci profile's random search, whose draws are wide,
rarely makes the conjunction, and the bounded-exhaustive mode (``Property.every_plan``)
makes every one up to N tokens. They are not in ``tests.mutants.MUTANTS`` (the ci hunt is not
held to catch them); the first line of each docstring says the bug. What the ci search and
the exhaustive mode make of each is measured in docs/exhaustive-power.md
(``tests.mutants.exhaustive_power``), and tests/test_exhaustive.py holds the plan of the
logits enumeration that first shows each.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvimpl import ChunkedCache, PreallocatedCache, WindowCache
from kvref import CacheSpec, check_append

SMALL_CHUNK = 3  # an internal block the cache does not declare to the kit (it keeps page 16)


class DecodeTailGoesStale(ChunkedCache):
    """A one-token decode that opens a new chunk writes there but keeps the full chunk as
    the decode path's tail, so the next one-token decode overwrites a row of the full chunk.

    Stands for chunked/paged buffers (BUGS.md appendix section 0, rank 3 and 4: "write/read
    slot-mapping mismatch", a cached pointer to the last block not moved on): a decode fast
    path that keeps the tail block instead of looking it up. It needs a block filled exactly
    (by any append), then two one-token appends in a row; its blocks are 3 rows, which it
    does not declare (the kit aims at its inherited page of 16).
    """

    def __init__(self, spec: CacheSpec) -> None:
        super().__init__(spec, chunk_size=SMALL_CHUNK)

    def reset(self) -> None:
        super().reset()
        self._tail: tuple[Tensor, Tensor] | None = None

    def truncate(self, length: int) -> None:
        super().truncate(length)
        self._tail = None  # looked up again by the next append (its chunk may be gone)

    def reorder(self, indices: Tensor) -> None:
        super().reorder(indices)
        self._tail = None  # the chunks are new tensors

    def _store(self, key: Tensor, value: Tensor, new_tokens: int) -> None:
        if new_tokens != 1 or self._tail is None:
            super()._store(key, value, new_tokens)
            self._tail = self.chunks[-1]
            return
        row = self._length % self.chunk_size
        tail = self._tail
        if row == 0:  # the tail is full: a new chunk (the bug: self._tail stays the old one)
            tail = self._new_chunk()
            self.chunks.append(tail)
        tail[0][:, :, row] = key[:, :, 0]
        tail[1][:, :, row] = value[:, :, 0]
        self._length += 1


class MqaDecodePositionFromPrompt(PreallocatedCache):
    """A single-sequence, single-kv-head decode fast path writes at a position it set to
    the last multi-token append's size, not to the length after it.

    Stands for length/position bookkeeping (BUGS.md appendix section 0, rank 4: "rows
    resident vs tokens seen"; ``antonellof/ferrox#88``, "seq_len meant two things"): the
    fast path's counter is right after a prefill and wrong after a chunked prefill (a
    multi-token chunk on a warm cache) in a batch of one with one kv head. The counter
    belongs to the length it was set at: any other call (truncate, reset) leaves the fast
    path off until the next multi-token append.
    """

    def __init__(self, spec: CacheSpec) -> None:
        super().__init__(spec)
        self._next, self._at = 0, -1  # the fast path's write position, valid at length _at

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        start = self.length
        single = self.spec.batch == 1 and self.spec.kv_heads == 1 and self._rows() == 1
        if not (single and self._at == start and start):
            keys, values = super().append(key, value)  # validates
            new = keys.shape[2] - start
            self._next = new if new > 1 else self.length  # the bug: the chunk's size, not its end
            self._at = self.length
            return keys, values
        new = check_append(self._batch_spec, start, key, value, capacity=self.spec.max_length)
        if new != 1:
            self._at = -1
            return self.append(key, value)
        self.key[0, 0, self._next] = key[0, 0, 0]
        self.value[0, 0, self._next] = value[0, 0, 0]
        self._next += 1
        self._lengths = [start + 1]
        self._at = start + 1
        return self._rows_to_move()


class TailFastPathAtBoundary(ChunkedCache):
    """An append that fits in the rest of the last chunk is written there in place, and the
    test for "fits" takes a full last chunk for an empty one.

    Stands for chunked/paged buffers (BUGS.md appendix, rank 1: off-by-one at a block edge,
    the slot taken as ``length % block`` without asking whether that block is full): it
    needs a length on a multiple of its undeclared 3-row chunk, then an append of up to 3.
    """

    def __init__(self, spec: CacheSpec) -> None:
        super().__init__(spec, chunk_size=SMALL_CHUNK)

    def _store(self, key: Tensor, value: Tensor, new_tokens: int) -> None:
        row = self._length % self.chunk_size
        if self.chunks and row + new_tokens <= self.chunk_size:
            chunk_key, chunk_value = self.chunks[-1]  # the bug: full when row is 0
            chunk_key[:, :, row : row + new_tokens] = key
            chunk_value[:, :, row : row + new_tokens] = value
            self._length += new_tokens
            return
        super()._store(key, value, new_tokens)


class RingGrowsInPlace(WindowCache):
    """When the ring must grow and the rows it keeps lie in one run of slots, it extends the
    buffer in place instead of moving each row to the slot of its position in the larger
    ring: wrong once the ring has wrapped, where a row's slot in the old ring is not its
    slot in the new one.

    Stands for sliding-window ring buffers (BUGS.md appendix, rank 1: "wrap index computed
    from the wrong counter", a multi-token update crossing the window; ``transformers#47708``,
    ``past_length % window`` right only until the ring wraps): it needs a small window, one
    wrap of the ring (decode steps past its first size) and then a chunk larger than any
    before it.
    """

    def _make_room(self, new_tokens: int) -> None:
        keep = min(self._held, self.lookback)
        if keep + new_tokens <= self.capacity or self.spec.window is None:
            super()._make_room(new_tokens)
            return
        first = self._length - keep
        runs = self._runs(first, keep)
        if len(runs) != 1:  # wrapped past the end of the buffer: moved row by row
            super()._make_room(new_tokens)
            return
        capacity = self.lookback + new_tokens
        grown = capacity - self.capacity  # the bug: rows stay in their old slots
        extra = (*self.key.shape[:2], grown, self.key.shape[3])
        pad = torch.zeros(extra, dtype=self.key.dtype, device=self.key.device)
        self.key = torch.cat((self.key, pad), dim=2)
        self.value = torch.cat((self.value, pad.clone()), dim=2)
        self._held = keep


SMALL_SCOPE_MUTANTS = (
    DecodeTailGoesStale,
    MqaDecodePositionFromPrompt,
    TailFastPathAtBoundary,
    RingGrowsInPlace,
)
