"""A paged block pool, as serving engines have: many caches share one pool of fixed-size blocks.

``PagedPool`` is a cache factory (``kvref.BlockPool``): calling it with a ``CacheSpec`` gives a
``PagedCache`` for any layer of any request, and every such cache takes its blocks from the
pool. ``kvimpl.CACHES["paged"]`` and ``kvimpl.paged:pool`` are the default instance (blocks of
16 tokens, room for 2**20 of them), so ``--kv-impl paged`` and ``--kv-impl kvimpl.paged:pool``
work. Naming the class (``kvimpl.paged:PagedPool``) would not: it builds pools, not caches,
so called with a spec it raises a TypeError that says to name an instance.

Storage. Blocks of one shape live together: per (kv_heads, head_dim, value width, dtype,
device) the pool keeps segments, each a key tensor shaped (blocks, kv_heads, block_size,
head_dim) and a value tensor as wide as the values (a latent layer's are wider: contract,
section 10.2, which the pool declares it takes). A group gets its first segment (16
blocks) when a cache of that shape first appends, and each later one as large as all
before it, or what the append needs if more: a tiny test reserves kilobytes, and a group
never reserves more than 16 blocks or twice the most it has had in use at once, whichever
is larger.
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

Moves (contract, section 11.2, ``kvimpl.movable``): ``export_rows`` joins the rows from the
blocks, with the pool's ``block_size``; ``import_rows`` takes blocks for them as one append
does (refusing, having changed nothing, when too few are free), re-blocking the rows into this
pool's block size whatever block size they came from. Rows of their own move only while every
row holds one length from position 0 (``RowBook._movable``: an export of rows of different
lengths is refused). ``PagedPool.with_block_size(n)`` is an empty pool of the same room with
blocks of n tokens, for the other end of a move.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from kvimpl.blockwise import attend_blocks
from kvimpl.movable import MovableMixin
from kvimpl.prefix_index import BlockHash, Prefix, PrefixIndex
from kvimpl.rows import RowBook
from kvimpl.tree import TreeDraftsMixin
from kvref.checks import (
    check_append,
    check_append_rows,
    check_attend,
    check_reorder,
    check_truncate,
)
from kvref.moves import CacheRows
from kvref.protocol import CacheSpec

DEFAULT_BLOCK_SIZE = 16
DEFAULT_NUM_BLOCKS = 2**20  # only what is used is allocated; the suite never comes near it
FIRST_SEGMENT_BLOCKS = 16


@dataclass
class _Group:
    """The storage of every block shaped (kv_heads, block_size, head_dim) of one dtype and
    device, its values ``value_width`` wide (a latent layer's: contract, section 10.2), and
    its free blocks."""

    shape: tuple[int, int, int]
    value_width: int
    dtype: torch.dtype
    device: torch.device
    reserved: int = 0  # blocks in this group's segments
    in_use: int = 0
    free: list[int] = field(default_factory=list)  # a heap of ids: smallest reused first

    @property
    def block_nbytes(self) -> int:
        """Key and value bytes of one block."""
        heads, rows, width = self.shape
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return heads * rows * (width + self.value_width) * itemsize


@dataclass
class _Segment:
    group: _Group
    first_id: int
    key: Tensor  # (blocks, kv_heads, block_size, head_dim)
    value: Tensor
    extra: tuple[Tensor, ...] = ()  # a coded layout's scales (kvimpl.quantized_paged)

    @property
    def planes(self) -> tuple[Tensor, ...]:
        """Every tensor holding a part of each block, blocks first."""
        return (self.key, self.value, *self.extra)


class PagedPool:
    """A pool of ``num_blocks`` blocks of ``block_size`` tokens, and the factory of the caches
    that share it (``kvref.BlockPool``). See the module docstring for how it stores and
    counts blocks."""

    # Values of their own width in blocks of their own: latent (MLA) layers (section 10.2).
    kv_sizes: ClassVar[dict] = {"supports": {"latent": True}}

    def __init__(
        self,
        block_size: int = DEFAULT_BLOCK_SIZE,
        num_blocks: int = DEFAULT_NUM_BLOCKS,
        *,
        block_hash: BlockHash | None = None,
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
        self._index = PrefixIndex(block_hash)  # published blocks (prefix caching, 9.1)

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
        """Blocks an append may take: the free ones and the cached ones no cache holds."""
        return self.num_blocks - len(self._refs)

    @property
    def blocks_cached(self) -> int:
        return self._index.cached

    @property
    def blocks_evictable(self) -> int:
        return self._index.idle

    @property
    def nbytes_in_use(self) -> int:
        """Key and value bytes of the blocks in use, each block once."""
        return sum(group.in_use * group.block_nbytes for group in self._groups.values())

    @property
    def nbytes_reserved(self) -> int:
        """Key and value bytes of every segment allocated, in use or free."""
        return sum(group.reserved * group.block_nbytes for group in self._groups.values())

    def with_blocks(self, num_blocks: int, *, block_hash: BlockHash | None = None) -> PagedPool:
        return type(self)(self._block_size, num_blocks, block_hash=block_hash)

    def with_block_size(self, block_size: int) -> PagedPool:
        """A new, empty pool of the same kind, room and block hash, with blocks of
        ``block_size`` tokens: the other end of a move between block sizes (section 11.2)."""
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(
                f"with_block_size: block_size must be a positive int, got {block_size!r}"
            )
        return type(self)(block_size, self.num_blocks, block_hash=self._index.block_hash)

    def lookup_prefix(self, caches, tokens: Tensor, *, salt=None) -> int:
        """Declare ``tokens`` (B, T) to one request's empty caches, one per layer in layer
        order, and make each hold the longest whole-block prefix of every row's tokens
        published for its layer, salt and first position (contract, section 9.1)."""
        caches = self._checked_request(caches, tokens, salt)
        rows = tokens.tolist()
        found = [
            [cache._published_prefix(layer, salt, tokens, row) for row, tokens in enumerate(rows)]
            for layer, cache in enumerate(caches)
        ]
        blocks = min(len(hits) for layer in found for hits in layer)
        for layer, (cache, hits) in enumerate(zip(caches, found, strict=True)):
            cache._layer = layer
            cache._salts = [salt] * len(rows)
            cache._tokens = [list(row) for row in rows]
            for row, row_hits in enumerate(hits):
                kept = [block for block, _ in row_hits[:blocks]]
                self._hold(kept)
                cache._tables[row].extend(kept)
                cache._chain[row] = [key for _, key in row_hits[:blocks]]
            cache._lengths = [blocks * self._block_size] * len(rows)
        return blocks * self._block_size

    def _checked_request(self, caches, tokens: Tensor, salt) -> list[PagedCache]:
        if not isinstance(caches, (list, tuple)) or not caches:
            raise ValueError("lookup_prefix: caches must be a list of one request's caches")
        caches = list(caches)
        for layer, cache in enumerate(caches):
            if not isinstance(cache, PagedCache) or cache.pool is not self:
                raise ValueError(f"lookup_prefix: caches[{layer}] is not a cache of {self!r}")
            if cache.offloaded or any(cache._lengths) or cache._rows() != cache.spec.batch:
                raise ValueError(
                    f"lookup_prefix: caches[{layer}] is not empty (rows {cache._lengths})"
                )
        if len({id(cache) for cache in caches}) != len(caches):
            raise ValueError("lookup_prefix: the same cache is given for two layers")
        batch = caches[0].spec.batch
        if (
            not isinstance(tokens, Tensor)
            or tokens.dtype != torch.int64
            or tokens.ndim != 2
            or tokens.shape[0] != batch
            or any(cache.spec.batch != batch for cache in caches)
        ):
            got = tuple(tokens.shape) if isinstance(tokens, Tensor) else type(tokens).__name__
            raise ValueError(
                f"lookup_prefix: tokens must be int64 shaped (batch {batch}, T) for caches of "
                f"one batch, got {got}"
            )
        try:
            hash(salt)
        except TypeError:
            raise ValueError(f"lookup_prefix: salt must be hashable, got {salt!r}") from None
        return caches

    def refcount(self, block: int) -> int:
        """How many block-table entries reference ``block`` (0 when it is free)."""
        return self._refs.get(block, 0)

    # What the caches call.

    def _group(self, spec: CacheSpec) -> _Group:
        device = torch.device(spec.device)
        key = (spec.kv_heads, spec.head_dim, spec.value_width, spec.dtype, device)
        if key not in self._groups:
            shape = (spec.kv_heads, self._block_size, spec.head_dim)
            self._groups[key] = self._make_group(shape, spec.value_width, spec.dtype, device)
        return self._groups[key]

    # The block layout: rows as given here; a coded layout overrides these five
    # (kvimpl.quantized_paged), and everything else reads and writes blocks through them.
    def _make_group(self, shape, value_width: int, dtype, device) -> _Group:
        return _Group(shape, value_width, dtype, device)

    def _allocate(self, group: _Group, blocks: int) -> tuple[Tensor, ...]:
        """The planes of a new segment of ``blocks`` blocks: keys, values (and extras)."""
        storage = (blocks, *group.shape)
        key = torch.zeros(storage, dtype=group.dtype, device=group.device)
        value = torch.zeros(
            (*storage[:-1], group.value_width), dtype=group.dtype, device=group.device
        )
        return key, value

    def _write_slots(self, block: int, at: slice, key: Tensor, value: Tensor) -> None:
        """Store ``key`` and ``value`` (H_kv, n, D) at token slots ``at`` of ``block``."""
        segment, slot = self._locate(block)
        segment.key[slot, :, at] = key
        segment.value[slot, :, at] = value

    def _block_rows(self, block: int) -> tuple[Tensor, Tensor]:
        """The keys and values of every slot of ``block``, (H_kv, block_size, D), as rows."""
        segment, slot = self._locate(block)
        return segment.key[slot], segment.value[slot]

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
        # Cached blocks no cache holds stay in the room: evict the oldest to make space.
        for _ in range(len(self._refs) + self._index.idle + count - self.num_blocks):
            evicted = self._index.evict_oldest()
            heapq.heappush(self._locate(evicted)[0].group.free, evicted)
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
        key, value, *extra = self._allocate(group, blocks)
        first = self._next_id
        self._segments.append(_Segment(group, first, key, value, tuple(extra)))
        self._segment_starts.append(first)
        self._next_id += blocks
        group.reserved += blocks
        for block in range(first, first + blocks):
            heapq.heappush(group.free, block)

    def _hold(self, ids: Iterable[int]) -> None:
        for block in ids:
            if block in self._refs:
                self._refs[block] += 1
            else:  # an idle cached block, found by a prefix lookup
                self._index.wake(block)
                self._refs[block] = 1
                self._locate(block)[0].group.in_use += 1

    def _drop(self, ids: Iterable[int]) -> None:
        for block in ids:
            left = self._refs[block] - 1
            if left:
                self._refs[block] = left
                continue
            del self._refs[block]
            group = self._locate(block)[0].group
            group.in_use -= 1
            if self._index.is_published(block):
                self._index.rest(block)  # kept for later hits until evicted
            else:
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
        blocks = [self._block_rows(block) for block in ids]
        keys = torch.stack([key for key, _ in blocks])
        values = torch.stack([value for _, value in blocks])
        return keys, values

    def _copy_block(self, source: int, target: int) -> None:
        (from_segment, from_slot), (to_segment, to_slot) = map(self._locate, (source, target))
        for to_plane, from_plane in zip(to_segment.planes, from_segment.planes, strict=True):
            to_plane[to_slot] = from_plane[from_slot]


class PagedCache(TreeDraftsMixin, RowBook, MovableMixin):  # RowBook's _movable first
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
        self._shape = (
            spec.kv_heads,
            spec.head_dim,
            spec.value_width,
            spec.dtype,
            torch.device(spec.device),
        )
        self._forget_tokens()
        self._away: list[tuple[Tensor, Tensor]] | None = None  # the rows, while offloaded
        self._give_back_when_collected()

    def _forget_tokens(self) -> None:
        """Prefix caching (contract, section 9.1): per row, the tokens declared (None: not
        known, so nothing of the row is published), the chained keys of its leading blocks
        that are published (by it or another cache), its salt; and the cache's layer, told
        by ``lookup_prefix``."""
        rows = len(self._tables)
        self._tokens: list[list[int] | None] = [None] * rows
        self._chain: list[list] = [[] for _ in range(rows)]
        self._salts: list = [None] * rows
        self._layer: int | None = None

    def _give_back_when_collected(self) -> None:
        finalizer = weakref.finalize(self, self.pool._release, self._tables)
        finalizer.atexit = False  # at exit the pool goes too: nothing to give back

    @property
    def nbytes(self) -> int:
        if self._away is not None:  # held in host memory until restored
            return sum(key.nbytes + value.nbytes for key, value in self._away)
        references = sum(len(row) for row in self._tables)
        return references * self._group.block_nbytes

    @property
    def block_tables(self) -> list[list[int]]:
        return [list(row) for row in self._tables]

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        self._usable("append")
        self._one_length("append", "append_rows")
        new_tokens = check_append(self._batch_spec, self._length, key, value)
        self._fill(key, value, new_tokens, doing="append")
        return self._joined()

    def attend(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        self._usable("attend")
        self._one_length("attend", "append_rows")
        new_tokens = check_attend(self._batch_spec, self._length, query, key, value)
        first = self._length
        self._fill(key, value, new_tokens, doing="attend")
        return attend_blocks(
            query, self.spec, first, self._length, self.pool.block_size, self._read
        )

    def _fill(self, key: Tensor, value: Tensor, new_tokens: int, doing: str) -> None:
        """Store ``new_tokens`` rows after the ``length`` held (taking blocks, refusing before
        any change without them), count them and publish the blocks they fill."""
        self._write(key, value, new_tokens, doing)
        self._length += new_tokens
        self._publish_full_blocks()

    # --- moves (contract, section 11.2; ``kvimpl.movable``) ---------------------------------
    def _movable(self, call: str) -> CacheSpec:
        self._usable(call)
        return super()._movable(call)

    def _rows_to_move(self) -> tuple[Tensor, Tensor]:
        return self._joined()

    def _layout_block_size(self) -> int:
        return self.pool.block_size

    def _append_imported(self, rows: CacheRows) -> None:
        # Rows in position order, whatever block size they left: written into this pool's
        # blocks as an append writes them.
        self._fill(rows.keys, rows.values, rows.rows, doing="import_rows")

    def truncate(self, length: int) -> None:
        self._usable("truncate")
        self._one_length("truncate", "truncate_rows")
        check_truncate(self._length, length)
        self.truncate_rows([length] * self._rows())

    def reorder(self, indices: Tensor) -> None:
        self._usable("reorder")
        check_reorder(self._batch_spec, indices)
        old = [list(row) for row in self._tables]
        sources = indices.tolist()
        new = [list(old[source]) for source in sources]
        self.pool._hold(block for row in new for block in row)  # before dropping: none freed
        self.pool._drop(block for row in old for block in row)
        self._tables[:] = new
        self._take_rows(sources)

    def fork(self) -> PagedCache:
        self._usable("fork")
        twin = type(self)(self.pool, self.spec)  # a subclass's forks are of its class
        twin._tables[:] = [list(row) for row in self._tables]
        self.pool._hold(block for row in twin._tables for block in row)
        twin._layer = self._layer
        twin._lengths, twin._firsts = list(self._lengths), list(self._firsts)
        twin._take_rows(range(self._rows()), source=self)
        return twin

    def _take_rows(self, rows: Iterable[int], source: PagedCache | None = None) -> None:
        """Per-row state of ``source``'s (this cache's) rows ``rows``, in that order: after
        a reorder, a selection or a fork (the tables are done by the caller)."""
        source, rows = source or self, list(rows)
        self._lengths = [source._lengths[row] for row in rows]
        self._firsts = [source._firsts[row] for row in rows]
        self._tokens = [None if source._tokens[row] is None else list(source._tokens[row])
                        for row in rows]  # fmt: skip
        self._chain = [list(source._chain[row]) for row in rows]
        self._salts = [source._salts[row] for row in rows]

    def reset(self) -> None:
        """Every block back; the rows the cache was built for, empty, from position 0."""
        self.pool._release(self._tables)
        self._tables[:] = [[] for _ in range(self.spec.batch)]
        self._lengths = [0] * self.spec.batch
        self._firsts = [0] * self.spec.batch
        self._forget_tokens()
        self._away = None

    def reset_at(self, first_position) -> None:
        firsts = self._checked_firsts(first_position, self.spec.batch)
        self.reset()
        self._firsts = firsts

    # --- rows of their own (contract, section 8.1) ---------------------------------------
    def append_rows(self, key: Tensor, value: Tensor, counts) -> tuple[Tensor, Tensor, Tensor]:
        self._usable("append_rows")
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
        self._publish_full_blocks()
        return self._held_rows()

    def _own_last_block(self, row: int, start: int) -> None:
        """Before row ``row`` writes from ``start`` into its last block: a copy of its own
        if another table references it (copy-on-write), else out of the prefix index if it
        is published there (a published block never changes; unpublishing needs no block,
        where a copy would need one more than the rows)."""
        size, table = self.pool.block_size, self._tables[row]
        if not start % size:
            return
        block = table[start // size]
        if self.pool.refcount(block) > 1:
            [copy] = self.pool._take(self._group, 1)
            self.pool._copy_block(block, copy)
            self.pool._drop([block])
            table[start // size] = copy
        else:
            self.pool._index.withdraw(block)

    def _write_row(self, row: int, key: Tensor, value: Tensor) -> None:
        """Store ``key`` and ``value`` (H_kv, T, D) after batch row ``row``'s tokens, in its
        own blocks: fresh ones past its last, and a copy of its last first if it is shared."""
        size, table = self.pool.block_size, self._tables[row]
        start = self._lengths[row]
        end = start + key.shape[1]
        self._own_last_block(row, start)
        table += self.pool._take(self._group, -(-end // size) - len(table))
        for index in range(start // size, -(-end // size)):
            low, high = max(start, index * size), min(end, (index + 1) * size)
            at = slice(low - index * size, high - index * size)
            rows = slice(low - start, high - start)
            self.pool._write_slots(table[index], at, key[:, rows], value[:, rows])
        self._lengths[row] = end

    def _held_rows(self) -> tuple[Tensor, Tensor, Tensor]:
        """Every row's tokens joined from its blocks into one tensor as long as the longest
        row, and which slots each row holds. The other slots are left unwritten: what they
        hold is free (contract, 8.1), and filling them costs a write of every pad slot."""
        s, longest, size = self.spec, self.length, self.pool.block_size
        shape = (len(self._tables), s.kv_heads, longest, s.head_dim)
        keys = torch.empty(shape, dtype=s.dtype, device=s.device)
        values = torch.empty((*shape[:3], s.value_width), dtype=s.dtype, device=s.device)
        for row, (table, held) in enumerate(zip(self._tables, self._lengths, strict=True)):
            for index, block in enumerate(table):
                block_keys, block_values = self.pool._block_rows(block)
                low, high = index * size, min(held, (index + 1) * size)
                keys[row, :, low:high] = block_keys[:, : high - low]
                values[row, :, low:high] = block_values[:, : high - low]
        lengths = torch.tensor(self._lengths, device=keys.device)
        valid = torch.arange(longest, device=keys.device)[None, :] < lengths[:, None]
        return keys, values, valid

    def truncate_rows(self, lengths) -> None:
        self._usable("truncate_rows")
        lengths = self._checked_lengths(lengths)
        size = self.pool.block_size
        for row, (table, length) in enumerate(zip(self._tables, lengths, strict=True)):
            self.pool._drop(table[-(-length // size) :])
            del table[-(-length // size) :]
            del self._chain[row][length // size :]  # a block cut into is no longer its prefix
            if self._tokens[row] is not None:
                del self._tokens[row][length:]
        self._lengths = list(lengths)

    def select_rows(self, indices: Tensor) -> None:
        self._usable("select_rows")
        picked = self._checked_selection(indices, torch.device(self.spec.device))
        rows = self._rows()
        leaving = [block for row in set(range(rows)) - set(picked) for block in self._tables[row]]
        self._tables[:] = [self._tables[row] for row in picked]
        self._take_rows(picked)
        self.pool._drop(leaving)

    def join(self, other: PagedCache) -> None:
        self._check_joinable(other, PagedCache, "another PagedCache of the same pool")
        if other.pool is not self.pool:
            raise ValueError("join: needs another PagedCache of the same pool, got one of another")
        self._usable("join")
        other._usable("join")
        # The blocks change owner, not place: ``other``'s tables are emptied in place, so that
        # its finalizer gives nothing back.
        self._tables.extend(other._tables)
        self._lengths += other._lengths
        self._firsts += other._firsts
        # Rows of another layer (or none told) publish nothing here.
        same_layer = other._layer == self._layer
        self._tokens += other._tokens if same_layer else [None] * len(other._tables)
        self._chain += other._chain if same_layer else [[] for _ in other._tables]
        self._salts += other._salts
        other._tables[:], other._lengths, other._firsts = [], [], []
        other._forget_tokens()

    # --- prefix caching (contract, section 9.1) -------------------------------------------
    def declare_tokens(self, tokens: Tensor) -> None:
        """The next T tokens of every row, (B, T) int64, before their rows are appended."""
        self._usable("declare_tokens")
        if (
            not isinstance(tokens, Tensor)
            or tokens.dtype != torch.int64
            or tokens.ndim != 2
            or tokens.shape[0] != self._rows()
        ):
            got = tuple(tokens.shape) if isinstance(tokens, Tensor) else type(tokens).__name__
            raise ValueError(
                f"declare_tokens: tokens must be int64 shaped ({self._rows()}, T), got {got}"
            )
        for row, new in enumerate(tokens.tolist()):
            if self._tokens[row] is not None:
                self._tokens[row] += new

    def _published_prefix(self, layer: int, salt, tokens: list[int], row: int) -> list:
        """The published blocks holding the longest whole-block prefix of ``tokens`` for
        ``layer`` and ``salt`` from batch row ``row``'s first position, each with its
        chained key."""
        size, found, key = self.pool.block_size, [], None
        for end in range(size, len(tokens) + 1, size):
            key, prefix = self._block_key(key, tokens, end, layer, salt, row)
            block = self.pool._index.find(key, prefix)
            if block is None:
                break
            found.append((block, key))
        return found

    def _publishable(self, row: int) -> int:
        """How many leading blocks of row ``row`` are full, written and declared."""
        return min(self._lengths[row], len(self._tokens[row])) // self.pool.block_size

    def _block_key(self, parent, tokens: list[int], end: int, layer: int, salt, row: int):
        """The chained key and the identity of the block of ``tokens`` ending at ``end``, after
        the block keyed ``parent``: one computation for lookups and for publishing."""
        size = self.pool.block_size
        key = self.pool._index.chained(parent, tuple(tokens[end - size : end]), salt)
        return key, Prefix(self._shape, layer, salt, self._firsts[row], tuple(tokens[:end]))

    def _publish_full_blocks(self) -> None:
        """Publish every block that is now full, written and of declared tokens."""
        if self._layer is None:
            return
        size, index = self.pool.block_size, self.pool._index
        for row, (table, tokens, chain) in enumerate(
            zip(self._tables, self._tokens, self._chain, strict=True)
        ):
            if tokens is None:
                continue
            salt = self._salts[row]
            for block in range(len(chain), self._publishable(row)):
                parent = chain[-1] if chain else None
                key, prefix = self._block_key(
                    parent, tokens, (block + 1) * size, self._layer, salt, row
                )
                index.publish(table[block], key, prefix)
                chain.append(key)
            if self._lengths[row] > len(tokens):  # rows past the tokens declared: unknown
                self._tokens[row] = None

    # --- offload (contract, section 9.3) -------------------------------------------------
    @property
    def offloaded(self) -> bool:
        return self._away is not None

    def _usable(self, call: str) -> None:
        if self._away is not None:
            raise ValueError(f"{call}: the cache is offloaded; restore() it first")

    def offload(self) -> None:
        """Copy every row to host memory and give the blocks back to the pool."""
        self._usable("offload")
        keys, values, _ = self._held_rows()
        self._away = [
            (keys[row, :, :held].to("cpu", copy=True), values[row, :, :held].to("cpu", copy=True))
            for row, held in enumerate(self._lengths)
        ]
        self.pool._release(self._tables)
        self._chain = [[] for _ in self._tables]  # the rows come back in other blocks

    def restore(self) -> None:
        """Take blocks again and copy the rows back; refuse, changing nothing, without room."""
        if self._away is None:
            raise ValueError("restore: the cache is not offloaded")
        size = self.pool.block_size
        self.pool._refuse_unless_free(sum(-(-n // size) for n in self._lengths), "restore")
        away, self._away = self._away, None
        device = torch.device(self.spec.device)
        for row, (keys, values) in enumerate(away):
            self._lengths[row] = 0
            if keys.shape[1]:
                self._write_row(row, keys.to(device), values.to(device))
        self._publish_full_blocks()

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
        if start % size:  # a published block about to be written: out of the index first
            for row in self._tables:
                self.pool._index.withdraw(row[first_index])
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
            self.pool._write_slots(block, slice(low, high), key[batch_row], value[batch_row])

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
