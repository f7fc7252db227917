"""Broken caches whose bug shows only when capabilities mix, as engines mix them: a reorder
after a fork, a truncate on a pool, two rollbacks in a row, a view read after another cache
of the factory was called, a write after a rollback into a shared block.

Each is a few lines away from a built-in (``kvimpl.paged``, ``kvimpl.concat``,
``kvimpl.chunked``) with exactly one bug, and each capability alone is right. As in
``tests/mutants/caches.py``, the first paragraph of each docstring names the bug and the rest
the real failure it stands for.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from kvimpl import ChunkedCache, ConcatCache
from kvref import check_reorder, check_truncate
from tests.independent.fifo_paged_pool import FifoPagedCache, FifoPagedPool
from tests.mutants.paged import _MutantCache, _MutantPool


class _ReordersRowsInPlace(_MutantCache):
    def reorder(self, indices: Tensor) -> None:
        check_reorder(self.spec, indices)
        # The rows move between the blocks the tables name; the tables stay as they are.
        for index in range(len(self._tables[0])):
            keys, values = self._read(index)
            self._store(index, 0, self.pool.block_size, keys[indices], values[indices])


class ReorderPermutesSharedBlocks(_MutantPool):
    """``reorder`` moves the rows between the cache's blocks in place, without copying a
    block that a fork still shares: the fork's rows are permuted with the parent's.

    Stands for beam search on a paged cache whose reorder copies key/value data (the way a
    contiguous cache reorders) into blocks that copy-on-write should have split first
    (xllm 1984: diverging beams read stale blocks for want of copy-on-write). A reorder
    alone is right, and so is a fork alone; a fork of a prompt followed by a reorder of
    either copy is not.
    """

    cache_class = _ReordersRowsInPlace


class _TruncateKeepsReferences(_MutantCache):
    def truncate(self, length: int) -> None:
        check_truncate(self._length, length)
        keep = -(-length // self.pool.block_size)
        for row in self._tables:
            del row[keep:]  # out of the table, but its reference is never dropped
        self._length = length


class TruncateLeaksBlocks(_MutantPool):
    """``truncate`` takes the blocks past the new end out of the block tables without
    dropping their references: they are never given back.

    Stands for rollback paths that shorten a request's block table and forget the allocator
    (a speculative rejection that trims the sequence but not its blocks; llama.cpp's server
    suite has a test named for the class, test_spec_checkpoint_kv_leak): every answer stays
    right, the pool's books (blocks in use against the distinct ids the tables hold) are
    wrong from the first truncate that drops a block, and a tight pool runs dry later.
    """

    cache_class = _TruncateKeepsReferences


class SecondRollbackCountsFromLastAppend(ConcatCache):
    """``truncate(length)`` drops as many tokens as lie past ``length`` at the last append:
    one rollback after appends is right, a second one before the next append drops too many.

    Stands for rollbacks expressed as "forget the k rejected tokens", k computed against a
    length snapshot taken when the draft was written (``trim(n)`` caches, mlx-lm and its
    forks): a rejection followed by a rewind in the same step (or a retry of a rejection)
    rolls back twice from one snapshot.
    """

    appended = 0  # the length at the last append

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        keys, values = super().append(key, value)
        self.appended = self.length
        return keys, values

    def truncate(self, length: int) -> None:
        check_truncate(self.length, length)
        rejected = self.appended - length
        super().truncate(max(0, self.length - rejected))


class JoinsIntoSharedScratch(ChunkedCache):
    """``append`` returns its joined rows as views of one scratch buffer that every cache of
    the class shares: another cache's next append overwrites the rows this one returned,
    where the contract keeps them valid until this cache's own next call.

    Stands for one workspace buffer shared by every layer and request (attention workspaces
    and CUDA-graph static outputs are shared so, to save memory): right as long as each
    caller is done with a result before the next layer runs, wrong for a caller that keeps
    one (a later read of layer 0's keys, a draft model and its target, two requests).
    """

    scratch: ClassVar[dict[tuple, Tensor]] = {}  # (keys or values, dtype, device) -> storage

    def _joined(self, which: int) -> Tensor:
        joined = super()._joined(which)
        place = (which, joined.dtype, joined.device)
        buffer = self.scratch.get(place)
        if buffer is None or buffer.numel() < joined.numel():
            buffer = self.scratch[place] = torch.empty_like(joined).flatten()
        return buffer[: joined.numel()].view(joined.shape).copy_(joined)


class _SkipsCopyOfFullBlocks(_MutantCache):
    high = 0  # the most rows held since the reset: the blocks below high // size were full

    def _write(self, key: Tensor, value: Tensor, new_tokens: int, doing: str) -> None:
        super()._write(key, value, new_tokens, doing)
        self.high = max(self.high, self._length + new_tokens)

    def _rows_sharing(self, index: int) -> list[int]:
        # "A full block is never written again": its references are not looked at.
        if index < self.high // self.pool.block_size:
            return []
        return super()._rows_sharing(index)

    def reset(self) -> None:
        super().reset()
        self.high = 0


class CopyOnWriteSkipsFullBlocks(_MutantPool):
    """Copy-on-write looks only at blocks that were never full: after a truncate back into a
    block that was full and is shared (with a fork, or by rows after a reorder with
    repeats), the next write lands in the shared block.

    Stands for paged caches that treat full blocks as immutable (vLLM's block manager copies
    on write only the partly filled last block of a fork; prefix caching takes a hashed full
    block for immutable) meeting a speculative rollback or a rewind that ends inside one: the other
    holder of the block reads the new tokens where its own were. A fork, a truncate without
    a fork, and appends after a fork are each right.
    """

    cache_class = _SkipsCopyOfFullBlocks


class _OnlyForksCopyOnWrite(FifoPagedCache):
    forked = False  # set on the caches fork() makes

    def fork(self) -> FifoPagedCache:
        child = super().fork()
        child.__class__, child.forked = type(self), True
        return child

    def truncate(self, length: int) -> None:
        if self.forked:
            return super().truncate(length)
        check_truncate(self._count, length)
        # The cache forked from takes its blocks for its own: no copy of a shared one.
        self._drop_from(-(-length // self.pool.block_size))
        self._count = length


class ParentTruncatesSharedBlocks(FifoPagedPool):
    """A truncate of the cache a fork was made from keeps a shared block it ends inside
    without copying it: the parent's next tokens overwrite its fork's rows there.

    Stands for copy-on-write applied on one side of a fork only: the forked sequence copies
    before it writes, the one it came from takes the blocks for its own (xllm 1984: beams
    read blocks another beam overwrote, for want of copy-on-write). A fork that truncates
    is right, and so is a parent that only decodes on; a parent rolled back into a shared
    block and decoding while its fork lives on is not.
    """

    @property
    def __name__(self) -> str:
        return type(self).__name__

    def __call__(self, spec) -> FifoPagedCache:
        return _OnlyForksCopyOnWrite(self, spec)

    def with_blocks(self, num_blocks: int) -> ParentTruncatesSharedBlocks:
        return type(self)(self.block_size, num_blocks)


INTERPLAY_MUTANTS = (
    ReorderPermutesSharedBlocks(),
    TruncateLeaksBlocks(),
    SecondRollbackCountsFromLastAppend,
    JoinsIntoSharedScratch,
    CopyOnWriteSkipsFullBlocks(),
    ParentTruncatesSharedBlocks(),
)
