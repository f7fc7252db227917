"""Broken paged pools (and one broken chunked ``attend``): each a few lines away from the
built-in ``kvimpl.paged`` pool or ``kvimpl.chunked``, with exactly one bug.

A pool mutant is a pool instance (a ``kvref.BlockPool`` factory) whose caches or books have
the bug; ``with_blocks`` gives a tight pool of the same broken kind. As in
``tests/mutants/caches.py``, the first line of each docstring names the bug and the rest the
real failure it stands for.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from kvimpl import ChunkedCache
from kvimpl.blockwise import BlockwiseAttention
from kvimpl.paged import PagedCache, PagedPool
from kvref import check_attend


class _MutantCache(PagedCache):
    """A paged cache with the hooks the mutants below change."""

    def _attend(self, query, key, value, blocks=None, merge=BlockwiseAttention) -> Tensor:
        """``attend`` as the built-in's, with ``blocks(length, size)`` blocks read and
        ``merge`` merging them: what the attend mutants change."""
        new_tokens = check_attend(self.spec, self._length, query, key, value)
        first = self._length
        self._write(key, value, new_tokens, doing="attend")
        self._length += new_tokens
        size = self.pool.block_size
        count = -(-self._length // size) if blocks is None else max(1, blocks(self._length, size))
        attention = merge(query, self.spec.kv_heads, first, self.spec.window)
        for index in range(count):
            start = index * size
            rows = min(size, self._length - start)
            if attention.sees(start, rows):
                keys, values = self._read(index)
                attention.add(keys[:, :, :rows], values[:, :, :rows], start)
        # A query whose whole window was skipped saw nothing: a kernel's 0 / 0, not an error.
        return torch.zeros_like(query) if attention.out is None else attention.result()


class _MutantPool(PagedPool):
    """A pool whose caches are ``cache_class``; named after its class in the mutant table."""

    cache_class = PagedCache

    @property
    def __name__(self) -> str:
        return type(self).__name__

    def __call__(self, spec) -> PagedCache:
        return self.cache_class(self, spec)

    def with_blocks(self, num_blocks: int, *, block_hash=None) -> _MutantPool:
        return type(self)(self.block_size, num_blocks, block_hash=block_hash)


class _SharesWithoutCopy(_MutantCache):
    def _rows_sharing(self, index: int) -> list[int]:
        return []


class ForkWithoutCopyOnWrite(_MutantPool):
    """``fork()`` shares every block, and a write into a shared block lands in place.

    Stands for a paged cache whose copy-on-write is missing or skipped (vLLM's prefix
    sharing and parallel sampling rely on it): after a fork of a prompt whose last block is
    partly filled, parent and child write their next tokens into the same block, and each
    reads the other's keys and values there.
    """

    cache_class = _SharesWithoutCopy


class CopyOnWriteKeysOnly(_MutantPool):
    """Copy-on-write copies a shared block's keys and forgets its values.

    Stands for a block copy kernel that handles one of the two caches (the key and value
    block tables are separate tensors in engines): the fork's copy holds the right keys and
    whatever values the fresh block had before, zeros or another request's.
    """

    def _copy_block(self, source: int, target: int) -> None:
        (from_segment, from_slot), (to_segment, to_slot) = map(self._locate, (source, target))
        to_segment.key[to_slot] = from_segment.key[from_slot]


class _ToleratesStaleIds(_MutantPool):
    # Stale ids may be free by now: counting them (fork, reorder) or dropping them again
    # must not crash, so that the bug stays silent.
    def _hold(self, ids: Iterable[int]) -> None:
        super()._hold(block for block in ids if block in self._refs)

    def _drop(self, ids: Iterable[int]) -> None:
        super()._drop(block for block in ids if block in self._refs)


class FreesSharedBlock(_ToleratesStaleIds):
    """Giving a block back frees it at once, whatever other tables still reference it.

    Stands for TensorRT-LLM issue 15018-like reference counting bugs: a request that
    finishes frees the prompt blocks it shares with its forks (or with a later request
    that reused the prompt), the next request is served into them, and the fork decodes on
    the newcomer's keys and values.
    """

    def _drop(self, ids: Iterable[int]) -> None:
        for block in ids:
            if block not in self._refs:
                continue  # freed already by another holder
            del self._refs[block]
            group = self._locate(block)[0].group
            group.in_use -= 1
            group.free.append(block)
            group.free.sort()  # still a heap: the smallest id is reused first


class _KeepsStaleTable(_MutantCache):
    def reset(self) -> None:
        # The blocks go back to the pool, but the table keeps their ids.
        self.pool._drop([block for row in self._tables for block in row])
        self._length = 0


class ResetKeepsStaleTable(_ToleratesStaleIds):
    """``reset()`` gives the blocks back but leaves their ids in the block tables.

    Stands for engines that reuse a persistent block-table buffer for the next request in a
    batch slot without clearing its tail: the new request writes and reads blocks the pool
    has since handed to another request (a cross-user clobber: each sees the other's keys).
    """

    cache_class = _KeepsStaleTable


class _MissesBlockOfOneRow(_MutantCache):
    def attend(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        # Counts the blocks of length - 1 rows.
        return self._attend(query, key, value, lambda length, size: -(-(length - 1) // size))


class AttendBlockOffByOne(_MutantPool):
    """``attend`` counts the blocks to read from ``length - 1`` rows: when the last block
    holds exactly one row, no query sees it.

    Stands for block-boundary off-by-ones in paged attention kernels (the number of blocks
    per sequence computed from the last position instead of the length): right for every
    length but one past a multiple of the block size, and append, which returns the rows,
    never shows it.
    """

    cache_class = _MissesBlockOfOneRow


class _NoRunningMax(BlockwiseAttention):
    def add(self, keys: Tensor, values: Tensor, start: int) -> None:
        keys, values = keys.to(self.wide), values.to(self.wide)
        scores = self.query @ keys.transpose(-2, -1)
        allowed = self._allowed(start, keys.shape[-2])
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        weights = torch.exp(scores)  # no maximum subtracted: exp overflows at large scores
        if self.out is None:
            self.max = scores.amax(-1, keepdim=True)
            self.sum, self.out = weights.sum(-1, keepdim=True), weights @ values
        else:
            self.sum = self.sum + weights.sum(-1, keepdim=True)
            self.out = self.out + weights @ values


class _MergesWithoutMax(_MutantCache):
    def attend(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        return self._attend(query, key, value, merge=_NoRunningMax)


class MergeForgetsRunningMax(_MutantPool):
    """The log-sum-exp merge of ``attend`` adds exp(score) of every block without
    subtracting the running maximum.

    Stands for online-softmax kernels that drop the max rescaling (or keep it in a dtype
    that overflows): exact for moderate scores, and inf / nan once a score passes exp's
    range (709 in float64, 88 in float32), as large keys, long contexts or unnormalised
    queries produce. The model's own scores stay small, so only attend's large draws show it.
    """

    cache_class = _MergesWithoutMax


class _NeverFinalized(_MutantCache):
    def _give_back_when_collected(self) -> None:
        pass  # the built-in's finalizer, left out


class DropLeaksBlocks(_MutantPool):
    """A cache dropped without ``reset()`` never gives its blocks back.

    Stands for engines that free a request's blocks only on its normal finish path: a
    request aborted, timed out or dropped by the scheduler keeps its blocks for ever, and the
    pool runs dry (and refuses valid requests) long after the cause. Every answer stays
    right until then.
    """

    cache_class = _NeverFinalized


class _TakesWhatIsLeft(_MutantCache):
    def _write(self, key: Tensor, value: Tensor, new_tokens: int, doing: str) -> None:
        size = self.pool.block_size
        new_columns = -(-(self._length + new_tokens) // size) - len(self._tables[0])
        for _ in range(new_columns):
            for row in self._tables:
                if not self.pool.blocks_free:
                    raise ValueError(f"{doing}: the pool is exhausted")
                row.extend(self.pool._take(self._group, 1))
        super()._write(key, value, new_tokens, doing)


class RefusalKeepsTakenBlocks(_MutantPool):
    """On a pool with fewer free blocks than an append needs, takes the ones left into the
    block tables, then refuses.

    Stands for allocators that take blocks one at a time and raise when they run out
    without undoing what they took: the refused request keeps blocks (a leak until it is
    reset) and block tables longer than its length, and the pool's counts change.
    """

    cache_class = _TakesWhatIsLeft


class ChunkPositionsOffByOne(ChunkedCache):
    """``attend`` places every chunk after the first one position late: a query at the
    first position of a chunk does not see its own key, and the window's edge moves by one.

    Stands for chunk-boundary off-by-ones in chunked (flash-decoding style) attention,
    where each chunk's start position is computed separately from the chunk index.
    """

    def attend(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        new_tokens = check_attend(self.spec, self._length, query, key, value)
        first = self._length
        self._store(key, value, new_tokens)
        size = self.chunk_size
        attention = BlockwiseAttention(query, self.spec.kv_heads, first, self.spec.window)
        for index in range(-(-self._length // size)):
            start = index * size
            rows = min(size, self._length - start)
            if attention.sees(start, rows):
                keys, values = self.chunks[index]
                attention.add(keys[:, :, :rows], values[:, :, :rows], start + (index > 0))
        return attention.result()


class _FinishedRowsKeepBlocks(_MutantCache):
    def select_rows(self, indices: Tensor) -> None:
        held = [block for row in self._tables for block in row]
        self.pool._hold(held)  # one reference more for every block: none is freed
        super().select_rows(indices)
        self.pool._drop(block for row in self._tables for block in row)


class FinishedRowsKeepTheirBlocks(_MutantPool):
    """Rows that finish and leave a batch (``select_rows``) keep their blocks in the pool.

    Stands for continuous batching that removes a finished request from the running batch
    without freeing its blocks: every answer stays right, and the pool runs dry after enough
    requests have come and gone.
    """

    cache_class = _FinishedRowsKeepBlocks


PAGED_MUTANTS = (
    ForkWithoutCopyOnWrite(),
    CopyOnWriteKeysOnly(),
    FreesSharedBlock(),
    ResetKeepsStaleTable(),
    AttendBlockOffByOne(),
    MergeForgetsRunningMax(),
    RefusalKeepsTakenBlocks(),
    DropLeaksBlocks(),
    FinishedRowsKeepTheirBlocks(),
    ChunkPositionsOffByOne,
)
