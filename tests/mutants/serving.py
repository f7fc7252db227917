"""Broken serving pools (docs/contract.md, section 9): each the built-in ``paged`` pool, or
the independent radix pool (``tests/independent/radix_prefix_pool.py``), with one bug in how
it shares blocks by content (prefix caching) or swaps a request's rows out and back in. As in
``tests/mutants/paged.py``, the first paragraph of each docstring names the bug and the
second the real failure it stands for."""

from __future__ import annotations

import heapq

import torch

from kvimpl.paged import PagedCache
from kvimpl.prefix_index import Prefix, PrefixIndex
from tests.independent.radix_prefix_pool import RadixPrefixCache, RadixPrefixPool
from tests.mutants.paged import _MutantPool


class _MutantIndexPool(_MutantPool):
    """A pool whose published blocks are kept by ``index_class``."""

    index_class = PrefixIndex

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._index = self.index_class(self._index.block_hash)


class _PublishesWhenAllocated(PagedCache):
    def _publishable(self, row: int) -> int:
        # Every block whose tokens are all declared, once allocated, written or not.
        return min(len(self._tokens[row]) // self.pool.block_size, len(self._tables[row]))


class PublishesBlockBeforeWritten(_MutantIndexPool):
    """A block is published for matching as soon as it is allocated for declared tokens,
    before the forward has written all its rows.

    Stands for vLLM 41838 (and the async-scheduling races like it): blocks were marked
    cached when the scheduler allocated them, so a request scheduled in the same step found
    them and read rows no one had written yet.
    """

    cache_class = _PublishesWhenAllocated


class _KeepsEvictedInIndex(PrefixIndex):
    def __init__(self, *args) -> None:
        super().__init__(*args)
        self._evicted: dict = {}  # key -> (block, prefix): freed, and still found by key

    def evict_oldest(self) -> int:
        block, _ = self._idle.popitem(last=False)
        full_key, prefix = self._of_block[block]
        self._evicted[full_key] = (block, prefix)
        self._idle[block] = None
        return super().evict_oldest()

    def wake(self, block: int) -> None:
        self._idle.pop(block, None)  # a freed block, found again: taken twice

    def find(self, key, prefix: Prefix) -> int | None:
        found = super().find(key, prefix)
        if found is None:
            block, held = self._evicted.get((prefix.shape, prefix.layer, prefix.first, key), (0, 0))
            found = block if held == prefix else None
        return found


class EvictedBlockStillMatched(_MutantIndexPool):
    """An evicted block is freed for reuse but stays in the index, so a later lookup still
    finds it, now holding whatever its new owner wrote.

    Stands for eviction that frees the page before removing its node from the radix tree or
    its hash from the table (SGLang's radix cache evicting a node whose page was reused,
    tpu-inference 3412): one request's prompt is answered from another's rows.
    """

    index_class = _KeepsEvictedInIndex


class _ForgivesDoubleDrops(_MutantPool):
    """A pool whose broken reference counts drop a block twice: the second drop is ignored
    (instead of a KeyError in a cache's finalizer), the books show the rest."""

    def _drop(self, ids) -> None:
        super()._drop([block for block in ids if block in self._refs])


class FreesBlockWhileHitHoldsIt(_ForgivesDoubleDrops):
    """A prefix hit does not take a reference on the blocks it found, so when their first
    owner finishes they are freed (and reused) while the new request still reads them.

    Stands for mini-sglang 142 and vLLM's ref_cnt bugs: a page freed while a prefix match
    still pointed at it, so a finished request's neighbour decoded from recycled rows.
    """

    def lookup_prefix(self, caches, tokens, *, salt=None) -> int:
        self._looking_up = True
        try:
            return super().lookup_prefix(caches, tokens, salt=salt)
        finally:
            self._looking_up = False

    def _hold(self, ids) -> None:
        for block in ids:
            if getattr(self, "_looking_up", False) and block in self._refs:
                continue  # a hit on a block in use takes no reference of its own
            super()._hold([block])


class _TrustsTheKey(PrefixIndex):
    def find(self, key, prefix: Prefix) -> int | None:
        blocks = self._by_key.get((prefix.shape, prefix.layer, prefix.first, key), ())
        return blocks[0] if blocks else None  # no comparison of the tokens


class CollisionServedAsHit(_MutantIndexPool):
    """A lookup trusts the block hash: the first published block under a key is a hit,
    with no comparison of its tokens.

    Stands for prefix caches keyed by a truncated or weak hash (vLLM's builtin hash()
    before it moved to sha256, TensorRT-LLM's block reuse by 64-bit keys): two prompts
    whose keys collide share one user's rows.
    """

    index_class = _TrustsTheKey


class _OwnTokensOnly(PrefixIndex):
    def find(self, key, prefix: Prefix) -> int | None:
        # The block's own tokens, its length, layer and salt compared; not what came before.
        size = self.size
        for block in self._by_key.get((prefix.shape, prefix.layer, prefix.first, key), ()):
            held = self._of_block[block][1]
            if (held.tokens[-size:], len(held.tokens), held.salt) == (
                prefix.tokens[-size:],
                len(prefix.tokens),
                prefix.salt,
            ):
                return block
        return None


class _OwnTokensPool(_MutantIndexPool):
    index_class = _OwnTokensOnly

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._index.size = self.block_size


class ParentNotCompared(_OwnTokensPool):
    """A hit compares the block's own tokens (and salt) with the request's, not the tokens
    before it: the same block of tokens under another parent is served as a hit.

    Stands for block hashes that drop the parent's hash from the chain (or a radix match on
    one edge only): a request whose prompt shares a later block, but not the start, with
    another's reads rows computed after a different prefix.
    """


class _NeverWithdraws(PrefixIndex):
    def withdraw(self, block: int) -> None:
        pass  # a published block is written in place and stays published


class PublishedBlockRewritten(_MutantIndexPool):
    """A published block a request truncates back into is written in place, and stays
    published under the tokens it held before.

    Stands for prefix caches that do not treat cached blocks as immutable (vLLM's
    speculative-decoding rollbacks into a cached block, SGLang's radix nodes updated in
    place): the next turn of the chat finds the rejected draft's block and reads the rows
    written after the rollback.
    """

    index_class = _NeverWithdraws


class _Saltless(PrefixIndex):
    def chained(self, parent, tokens, salt):
        return super().chained(parent, tokens, None)

    def find(self, key, prefix: Prefix):
        return super().find(key, _without_salt(prefix))

    def publish(self, block, key, prefix: Prefix) -> None:
        super().publish(block, key, _without_salt(prefix))


def _without_salt(prefix: Prefix) -> Prefix:
    return Prefix(prefix.shape, prefix.layer, None, prefix.first, prefix.tokens)


class SaltIgnored(_MutantIndexPool):
    """The per-request salt is left out of the block key and the comparison, so tenants with
    the same prompt share blocks.

    Stands for vLLM's cache_salt not reaching every block hash (17560-style isolation
    bugs): one tenant's requests hit another's cached prompt, a cross-tenant leak and a
    timing side channel, with logits that look right.
    """

    index_class = _Saltless


class _PublishesPartialBlocks(PagedCache):
    def _publish_full_blocks(self) -> None:
        super()._publish_full_blocks()
        size = self.pool.block_size
        for row, (table, tokens) in enumerate(zip(self._tables, self._tokens, strict=True)):
            held = self._lengths[row]
            if tokens is None or self._layer is None or not held % size:
                continue
            # The partly filled last block too, keyed by the tokens it holds so far.
            key = ("partial", tuple(tokens[:held]))
            salt = self._salts[row]
            prefix = Prefix(self._shape, self._layer, salt, 0, tuple(tokens[:held]))
            self.pool._index.publish(table[-1], key, prefix)

    def _published_prefix(self, layer, salt, tokens, row):
        found = super()._published_prefix(layer, salt, tokens, row)
        size = self.pool.block_size
        for held in range(len(tokens), len(found) * size, -1):  # the longest partial match
            prefix = Prefix(self._shape, layer, salt, 0, tuple(tokens[:held]))
            block = self.pool._index.find(("partial", tuple(tokens[:held])), prefix)
            if block is not None:
                self._partial = held
                return [*found, (block, None)]
        return found

    # The hit's last block is written in place, on either path.
    def _own_last_block(self, row: int, start: int) -> None:
        pass

    def _rows_sharing(self, index: int) -> list[int]:
        return []


class _PartialHitPool(_MutantPool):
    cache_class = _PublishesPartialBlocks

    def lookup_prefix(self, caches, tokens, *, salt=None) -> int:
        hit = super().lookup_prefix(caches, tokens, salt=salt)
        partial = [getattr(cache, "_partial", None) for cache in caches]
        if hit and all(partial) and hit == -(-partial[0] // self.block_size) * self.block_size:
            for cache in caches:
                cache._lengths = [partial[0]] * len(cache._lengths)
            return partial[0]
        return hit


class HitOnPartlyFilledBlock(_PartialHitPool):
    """The partly filled last block of a prompt is published and matched, and the request
    that hits it writes its own next tokens into it in place.

    Stands for prefix caching that shares the last, partial block without copy-on-write
    (vLLM's and SGLang's early page-granular sharing): the second request's rows overwrite
    the first's in the block they share.
    """


class _RestoresIntoOldIds(PagedCache):
    def offload(self) -> None:
        self._usable("offload")
        self._away = [(torch.empty(0), torch.empty(0)) for _ in self._tables]
        self._kept_ids = [list(table) for table in self._tables]  # remembered, not copied
        self.pool._release(self._tables)

    def restore(self) -> None:
        if self._away is None:
            raise ValueError("restore: the cache is not offloaded")
        self._away = None
        for table, ids in zip(self._tables, self._kept_ids, strict=True):
            table.extend(ids)
            for block in ids:  # taken back, whoever wrote them meanwhile
                group = self.pool._locate(block)[0].group
                if block in group.free:
                    group.free.remove(block)
                    heapq.heapify(group.free)
                    self.pool._refs[block] = 1
                    group.in_use += 1
                else:  # in use by another cache, or cached and idle
                    self.pool._hold([block])


class RestoresIntoReusedBlocks(_ForgivesDoubleDrops):
    """Offload gives the blocks back without copying the rows out, and restore takes the same
    block ids back, whatever was written into them meanwhile.

    Stands for swap-in that trusts the old block table after the blocks were recycled
    (vLLM's swap-space and CPU-offload bugs): a preempted request resumes on another
    request's rows.
    """

    cache_class = _RestoresIntoOldIds


class _MutantRadixPool(RadixPrefixPool):
    """The independent radix pool whose caches are ``cache_class``; named after its class."""

    cache_class = RadixPrefixCache

    @property
    def __name__(self) -> str:
        return type(self).__name__

    def __call__(self, spec) -> RadixPrefixCache:
        return self.cache_class(self, spec)

    def with_blocks(self, num_blocks: int, *, block_hash=None) -> _MutantRadixPool:
        return type(self)(self.block_size, num_blocks)


class _TakesOneAtATime(RadixPrefixCache):
    def restore(self) -> None:
        if self._host is None:
            raise ValueError("restore: this cache is not offloaded")
        per_row = -(-self._count // self.pool.block_size)
        for table in self._tables:
            for _ in range(per_row):
                table.extend(self.pool._take(1, self._slab))  # raises when it runs out...
        # ...leaving the blocks taken so far in the tables, referenced, with no rows in them.
        _restore_rows(self)


def _restore_rows(cache: RadixPrefixCache) -> None:
    """The rest of the radix pool's restore, once the tables hold their blocks."""
    keys, values = cache._host
    cache._host = None
    if cache._count:
        device = torch.device(cache.spec.device)
        cache._scatter(0, keys.to(device), values.to(device))
    cache._publish_full_blocks()


class RestoreLeaksWhenShort(_MutantRadixPool):
    """``restore()`` takes its blocks one at a time and, when the pool runs out partway,
    refuses without giving back the ones it took.

    Stands for swap-in paths that allocate block by block (vLLM's CPU-offload connector,
    SGLang's host-to-device load-back) and leak the partial allocation on failure: each
    refused swap-in shrinks the pool until the scheduler deadlocks.
    """

    cache_class = _TakesOneAtATime


class _ReordersTablesOnly(RadixPrefixCache):
    def reorder(self, indices) -> None:
        tokens = [list(row) for row in self._tokens]
        super().reorder(indices)
        self._tokens = tokens  # the declared tokens stay with the old row order


class ReorderLeavesDeclaredTokens(_MutantRadixPool):
    """``reorder()`` permutes the block tables (and the rows) but not the declared tokens,
    so the blocks each row fills after are published under another row's tokens.

    Stands for beam search on a prefix-caching engine whose per-sequence token ids are kept
    apart from the block tables (vLLM's block manager forking beams, SGLang's req_to_token
    after a reorder): a later request whose prompt is one beam's text reads another beam's
    rows.
    """

    cache_class = _ReordersTablesOnly


class _ForkSharesTokens(RadixPrefixCache):
    def fork(self) -> RadixPrefixCache:
        child = super().fork()
        child._tokens = self._tokens  # the same lists: each one's declarations land in both
        return child


class ForkSharesTokenLists(_MutantRadixPool):
    """``fork()`` copies the block tables but hands the child the parent's lists of declared
    tokens, so the tokens either declares after are the other's too, and the blocks each
    fills are published under a mix of both.

    Stands for a shallow copy of a sequence's token list at fork (parallel sampling, n > 1,
    in vLLM's and SGLang's schedulers): a sample's blocks are hashed by its sibling's tokens,
    and a later prompt equal to that mix reads rows computed for other text.
    """

    cache_class = _ForkSharesTokens


class _PublishesOneRowEarly(RadixPrefixCache):
    def _publish_full_blocks(self) -> None:
        # "Full" counted from the next row: a block one row short of its end is published.
        self._count += 1
        try:
            super()._publish_full_blocks()
        finally:
            self._count -= 1


class PublishesBlockOneRowEarly(_MutantRadixPool):
    """A block is published once it holds ``block_size - 1`` rows of declared tokens: an off
    by one in the test for a full block.

    Stands for the boundary bugs of block publication (vLLM 41838's family, a `>=` for a
    `>` in a num_computed_tokens comparison): a request whose prompt was fed in chunks, one
    ending one token short of a block's end, has that block found by another request, which
    reads its last row before anyone wrote it.
    """

    cache_class = _PublishesOneRowEarly


SERVING_MUTANTS = (
    PublishesBlockBeforeWritten(),
    EvictedBlockStillMatched(),
    FreesBlockWhileHitHoldsIt(),
    CollisionServedAsHit(),
    ParentNotCompared(),
    SaltIgnored(),
    PublishedBlockRewritten(),
    HitOnPartlyFilledBlock(),
    RestoresIntoReusedBlocks(),
    RestoreLeaksWhenShort(),
    ReorderLeavesDeclaredTokens(),
    ForkSharesTokenLists(),
    PublishesBlockOneRowEarly(),
)
