"""Broken caches that are right at every size a quick test tries and wrong only at the sizes
real caches run at: wide heads, many kv heads, big batches, page boundaries past 128
tokens, chunked prefills onto a warm cache, and a cache object reset many times.

Each threshold is a class attribute, so that a variant with another threshold (a page of
128, heads from 80 wide) is one line away: the suite must reach the whole class of bug,
not one threshold (``tests/test_mutants.py`` hunts such variants too).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from kvimpl import PreallocatedCache
from kvref import CacheSpec, check_append, check_reorder
from tests.mutants.caches import _RowWriter


class WideHeadsDropLastChannel(_RowWriter):
    """For head_dim >= 96, the last channel of every stored row is left at zero.

    Stands for a vectorised path chosen for wide heads whose last lane's loop bound is
    ``head_dim - 1``: every narrow head takes the scalar path and is right, and so is every
    test with head_dim 8.
    """

    wide_path = 96

    def _write(self, buffer: Tensor, start: int, rows: Tensor) -> None:
        if self.spec.head_dim >= self.wide_path:
            rows = rows.clone()
            rows[..., -1] = 0
        super()._write(buffer, start, rows)


class HeadTableOfFive(_RowWriter):
    """Kv heads past the fifth are written from the fifth: a per-head table of 5 entries,
    indexed with a clamp instead of a check.

    Stands for per-head strides, scales or block pointers sized for the largest model the
    author tried (5 kv heads) and read with ``min(head, 4)``: with 6 or more kv heads, the
    later heads alias head 4; with up to 5, nothing is wrong.
    """

    table = 5

    def _write(self, buffer: Tensor, start: int, rows: Tensor) -> None:
        heads = rows.shape[1]
        if heads > self.table:
            entry = torch.arange(heads, device=rows.device).clamp(max=self.table - 1)
            rows = rows.index_select(1, entry)
        super()._write(buffer, start, rows)


class BatchTilesOfFive(_RowWriter):
    """Writes a batch larger than 5 in tiles of 5 rows, and the second tile one row early.

    Stands for a copy kernel that tiles the batch (5 rows per block of its launch) with an
    off-by-one in a later tile's base offset: batch row 4 is overwritten by row 5, and the
    last row is never written. Every batch of up to 5 is one tile, and right.
    """

    tile = 5

    def _write(self, buffer: Tensor, start: int, rows: Tensor) -> None:
        end = start + rows.shape[2]
        for first in range(0, rows.shape[0], self.tile):
            base = first - 1 if first else 0  # a later tile starts one row early
            tile = rows[first : first + self.tile]
            buffer[base : base + tile.shape[0], :, start:end] = tile


class PageStraddle256(PreallocatedCache):
    """Pages of 256 rows from a pool, newest at the lowest address; an append is written as
    one run from the slot of its first row, as if it fitted in that page.

    Stands for a paged cache whose write path splits appends at page ends only in the read
    path: a chunk that crosses a page boundary (a prefill of 300 tokens, a warm chunk from
    250 to 260) spills its later rows into another page (here an earlier page of its own,
    or a spare one) and leaves the next page unwritten. Decoding one token at a time never
    crosses a boundary, and neither does any session shorter than a page.
    """

    page = 256

    def __init__(self, spec: CacheSpec) -> None:
        super().__init__(spec)
        self.pages = math.ceil(spec.max_length / self.page)
        # One spare page at the top of the pool, never read: a spill from the first page
        # lands there, as in a real pool it lands in some other sequence's page.
        shape = (spec.batch, spec.kv_heads, (self.pages + 1) * self.page, spec.head_dim)
        self.key = torch.zeros(shape, dtype=spec.dtype, device=spec.device)
        self.value = torch.zeros(shape, dtype=spec.dtype, device=spec.device)

    def _slot(self, position: int) -> int:
        page, row = divmod(position, self.page)
        return (self.pages - 1 - page) * self.page + row  # logical page k at pool page n-1-k

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        start = self._length
        end = start + check_append(self.spec, start, key, value, capacity=self.spec.max_length)
        slot = self._slot(start)
        fits = min(end - start, self.key.shape[2] - slot)  # the pool's end stops the spill
        self.key[:, :, slot : slot + fits] = key[:, :, :fits]
        self.value[:, :, slot : slot + fits] = value[:, :, :fits]
        self._length = end
        return self._gather(self.key), self._gather(self.value)

    def reorder(self, indices: Tensor) -> None:
        check_reorder(self.spec, indices)
        self.key, self.value = (
            self.key.index_select(0, indices),
            self.value.index_select(0, indices),
        )

    def _gather(self, buffer: Tensor) -> Tensor:
        slots = torch.tensor([self._slot(p) for p in range(self._length)], dtype=torch.long)
        return buffer.index_select(2, slots.to(buffer.device))


class WarmChunkWritesFromZero(_RowWriter):
    """An append of 40 tokens or more is written from row 0, even on a warm cache.

    Stands for a chunked-prefill fast path (one bulk copy for big appends) written for the
    first prefill, which starts at 0: decoding and small chunks take the general path and
    are right, a prompt is right, and only a big chunk onto a warm cache overwrites the
    start of the history.
    """

    bulk = 40

    def _write(self, buffer: Tensor, start: int, rows: Tensor) -> None:
        super()._write(buffer, 0 if rows.shape[2] >= self.bulk else start, rows)


class ResetCounterWraps(PreallocatedCache):
    """Counts resets in 3 bits, and takes the reset that wraps the count to 0 for a brand-new
    cache with nothing to clear: after the 8th reset the previous session is still there.

    Stands for an epoch or generation counter kept in a few bits (a page tag, a pool's
    generation) that also means "never used" at 0: every test that resets a cache fewer
    than 8 times passes; a server's long-lived cache object goes wrong on its 9th request.
    """

    wraps_at = 8

    def __init__(self, spec: CacheSpec) -> None:
        super().__init__(spec)
        self.resets = 0

    def reset(self) -> None:
        self.resets = (self.resets + 1) % self.wraps_at
        if self.resets == 0:
            return  # read as "a new cache": nothing to clear
        super().reset()


SIZE_MUTANTS = (
    WideHeadsDropLastChannel,
    HeadTableOfFive,
    BatchTilesOfFive,
    PageStraddle256,
    WarmChunkWritesFromZero,
    ResetCounterWraps,
)

# The size mutants at other thresholds: the search must reach the whole class of bug (a page
# of 128 or of 512, heads from 80 wide, warm chunks from 100), not the catalogue's thresholds
# alone (measured over seeds 1-10 too: docs/development.md, "Every mutant under other seeds").
SIZE_VARIANTS = (
    type("PageStraddle128", (PageStraddle256,), {"page": 128}),
    type("PageStraddle512", (PageStraddle256,), {"page": 512}),
    type("HeadsFrom80DropLastChannel", (WideHeadsDropLastChannel,), {"wide_path": 80}),
    type("WarmChunkFrom100WritesFromZero", (WarmChunkWritesFromZero,), {"bulk": 100}),
)
