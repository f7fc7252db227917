"""The paged pool's own promises, which the kit's properties cannot see from outside: reference
counts and copy-on-write, blocks given back on reset and on garbage collection, a refusal on an
exhausted pool that changes nothing, and attention read block by block against the reference.
"""

import gc

import pytest
import torch

import kvimpl
from kvcheck.selection import load_factory
from kvimpl.paged import PagedPool
from kvref import CacheSpec, attention, min_nbytes

BLOCK = 4
CPU = torch.device("cpu")


def spec_of(batch=2, kv_heads=2, head_dim=4, dtype=torch.float64, window=None) -> CacheSpec:
    return CacheSpec(batch, kv_heads, head_dim, 64, dtype, CPU, window)


def rows(spec: CacheSpec, count: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    shape = (spec.batch, spec.kv_heads, count, spec.head_dim)
    return torch.randn(shape, generator=generator, dtype=torch.float64).to(spec.dtype)


def fill(cache, count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Append ``count`` rows of keys and distinct values; return what was given."""
    key, value = rows(cache.spec, count, seed), rows(cache.spec, count, seed + 1000)
    cache.append(key, value)
    return key, value


def held(cache) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row the cache holds, read without changing it (through a fork's append)."""
    twin = cache.fork()
    probe = rows(cache.spec, 1, seed=99)
    keys, values = twin.append(probe, probe)
    return keys[:, :, :-1].clone(), values[:, :, :-1].clone()


def refcounts(pool: PagedPool, cache) -> list[list[int]]:
    return [[pool.refcount(block) for block in row] for row in cache.block_tables]


def test_the_default_pool_is_a_registered_instance_not_the_class():
    assert kvimpl.CACHES["paged"] is kvimpl.paged.pool
    assert load_factory("kvimpl.paged:pool") is kvimpl.paged.pool
    cache = kvimpl.CACHES["paged"](spec_of())
    assert isinstance(cache, kvimpl.PagedCache)
    assert kvimpl.paged.pool.blocks_free > 10_000, "the suite's pool must never run out"


def test_the_class_named_as_a_factory_says_to_name_an_instance():
    with pytest.raises(TypeError, match=r"not a cache factory.*kvimpl\.paged:pool"):
        load_factory("kvimpl.paged:PagedPool")(spec_of())


@pytest.mark.parametrize(("size", "blocks"), [(0, 1), (1, 0), (1.5, 1), (True, 1), (4, -2)])
def test_a_pool_of_no_blocks_or_empty_blocks_is_refused(size, blocks):
    with pytest.raises(ValueError, match="must be a positive int"):
        PagedPool(size, blocks)


def test_with_blocks_is_a_new_empty_pool_of_the_same_block_size():
    pool = PagedPool(BLOCK, 100)
    roomy = pool(spec_of())
    fill(roomy, 5, seed=0)
    tight = pool.with_blocks(3)
    assert isinstance(tight, PagedPool)
    assert (tight.block_size, tight.blocks_in_use, tight.blocks_free) == (BLOCK, 0, 3)
    cache = tight(spec_of(batch=1))
    fill(cache, 5, seed=1)
    assert (tight.blocks_in_use, pool.blocks_in_use) == (2, 4), "the pools share blocks"


def test_a_fork_shares_every_block_and_copies_the_partly_filled_one_on_write():
    pool = PagedPool(BLOCK, 100)
    parent = pool(spec_of())
    given = fill(parent, 6, seed=0)  # one full block and one half-filled, per row
    child = parent.fork()
    assert child.block_tables == parent.block_tables
    assert refcounts(pool, child) == [[2, 2], [2, 2]]
    in_use = pool.blocks_in_use

    child_keys, child_values = child.append(*(rows(child.spec, 1, seed=s) for s in (1, 2)))

    full = [row[0] for row in parent.block_tables]
    assert [row[0] for row in child.block_tables] == full, "a full shared block was copied"
    partly = [(p[1], c[1]) for p, c in zip(parent.block_tables, child.block_tables, strict=True)]
    assert all(mine != theirs for mine, theirs in partly), "the child wrote a shared block"
    assert pool.blocks_in_use == in_use + 2, "one copy per batch row"
    assert refcounts(pool, parent) == [[2, 1], [2, 1]]
    # Keys and values both copied: the child sees the shared rows, the parent not the new one.
    torch.testing.assert_close(child_keys[:, :, :6], given[0], rtol=0, atol=0)
    torch.testing.assert_close(child_values[:, :, :6], given[1], rtol=0, atol=0)
    parent_keys, parent_values = held(parent)
    torch.testing.assert_close(parent_keys, given[0], rtol=0, atol=0)
    torch.testing.assert_close(parent_values, given[1], rtol=0, atol=0)

    before = parent.block_tables
    parent.append(*(rows(parent.spec, 1, seed=s) for s in (3, 4)))
    assert parent.block_tables == before, "no longer shared: written in place, not copied"


def test_a_truncate_back_into_a_shared_full_block_copies_it_before_writing():
    pool = PagedPool(BLOCK, 100)
    parent = pool(spec_of(batch=1))
    given = fill(parent, 8, seed=0)
    child = parent.fork()
    child.truncate(3)
    assert pool.refcount(parent.block_tables[0][1]) == 1, "truncate kept the dropped block"
    child.append(*(rows(child.spec, 2, seed=s) for s in (1, 2)))
    assert child.block_tables[0][0] != parent.block_tables[0][0]
    torch.testing.assert_close(held(parent)[0], given[0], rtol=0, atol=0)


def test_reorder_shares_repeated_rows_and_a_write_copies_for_one_of_them_only():
    pool = PagedPool(BLOCK, 100)
    cache = pool(spec_of(batch=3))
    given = fill(cache, 5, seed=0)
    cache.reorder(torch.tensor([2, 2, 0]))
    assert cache.block_tables[0] == cache.block_tables[1]
    assert pool.blocks_in_use == 4, "old row 1's blocks were not given back"
    cache.append(*(rows(cache.spec, 1, seed=s) for s in (1, 2)))
    tails = [row[1] for row in cache.block_tables]
    assert len(set(tails)) == 3, f"rows 0 and 1 still share the block they wrote: {tails}"
    assert pool.blocks_in_use == 5, "both repeated rows copied; the last needs no copy"
    keys, values = held(cache)
    torch.testing.assert_close(keys[:, :, :5], given[0][[2, 2, 0]], rtol=0, atol=0)
    torch.testing.assert_close(values[:, :, :5], given[1][[2, 2, 0]], rtol=0, atol=0)


def test_blocks_go_back_on_reset_truncate_and_collection():
    pool = PagedPool(BLOCK, 100)
    cache = pool(spec_of())
    fill(cache, 9, seed=0)
    assert pool.blocks_in_use == 6
    cache.truncate(4)
    assert pool.blocks_in_use == 2
    cache.reset()
    assert (pool.blocks_in_use, cache.length, cache.block_tables) == (0, 0, [[], []])

    fill(cache, 9, seed=0)
    twin = cache.fork()
    del cache
    assert pool.blocks_in_use == 6, "the fork still holds every block"
    twin.cycle = twin  # only the cycle collector frees this one
    del twin
    gc.collect()
    assert pool.blocks_in_use == 0


def test_a_freed_block_is_reused_by_another_cache_without_its_old_rows():
    pool = PagedPool(BLOCK, 100)
    first = pool(spec_of(batch=1))
    poison = torch.full((1, 2, 7, 4), float("nan"), dtype=torch.float64)
    first.append(poison, poison)
    freed = {block for row in first.block_tables for block in row}
    first.reset()
    second = pool(spec_of(batch=1))
    key, value = rows(second.spec, 3, seed=1), rows(second.spec, 3, seed=2)
    query = rows(second.spec, 3, seed=3)
    out = second.attend(query, key, value)
    assert set(second.block_tables[0]) <= freed, "a freed block was not reused"
    positions = torch.arange(3)
    expected = attention(query, key, value, positions, positions)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_an_exhausted_pool_refuses_append_attend_and_copy_on_write_changing_nothing():
    pool = PagedPool(BLOCK, 5)
    cache = pool(spec_of())
    given = fill(cache, 6, seed=0)  # 4 of 5 blocks
    child = cache.fork()
    before = (cache.length, cache.block_tables, refcounts(pool, cache), pool.blocks_in_use)
    more_key, more_value = rows(cache.spec, 1, seed=1), rows(cache.spec, 1, seed=2)
    query = rows(cache.spec, 1, seed=3)
    calls = {
        "append of 1 row: 2 copies": lambda: cache.append(more_key, more_value),
        "attend of 1 row: 2 copies": lambda: child.attend(query, more_key, more_value),
        "append of 3 rows: 2 copies and 2 new blocks": lambda: cache.append(
            *(rows(cache.spec, 3, seed=s) for s in (4, 5))
        ),
    }
    for what, call in calls.items():
        with pytest.raises(ValueError, match=r"PagedPool\(block_size=4, num_blocks=5\) is ex"):
            call()
        after = (cache.length, cache.block_tables, refcounts(pool, cache), pool.blocks_in_use)
        assert after == before, f"{what}: the refusal changed the cache or the pool"
        assert (child.length, child.block_tables) == (before[0], before[1]), what
    child.reset()  # now nothing is shared: the row is written in place
    keys, values = cache.append(more_key, more_value)
    torch.testing.assert_close(keys, torch.cat((given[0], more_key), 2), rtol=0, atol=0)
    torch.testing.assert_close(values, torch.cat((given[1], more_value), 2), rtol=0, atol=0)


def test_one_pool_serves_every_shape_and_counts_its_cap_over_all_of_them():
    pool = PagedPool(BLOCK, 6)
    wide = pool(spec_of(batch=1, head_dim=8))
    narrow = pool(spec_of(batch=2, head_dim=2, dtype=torch.float32))
    fill(wide, 8, seed=0)
    fill(narrow, 8, seed=1)
    ids = [block for cache in (wide, narrow) for row in cache.block_tables for block in row]
    assert len(set(ids)) == 6, f"block ids must be unique in the pool: {ids}"
    assert pool.blocks_free == 0
    with pytest.raises(ValueError, match="exhausted"):
        fill(wide, 1, seed=2)
    bytes_per_block = {"wide": 2 * 2 * 4 * 8 * 8, "narrow": 2 * 2 * 4 * 2 * 4}
    assert pool.nbytes_in_use == 2 * bytes_per_block["wide"] + 4 * bytes_per_block["narrow"]


def test_nbytes_counts_a_shared_block_in_every_cache_that_references_it():
    pool = PagedPool(BLOCK, 100)
    cache = pool(spec_of())
    fill(cache, 6, seed=0)
    twin = cache.fork()
    for each in (cache, twin):
        assert each.nbytes == 4 * 2 * (2 * 4 * 4 * 8), "2 rows x 2 blocks of keys and values"
        assert each.nbytes >= min_nbytes(each.spec, each.length)
    assert cache.nbytes + twin.nbytes == 2 * pool.nbytes_in_use


def test_attend_reads_scattered_blocks_as_well_as_adjacent_ones():
    pool = PagedPool(BLOCK, 100)
    spec = spec_of(batch=3)
    cache = pool(spec)
    history = fill(cache, 2 * BLOCK + 1, seed=0)
    cache.reorder(torch.tensor([2, 0, 1]))  # block ids no longer ascend down the batch
    key, value, query = (rows(spec, 2, seed=s) for s in (1, 2, 3))
    out = cache.attend(query, key, value)
    order = torch.tensor([2, 0, 1])
    keys = torch.cat((history[0][order], key), 2)
    values = torch.cat((history[1][order], value), 2)
    end = 2 * BLOCK + 3
    expected = attention(query, keys, values, torch.arange(end - 2, end), torch.arange(end))
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("query", "complaint"),
    [
        ("not a tensor", "query must be a torch.Tensor"),
        (torch.zeros(2, 3, 1), "rank 4"),
        (torch.zeros(2, 3, 1, 4, dtype=torch.float64), "not a positive multiple"),
        (torch.zeros(2, 2, 2, 4, dtype=torch.float64), "does not match key"),
        (torch.zeros(2, 2, 1, 4, dtype=torch.float32), "must agree"),
    ],
)
def test_a_bad_query_is_refused_before_anything_changes(query, complaint):
    pool = PagedPool(BLOCK, 100)
    cache = pool(spec_of())
    fill(cache, 3, seed=0)
    before = (cache.length, cache.block_tables, pool.blocks_in_use)
    key = rows(cache.spec, 1, seed=1)
    with pytest.raises((ValueError, TypeError), match=complaint):
        cache.attend(query, key, key)
    assert (cache.length, cache.block_tables, pool.blocks_in_use) == before
