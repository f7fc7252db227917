"""A paged block pool, as serving engines have: many caches share one pool of fixed-size blocks.

``PagedPool`` is a cache factory (``kvref.BlockPool``): calling it with a ``CacheSpec`` gives a
``PagedCache`` for any layer of any request, and every such cache takes its blocks from the
pool. ``kvimpl.CACHES["paged"]`` and ``kvimpl.paged:pool`` are the default instance (blocks of
16 tokens, room for 2**20 of them), so ``--kv-impl paged`` and ``--kv-impl kvimpl.paged:pool``
work. Naming the class (``kvimpl.paged:PagedPool``) would not: it builds pools, not caches,
so called with a spec it raises a TypeError that says to name an instance.

Storage. Blocks of one shape live together: per (kv_heads, head_dim, dtype, device) the pool
keeps segments, each a key tensor and a value tensor shaped (blocks, kv_heads, block_size,
head_dim). A group gets its first segment (16 blocks) when a cache of that shape first
appends, and each later one as large as all before it, or what the append needs if more: a
tiny test reserves kilobytes, and a group never reserves more than 16 blocks or twice the
most it has had in use at once, whichever is larger.
Block ids are ints unique in the pool: each segment owns a consecutive range of them.
Freed blocks go back to their group and are reused smallest id first, so the blocks that an
append takes for every batch row at once are usually adjacent in one segment, and attention
reads that column of blocks as one strided view.

The cap. ``num_blocks`` bounds the blocks in use (referenced by some live cache's block
table, a shared block once) summed over every group, whatever their shapes: ``blocks_free``
is ``num_blocks - blocks_in_use``, and an append needing more refuses. A group keeps the
storage it has grown (its free blocks wait for the next cache of that shape), so the bytes
reserved (``nbytes_reserved``) can exceed what is in use (``nbytes_in_use``).

A cache keeps one block table per batch row: the ids of its blocks, oldest first
(``block_tables``). Every row holds ceil(length / block_size) blocks: windows are not used
to free blocks (the model's mask applies the window), so ``append`` returns every row.
Blocks carry reference counts. ``fork()`` shares every block; ``reorder`` shares the blocks of
repeated rows. A write into a block another table still references (the partly filled last
block after a fork, or a full one after ``truncate`` went back into it) first copies that
block's keys and values to a fresh block: copy-on-write. Full shared blocks are never written
again, so they stay shared. Blocks go back to the pool on ``reset()``, ``truncate`` (the blocks
wholly past the new end), and when the cache is garbage-collected (``weakref.finalize``: the
finalizer holds the tables, never the cache).

``nbytes`` is the key and value bytes of the blocks this cache's tables reference, counted
once per reference: a block shared by two caches (or two rows after ``reorder``) counts in
each, so every cache alone meets the protocol's minimum, and the caches of one pool can sum
to more than the pool has in use (``PagedPool.nbytes_in_use`` counts each block once).

Rows of their own (contract, section 8.1): each batch row has its own length and first
position, and its own table. ``append_rows`` writes each row's new tokens into its own blocks
(copying a shared last block first) and returns every row's tokens joined, padded to the
longest row, with ``valid``; rows roll back (``truncate_rows``, freeing the blocks wholly past
each row's end), leave (``select_rows``, their blocks freed) and join (``join``: another
cache of the pool hands over its tables, its blocks changing owner, not place). The batch's
``append``, ``attend``, ``truncate`` and ``reorder`` take the rows while they hold one length.

When the pool has fewer free blocks than an append (or ``attend``, or its copy-on-write)
needs, it raises ``ValueError`` naming the pool and the blocks needed and free, having
changed nothing. ``attend`` computes attention block by block where the blocks lie
(``kvimpl.blockwise``), never joining the history into one tensor.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import itertools
import math
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from kvimpl.blockwise import attend_blocks
from kvimpl.rows import RowBook
from kvref.protocol import (
    CacheSpec,
    check_append,
    check_append_rows,
    check_attend,
    check_reorder,
    check_truncate,
)

DEFAULT_BLOCK_SIZE = 16
DEFAULT_NUM_BLOCKS = 2**20  # only what is used is allocated; the suite never comes near it
FIRST_SEGMENT_BLOCKS = 16


@dataclass
class _Group:
    """The storage of every block shaped (kv_heads, block_size, head_dim) of one dtype and
    device, and its free blocks."""

    shape: tuple[int, int, int]
    dtype: torch.dtype
    device: torch.device
    reserved: int = 0  # blocks in this group's segments
    in_use: int = 0
    free: list[int] = field(default_factory=list)  # a heap of ids: smallest reused first

    @property
    def block_nbytes(self) -> int:
        """Key and value bytes of one block."""
        return 2 * math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class _Segment:
    group: _Group
    first_id: int
    key: Tensor  # (blocks, kv_heads, block_size, head_dim)
    value: Tensor


class PagedPool:
    """A pool of ``num_blocks`` blocks of ``block_size`` tokens, and the factory of the caches
    that share it (``kvref.BlockPool``). See the module docstring for how it stores and
    counts blocks."""

    def __init__(
        self, block_size: int = DEFAULT_BLOCK_SIZE, num_blocks: int = DEFAULT_NUM_BLOCKS
    ) -> None:
        if isinstance(block_size, CacheSpec):
            raise TypeError(
                "PagedPool is the pool class, not a cache factory: name an instance instead "
                "(kvimpl.paged:pool, or your own PagedPool(block_size, num_blocks))"
            )
        for name, number in (("block_size", block_size), ("num_blocks", num_blocks)):
            if isinstance(number, bool) or not isinstance(number, int) or number < 1:
                raise ValueError(f"PagedPool: {name} must be a positive int, got {number!r}")
        self._block_size = block_size
        self.num_blocks = num_blocks
        self._groups: dict[tuple, _Group] = {}
        self._segments: list[_Segment] = []
        self._segment_starts: list[int] = []  # first ids, increasing, for bisect
        self._next_id = 0
        self._refs: dict[int, int] = {}  # id -> references from live block tables

    def __repr__(self) -> str:
        return f"PagedPool(block_size={self._block_size}, num_blocks={self.num_blocks})"

    def __call__(self, spec: CacheSpec) -> PagedCache:
        return PagedCache(self, spec)

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def blocks_in_use(self) -> int:
        return len(self._refs)

    @property
    def blocks_free(self) -> int:
        return self.num_blocks - len(self._refs)

    @property
    def nbytes_in_use(self) -> int:
        """Key and value bytes of the blocks in use, each block once."""
        return sum(group.in_use * group.block_nbytes for group in self._groups.values())

    @property
    def nbytes_reserved(self) -> int:
        """Key and value bytes of every segment allocated, in use or free."""
        return sum(group.reserved * group.block_nbytes for group in self._groups.values())

    def with_blocks(self, num_blocks: int) -> PagedPool:
        return PagedPool(self._block_size, num_blocks)

    def refcount(self, block: int) -> int:
        """How many block-table entries reference ``block`` (0 when it is free)."""
        return self._refs.get(block, 0)

    # What the caches call.

    def _group(self, spec: CacheSpec) -> _Group:
        device = torch.device(spec.device)
        key = (spec.kv_heads, spec.head_dim, spec.dtype, device)
        if key not in self._groups:
            shape = (spec.kv_heads, self._block_size, spec.head_dim)
            self._groups[key] = _Group(shape, spec.dtype, device)
        return self._groups[key]

    def _refuse_unless_free(self, needed: int, doing: str) -> None:
        if needed > self.blocks_free:
            raise ValueError(
                f"{doing}: the pool {self!r} is exhausted: this needs {needed} more blocks, "
                f"{self.blocks_free} of {self.num_blocks} are free ({self.blocks_in_use} in "
                f"use); nothing was changed"
            )

    def _take(self, group: _Group, count: int) -> list[int]:
        """``count`` free blocks of ``group``, smallest ids first, each now referenced once.
        The caller has checked that the pool has them (``_refuse_unless_free``)."""
        if len(group.free) < count:
            self._grow(group, count - len(group.free))
        ids = [heapq.heappop(group.free) for _ in range(count)]
        for block in ids:
            self._refs[block] = 1
        group.in_use += count
        return ids

    def _grow(self, group: _Group, at_least: int) -> None:
        # Doubling keeps segments few; the cap keeps a group from reserving more blocks than
        # could ever be in use at once.
        doubling = max(group.reserved, FIRST_SEGMENT_BLOCKS)
        blocks = max(min(doubling, self.num_blocks - group.reserved), at_least)
        storage = (blocks, *group.shape)
        key = torch.zeros(storage, dtype=group.dtype, device=group.device)
        value = torch.zeros(storage, dtype=group.dtype, device=group.device)
        first = self._next_id
        self._segments.append(_Segment(group, first, key, value))
        self._segment_starts.append(first)
        self._next_id += blocks
        group.reserved += blocks
        for block in range(first, first + blocks):
            heapq.heappush(group.free, block)

    def _hold(self, ids: Iterable[int]) -> None:
        for block in ids:
            self._refs[block] += 1

    def _drop(self, ids: Iterable[int]) -> None:
        for block in ids:
            left = self._refs[block] - 1
            if left:
                self._refs[block] = left
                continue
            del self._refs[block]
            group = self._locate(block)[0].group
            group.in_use -= 1
            heapq.heappush(group.free, block)

    def _release(self, tables: list[list[int]]) -> None:
        """Give back every block of ``tables`` and empty them (reset, and the finalizer)."""
        ids = [block for row in tables for block in row]
        for row in tables:
            row.clear()
        self._drop(ids)

    def _locate(self, block: int) -> tuple[_Segment, int]:
        segment = self._segments[bisect.bisect_right(self._segment_starts, block) - 1]
        return segment, block - segment.first_id

    def _column_view(self, ids: list[int]) -> tuple[Tensor, Tensor] | None:
        """Keys and values of blocks ``ids`` (one per batch row), each (len(ids), kv_heads,
        block_size, head_dim), as views into the pool (writes through them land in it):
        possible when the ids are evenly spaced in one segment, else None."""
        segment, first = self._locate(ids[0])
        step = ids[1] - ids[0] if len(ids) > 1 else 1
        last = first + step * (len(ids) - 1)
        if step < 1 or last >= segment.key.shape[0]:
            return None
        if any(later - earlier != step for earlier, later in itertools.pairwise(ids)):
            return None
        return segment.key[first : last + 1 : step], segment.value[first : last + 1 : step]

    def _column(self, ids: list[int]) -> tuple[Tensor, Tensor]:
        """As ``_column_view``, but a gathered copy when the blocks are scattered."""
        view = self._column_view(ids)
        if view is not None:
            return view
        places = [self._locate(block) for block in ids]
        keys = torch.stack([segment.key[slot] for segment, slot in places])
        values = torch.stack([segment.value[slot] for segment, slot in places])
        return keys, values

    def _copy_block(self, source: int, target: int) -> None:
        (from_segment, from_slot), (to_segment, to_slot) = map(self._locate, (source, target))
        to_segment.key[to_slot] = from_segment.key[from_slot]
        to_segment.value[to_slot] = from_segment.value[from_slot]


class PagedCache(RowBook):
    """One layer's keys and values in blocks of a ``PagedPool``; see the module docstring."""

    def __init__(self, pool: PagedPool, spec: CacheSpec) -> None:
        self.pool = pool
        self.spec = spec
        self._group = pool._group(spec)
        # Mutated in place only: the finalizer holds this very list, so that it can give the
        # blocks back without holding the cache.
        self._tables: list[list[int]] = [[] for _ in range(spec.batch)]
        self._lengths = [0] * spec.batch  # per row: its tokens
        self._firsts = [0] * spec.batch  # per row: the position of its first token
        self._give_back_when_collected()

    def _give_back_when_collected(self) -> None:
        finalizer = weakref.finalize(self, self.pool._release, self._tables)
        finalizer.atexit = False  # at exit the pool goes too: nothing to give back

    @property
    def _batch_spec(self) -> CacheSpec:
        """The spec, for the rows held now (select_rows and join change how many)."""
        return dataclasses.replace(self.spec, batch=len(self._tables))

    @property
    def nbytes(self) -> int:
        references = sum(len(row) for row in self._tables)
        return references * self._group.block_nbytes

    @property
    def block_tables(self) -> list[list[int]]:
        return [list(row) for row in self._tables]

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        self._one_length("append", "append_rows")
        new_tokens = check_append(self._batch_spec, self._length, key, value)
        self._write(key, value, new_tokens, doing="append")
        self._length += new_tokens
        return self._joined()

    def attend(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        self._one_length("attend", "append_rows")
        new_tokens = check_attend(self._batch_spec, self._length, query, key, value)
        first = self._length
        self._write(key, value, new_tokens, doing="attend")
        self._length += new_tokens
        return attend_blocks(
            query, self.spec, first, self._length, self.pool.block_size, self._read
        )

    def truncate(self, length: int) -> None:
        self._one_length("truncate", "truncate_rows")
        check_truncate(self._length, length)
        keep = -(-length // self.pool.block_size)
        dropped = [block for row in self._tables for block in row[keep:]]
        for row in self._tables:
            del row[keep:]
        self.pool._drop(dropped)
        self._length = length

    def reorder(self, indices: Tensor) -> None:
        check_reorder(self._batch_spec, indices)
        old = [list(row) for row in self._tables]
        sources = indices.tolist()
        new = [list(old[source]) for source in sources]
        self.pool._hold(block for row in new for block in row)  # before dropping: none freed
        self.pool._drop(block for row in old for block in row)
        self._tables[:] = new
        self._lengths = [self._lengths[source] for source in sources]
        self._firsts = [self._firsts[source] for source in sources]

    def fork(self) -> PagedCache:
        twin = type(self)(self.pool, self.spec)  # a subclass's forks are of its class
        twin._tables[:] = [list(row) for row in self._tables]
        self.pool._hold(block for row in twin._tables for block in row)
        twin._lengths, twin._firsts = list(self._lengths), list(self._firsts)
        return twin

    def reset(self) -> None:
        """Every block back; the rows the cache was built for, empty, from position 0."""
        self.pool._release(self._tables)
        self._tables[:] = [[] for _ in range(self.spec.batch)]
        self._lengths = [0] * self.spec.batch
        self._firsts = [0] * self.spec.batch

    def reset_at(self, first_position) -> None:
        firsts = self._checked_firsts(first_position, self.spec.batch)
        self.reset()
        self._firsts = firsts

    # --- rows of their own (contract, section 8.1) ---------------------------------------
    def append_rows(self, key: Tensor, value: Tensor, counts) -> tuple[Tensor, Tensor, Tensor]:
        counts = check_append_rows(self.spec, self._lengths, key, value, counts)
        size = self.pool.block_size
        needed = 0
        for row, count in enumerate(counts):
            held, table = self._lengths[row], self._tables[row]
            if count:
                needed += -(-(held + count) // size) - len(table)
                needed += bool(held % size) and self.pool.refcount(table[held // size]) > 1
        self.pool._refuse_unless_free(needed, "append_rows")
        for row, count in enumerate(counts):
            if count:
                self._write_row(row, key[row, :, :count], value[row, :, :count])
        return self._held_rows()

    def _write_row(self, row: int, key: Tensor, value: Tensor) -> None:
        """Store ``key`` and ``value`` (H_kv, T, D) after batch row ``row``'s tokens, in its
        own blocks: fresh ones past its last, and a copy of its last first if it is shared."""
        size, table = self.pool.block_size, self._tables[row]
        start = self._lengths[row]
        end = start + key.shape[1]
        if start % size and self.pool.refcount(table[start // size]) > 1:
            shared, [copy] = table[start // size], self.pool._take(self._group, 1)
            self.pool._copy_block(shared, copy)
            self.pool._drop([shared])
            table[start // size] = copy
        table += self.pool._take(self._group, -(-end // size) - len(table))
        for index in range(start // size, -(-end // size)):
            low, high = max(start, index * size), min(end, (index + 1) * size)
            segment, slot = self.pool._locate(table[index])
            at = slice(low - index * size, high - index * size)
            segment.key[slot, :, at] = key[:, low - start : high - start]
            segment.value[slot, :, at] = value[:, low - start : high - start]
        self._lengths[row] = end

    def _held_rows(self) -> tuple[Tensor, Tensor, Tensor]:
        """Every row's tokens joined from its blocks, padded with zeros to the longest row,
        and which slots each row holds."""
        s, longest, size = self.spec, self.length, self.pool.block_size
        shape = (len(self._tables), s.kv_heads, longest, s.head_dim)
        keys = torch.zeros(shape, dtype=s.dtype, device=s.device)
        values = torch.zeros_like(keys)
        for row, (table, held) in enumerate(zip(self._tables, self._lengths, strict=True)):
            for index, block in enumerate(table):
                segment, slot = self.pool._locate(block)
                low, high = index * size, min(held, (index + 1) * size)
                keys[row, :, low:high] = segment.key[slot, :, : high - low]
                values[row, :, low:high] = segment.value[slot, :, : high - low]
        lengths = torch.tensor(self._lengths, device=keys.device)
        valid = torch.arange(longest, device=keys.device)[None, :] < lengths[:, None]
        return keys, values, valid

    def truncate_rows(self, lengths) -> None:
        lengths = self._checked_lengths(lengths)
        for table, length in zip(self._tables, lengths, strict=True):
            keep = -(-length // self.pool.block_size)
            self.pool._drop(table[keep:])
            del table[keep:]
        self._lengths = list(lengths)

    def select_rows(self, indices: Tensor) -> None:
        picked = self._checked_selection(indices, torch.device(self.spec.device))
        rows = self._rows()
        leaving = [block for row in set(range(rows)) - set(picked) for block in self._tables[row]]
        self._tables[:] = [self._tables[row] for row in picked]
        self._lengths = [self._lengths[row] for row in picked]
        self._firsts = [self._firsts[row] for row in picked]
        self.pool._drop(leaving)

    def join(self, other: PagedCache) -> None:
        self._check_joinable(other, PagedCache, "another PagedCache of the same pool")
        if other.pool is not self.pool:
            raise ValueError("join: needs another PagedCache of the same pool, got one of another")
        # The blocks change owner, not place: ``other``'s tables are emptied in place, so that
        # its finalizer gives nothing back.
        self._tables.extend(other._tables)
        self._lengths += other._lengths
        self._firsts += other._firsts
        other._tables[:], other._lengths, other._firsts = [], [], []

    def _column_ids(self, index: int) -> list[int]:
        return [row[index] for row in self._tables]

    def _write(self, key: Tensor, value: Tensor, new_tokens: int, doing: str) -> None:
        """Store rows length .. length + new_tokens - 1, taking blocks and copying shared
        ones first; refuse before changing anything if the pool cannot supply them."""
        size = self.pool.block_size
        start, end = self._length, self._length + new_tokens
        first_index = start // size
        shared_rows = self._rows_sharing(first_index) if start % size else []
        new_columns = -(-end // size) - len(self._tables[0])
        needed = len(shared_rows) + new_columns * len(self._tables)
        self.pool._refuse_unless_free(needed, doing)
        fresh = iter(self.pool._take(self._group, needed))
        # Column by column, so that each column's blocks are adjacent ids where possible.
        for _ in range(new_columns):
            for row in self._tables:
                row.append(next(fresh))
        for batch_row in shared_rows:
            row = self._tables[batch_row]
            shared, copy = row[first_index], next(fresh)
            self.pool._copy_block(shared, copy)
            self.pool._drop([shared])
            row[first_index] = copy
        written = 0
        for index in range(first_index, -(-end // size)):
            low = max(start, index * size) - index * size
            high = min(end, (index + 1) * size) - index * size
            rows = slice(written, written + high - low)
            self._store(index, low, high, key[:, :, rows], value[:, :, rows])
            written += high - low

    def _rows_sharing(self, index: int) -> list[int]:
        """The batch rows whose block ``index`` another table entry still references once
        the rows before them have copied theirs: each must copy before writing."""
        refs: dict[int, int] = {}
        rows = []
        for batch_row, row in enumerate(self._tables):
            block = row[index]
            count = refs.get(block, self.pool.refcount(block))
            if count > 1:
                rows.append(batch_row)
                refs[block] = count - 1
        return rows

    def _store(self, index: int, low: int, high: int, key: Tensor, value: Tensor) -> None:
        """Write rows ``low:high`` of every batch row's block ``index``."""
        ids = self._column_ids(index)
        view = self.pool._column_view(ids)
        if view is not None:  # one write for every batch row
            view[0][:, :, low:high] = key
            view[1][:, :, low:high] = value
            return
        for batch_row, block in enumerate(ids):
            segment, slot = self.pool._locate(block)
            segment.key[slot, :, low:high] = key[batch_row]
            segment.value[slot, :, low:high] = value[batch_row]

    def _joined(self) -> tuple[Tensor, Tensor]:
        """Every row held, oldest first, joined into (B, H_kv, length, D) copies: only the
        rows written, none of a block's stale ones."""
        keys, values = [], []
        for index in range(len(self._tables[0])):
            rows = min(self.pool.block_size, self._length - index * self.pool.block_size)
            block_keys, block_values = self._read(index)
            keys.append(block_keys[:, :, :rows])
            values.append(block_values[:, :, :rows])
        return torch.cat(keys, dim=2), torch.cat(values, dim=2)

    def _read(self, index: int) -> tuple[Tensor, Tensor]:
        """Keys and values of every batch row's block ``index``, (B, H_kv, block_size, D)."""
        return self.pool._column(self._column_ids(index))


# The default pool: ``kvimpl.CACHES["paged"]`` and ``--kv-impl kvimpl.paged:pool``.
pool = PagedPool()
