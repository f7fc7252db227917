"""The interplay mutants are wrong only where capabilities mix: each one's bug shows in the
interplay its docstring names, and each capability alone (or the same calls in another
order) is right."""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

from kvimpl import ChunkedCache
from tests.mutants import interplay as kvinter
from tests.test_attend_mutants import rows, spec_of

SEEDS = itertools.count(1, 2)  # every append of every cache its own rows


class Held:
    """A cache and every row given to it since its last reset (or, for a fork, its
    parent's), so that what it returns can be compared with what it should hold."""

    def __init__(self, cache, keys: Tensor | None = None, values: Tensor | None = None) -> None:
        self.cache = cache
        empty = rows(cache.spec, 0, 0)
        self.keys = empty if keys is None else keys
        self.values = empty if values is None else values

    def append(self, count: int) -> tuple[Tensor, Tensor]:
        """Append ``count`` new rows; return what the cache returned."""
        seed = next(SEEDS)
        key, value = rows(self.cache.spec, count, seed), rows(self.cache.spec, count, seed + 1)
        self.keys = torch.cat((self.keys, key), dim=2)
        self.values = torch.cat((self.values, value), dim=2)
        return self.cache.append(key, value)

    def holds_what_it_was_given(self, count: int = 1) -> bool:
        """Whether one more append returns every row given, bit for bit."""
        keys, values = self.append(count)
        return torch.equal(keys, self.keys) and torch.equal(values, self.values)

    def fork(self) -> Held:
        return Held(self.cache.fork(), self.keys, self.values)

    def reorder(self, indices: list[int]) -> None:
        index = torch.tensor(indices)
        self.cache.reorder(index)
        self.keys, self.values = self.keys[index], self.values[index]

    def truncate(self, length: int) -> None:
        self.cache.truncate(length)
        self.keys, self.values = self.keys[:, :, :length], self.values[:, :, :length]


def books_match(pool, *caches: Held) -> bool:
    """Whether the pool's blocks in use are the distinct ids the live caches' tables hold."""
    ids = {block for held in caches for row in held.cache.block_tables for block in row}
    return pool.blocks_in_use == len(ids)


def test_reorder_permutes_the_blocks_a_fork_shares():
    pool = kvinter.ReorderPermutesSharedBlocks()
    parent = Held(pool(spec_of(batch=2)))
    parent.append(20)  # a full block and a partly filled one
    child = parent.fork()
    parent.reorder([1, 0])
    assert parent.holds_what_it_was_given()
    assert not child.holds_what_it_was_given(), "the fork's rows were permuted in place"
    # Once both wrote, only the full block is still shared, and it moves too.
    parent = Held(pool(spec_of(batch=2)))
    parent.append(20)
    child = parent.fork()
    assert parent.holds_what_it_was_given()
    assert child.holds_what_it_was_given()
    child.reorder([1, 0])
    assert child.holds_what_it_was_given()
    assert not parent.holds_what_it_was_given()


def test_reorder_alone_and_fork_alone_are_right():
    pool = kvinter.ReorderPermutesSharedBlocks()
    alone = Held(pool(spec_of(batch=3)))
    alone.append(20)
    alone.reorder([2, 0, 0])
    assert alone.holds_what_it_was_given(5)
    alone.reorder([1, 2, 1])
    assert alone.holds_what_it_was_given()
    parent = Held(pool(spec_of(batch=2)))
    parent.append(20)
    child = parent.fork()
    assert parent.holds_what_it_was_given(3)
    assert child.holds_what_it_was_given(2)
    assert parent.holds_what_it_was_given()
    assert child.holds_what_it_was_given()


def test_truncate_leaks_the_blocks_past_the_new_end():
    pool = kvinter.TruncateLeaksBlocks()
    cache = Held(pool(spec_of(batch=2)))
    cache.append(40)  # three blocks per row
    assert books_match(pool, cache)
    cache.truncate(10)
    assert cache.holds_what_it_was_given(), "the answers stay right"
    assert not books_match(pool, cache)
    assert pool.blocks_in_use == 6, "the four blocks past the end are still in use"
    cache.cache.reset()
    assert pool.blocks_in_use == 4, "and never come back"


def test_truncate_within_the_last_block_and_everything_else_keep_the_books():
    pool = kvinter.TruncateLeaksBlocks()
    cache = Held(pool(spec_of(batch=2)))
    cache.append(40)
    cache.truncate(35)  # every block kept
    child = cache.fork()
    cache.reorder([1, 1])
    assert cache.holds_what_it_was_given()
    assert child.holds_what_it_was_given()
    assert books_match(pool, cache, child)
    cache.cache.reset()
    child.cache.reset()
    assert pool.blocks_in_use == 0


def test_a_second_rollback_without_an_append_drops_too_many():
    cache = Held(kvinter.SecondRollbackCountsFromLastAppend(spec_of()))
    cache.append(10)
    cache.truncate(8)
    cache.truncate(5)
    assert cache.cache.length == 3 != 5


def test_one_rollback_after_appends_is_right_each_time():
    cache = Held(kvinter.SecondRollbackCountsFromLastAppend(spec_of()))
    for length, back in ((10, 2), (7, 3), (20, 20)):
        cache.append(length)
        cache.truncate(cache.cache.length - back)
        assert cache.holds_what_it_was_given()
    cache.cache.reset()
    cache = Held(cache.cache)
    cache.truncate(0)
    assert cache.cache.length == 0
    assert cache.holds_what_it_was_given(4)


def test_another_caches_append_overwrites_a_returned_view():
    first = Held(kvinter.JoinsIntoSharedScratch(spec_of()))
    second = Held(kvinter.JoinsIntoSharedScratch(spec_of()))
    first.append(6)
    keys, values = first.append(1)  # the view of its own last call: allowed to change
    kept = keys.clone(), values.clone()
    assert torch.equal(keys, first.keys)
    second.append(7)
    assert not torch.equal(keys, kept[0])
    assert not torch.equal(values, kept[1])


def test_a_returned_view_lives_until_the_caches_own_next_call_without_others():
    cache = Held(kvinter.JoinsIntoSharedScratch(spec_of()))
    keys, values = cache.append(6)
    assert torch.equal(keys, cache.keys)
    assert torch.equal(values, cache.values)
    assert cache.holds_what_it_was_given(3)
    # The built-in's views live on whatever other caches of the class do.
    first, second = Held(ChunkedCache(spec_of())), Held(ChunkedCache(spec_of()))
    keys, _ = first.append(6)
    second.append(7)
    assert torch.equal(keys, first.keys)


def test_a_write_after_a_truncate_into_a_full_shared_block_lands_in_it():
    pool = kvinter.CopyOnWriteSkipsFullBlocks()
    parent = Held(pool(spec_of(batch=2)))
    parent.append(20)  # block 0 full, block 1 partly filled
    child = parent.fork()
    parent.truncate(10)  # back into the full, shared block 0
    assert parent.holds_what_it_was_given(3)
    assert not child.holds_what_it_was_given(), "the parent's rows 10..12 are in its block 0"


def test_a_truncate_into_a_full_block_shared_by_repeated_rows():
    cache = Held(kvinter.CopyOnWriteSkipsFullBlocks()(spec_of(batch=2)))
    cache.append(20)
    cache.reorder([0, 0])  # both rows share every block
    cache.truncate(10)
    keys, _ = cache.append(1)
    assert torch.equal(keys[1], cache.keys[1])
    assert not torch.equal(keys[0], cache.keys[0])


def test_copy_on_write_is_right_without_a_truncate_into_a_full_shared_block():
    pool = kvinter.CopyOnWriteSkipsFullBlocks()
    parent = Held(pool(spec_of(batch=2)))
    parent.append(20)
    child = parent.fork()
    assert parent.holds_what_it_was_given(3), "the partly filled block is copied"
    parent.truncate(18)  # inside the block it copied: its own
    assert parent.holds_what_it_was_given()
    assert child.holds_what_it_was_given()
    alone = Held(pool(spec_of(batch=2)))
    alone.append(40)
    alone.truncate(5)  # a full block, shared with no one
    assert alone.holds_what_it_was_given(2)
    alone.cache.reset()
    alone = Held(alone.cache)
    alone.append(5)
    twin = alone.fork()
    assert alone.holds_what_it_was_given()
    assert twin.holds_what_it_was_given()
