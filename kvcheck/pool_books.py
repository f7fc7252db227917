"""A block pool's books against the caches alive on it, audited after every event.

Where the factory is a ``kvref.BlockPool``, the engine runs a plan on a pool of its own
(``with_blocks``), so that every block in use belongs to a cache of the plan:

- ``blocks_in_use + blocks_free`` is the pool's room, always;
- ``blocks_in_use`` is the number of distinct block ids in the live caches' tables (where
  they show them, ``kvref.BlockTables``; else it lies within what the rows need);
- each batch row's table has ceil(rows / block_size) entries (a window may drop some), rows
  being that row's own where rows have lengths of their own (``row_lengths``);
- each cache's ``nbytes`` covers what it holds;
- once every request has finished, every block is back.
"""

from __future__ import annotations

import math

from kvcheck import failures
from kvref import BlockPool, BlockTables, CacheFactory, PrefixCaching, min_nbytes


def fresh_pool(factory: CacheFactory, blocks: int, block_hash=None) -> CacheFactory:
    """A pool of the factory's kind with room for ``blocks``, when it is a BlockPool (keyed
    by ``block_hash`` where one is given); else the factory itself."""
    if not isinstance(factory, BlockPool):
        return factory
    if block_hash is None:
        return factory.with_blocks(blocks)
    return factory.with_blocks(blocks, block_hash=block_hash)


def audit(pool: BlockPool, engine, *, where: str) -> None:
    """The books of ``pool`` against the live requests of ``engine``."""
    in_use, free, size = pool.blocks_in_use, pool.blocks_free, pool.block_size
    capacity = sum(engine.pool_before)
    if in_use + free != capacity:
        raise failures.DataLoss(
            f"the pool: blocks_in_use {in_use} + blocks_free {free} = {in_use + free}, but "
            f"the pool has room for {capacity} blocks\n  {where}"
        )
    ids: set[int] = set()
    tables_shown = True
    most, least = 0, 0
    for request in engine.live.values():
        for layer, recorder in enumerate(request.caches or ()):
            cache = recorder.cache
            who = f"{request.name}'s layer {layer}"
            if getattr(cache, "offloaded", False):  # its rows are out of the pool (9.3)
                _check_offloaded(cache, who, where)
                continue
            # Each row's tokens: its own where rows have lengths of their own (section 8.1).
            lengths = list(getattr(cache, "row_lengths", [cache.length] * request.batch))
            # The spec the model built this layer's cache from, not one the cache may show.
            spec = engine.model.cache_spec(1, engine.max_length, layer=layer)
            kept = [n if spec.window is None else min(n, spec.window - 1) for n in lengths]
            most += sum(math.ceil(n / size) for n in lengths)
            least = max(least, *(math.ceil(n / size) for n in kept))
            # Under a declared lossy storage (section 10.1) a row may be in codes (after a
            # truncate even a recent one: its precision does not come back), so the least
            # counts every row at its declaration's least.
            storage = recorder.storage
            fewest_bytes = sum(min_nbytes(spec, n, storage, (n, n)) for n in lengths)
            if cache.nbytes < fewest_bytes:
                raise failures.WrongResults(
                    f"{who}: nbytes is {cache.nbytes} holding {lengths} tokens by row, which "
                    f"take at least {fewest_bytes} bytes (each cache counts every block it "
                    f"reads, shared ones included)\n  {where}"
                )
            if not isinstance(cache, BlockTables):
                tables_shown = False
                continue
            for row, table in enumerate(cache.block_tables):
                length = lengths[row] if row < len(lengths) else 0
                fewest = math.ceil(kept[row] / size) if row < len(kept) else 0
                needed = math.ceil(length / size)
                if not fewest <= len(table) <= needed:
                    count = f"{fewest}" if fewest == needed else f"{fewest} to {needed}"
                    raise failures.DataLoss(
                        f"{who}: batch row {row}'s block table has {len(table)} entries "
                        f"{table} holding {length} tokens in blocks of {size}: it needs "
                        f"{count}\n  {where}"
                    )
                ids.update(table)
            if len(cache.block_tables) != len(lengths):
                raise failures.DataLoss(
                    f"{who}: {len(cache.block_tables)} block tables for {len(lengths)} batch "
                    f"rows\n  {where}"
                )
    # A fresh pool holds none but the plan's (pool_before[0] is 0 for any correct one).
    ours = in_use - engine.pool_before[0]
    if tables_shown and ours != len(ids):
        raise failures.DataLoss(
            f"the pool: blocks_in_use is {in_use}, but the live caches' block tables "
            f"reference {len(ids)} distinct blocks\n  {where}"
        )
    if not least <= ours <= most:
        raise failures.DataLoss(
            f"the pool: blocks_in_use is {in_use}; the live caches need at least {least} and "
            f"at most {most} blocks\n  {where}"
        )
    if isinstance(pool, PrefixCaching):
        _check_cached(pool, capacity, where)


def _check_offloaded(cache, who: str, where: str) -> None:
    """An offloaded cache holds no block of the pool (contract, section 9.3)."""
    tables = cache.block_tables if isinstance(cache, BlockTables) else []
    if any(tables):
        raise failures.DataLoss(
            f"{who}: offloaded, yet its block tables still reference {tables}: an offloaded "
            f"cache gives its blocks back to the pool\n  {where}"
        )


def _check_cached(pool, capacity: int, where: str) -> None:
    """The cached blocks of a prefix-caching pool (section 9.1): the evictable ones among
    them, the others in use, all of them inside the pool's room."""
    cached, evictable, in_use = pool.blocks_cached, pool.blocks_evictable, pool.blocks_in_use
    said = (
        f"the pool: blocks_cached {cached}, blocks_evictable {evictable}, blocks_in_use "
        f"{in_use}, blocks_free {pool.blocks_free}, room {capacity}"
    )
    if not 0 <= evictable <= cached:
        raise failures.DataLoss(f"{said}: evictable blocks are cached ones\n  {where}")
    if cached - evictable > in_use:
        raise failures.DataLoss(
            f"{said}: a cached block no live cache holds must be evictable\n  {where}"
        )
    if in_use + evictable > capacity or evictable > pool.blocks_free:
        raise failures.DataLoss(
            f"{said}: cached blocks no cache holds stay inside the room, counted free, and "
            f"are evicted when it runs short\n  {where}"
        )


def all_back(pool: BlockPool, before: tuple[int, int], *, where: str) -> None:
    """Every request finished (reset or dropped, and collected): the counts are as before."""
    in_use, free = pool.blocks_in_use, pool.blocks_free
    if (in_use, free) != before:
        raise failures.DataLoss(
            f"the pool: every request finished (reset or dropped and collected), yet "
            f"blocks_in_use is {in_use} and blocks_free {free}, where {before[0]} and "
            f"{before[1]} were before the requests started: blocks leaked\n  {where}"
        )
