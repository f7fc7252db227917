"""Each interplay bug, driven by hand: its two events in a row are wrong, each event alone (or
the two with a write between them) is right, and its twin is right everywhere.

These are the scenarios the module docstrings describe, small enough to read; whether the
kit finds them by itself is measured by ``tests/interplay/measure.py``.
"""

from __future__ import annotations

import gc
import itertools
import math

import pytest
import torch
from torch import Tensor

from kvcheck.engines import Clear, Copy, Decode, EnginePlan, Feed, Remove, Shift, run_plan
from kvref import CacheRows, CacheSpec, EngineSpec, ModelConfig, attention, rerotate
from tests import interplay

SEEDS = itertools.count(7, 3)


def spec_of(batch: int = 2, max_length: int = 64, head_dim: int = 8) -> CacheSpec:
    return CacheSpec(batch, 2, head_dim, max_length, torch.float64, "cpu")


def rows(spec: CacheSpec, count: int) -> Tensor:
    generator = torch.Generator().manual_seed(next(SEEDS))
    shape = (spec.batch, spec.kv_heads, count, spec.head_dim)
    return torch.randn(shape, generator=generator, dtype=torch.float64)


class Book:
    """A cache and every row it should hold (the oracle: rows given, edited as told)."""

    def __init__(self, cache, keys: Tensor | None = None, values: Tensor | None = None) -> None:
        self.cache, spec = cache, cache.spec
        empty = torch.zeros((spec.batch, spec.kv_heads, 0, spec.head_dim), dtype=torch.float64)
        self.keys = empty if keys is None else keys
        self.values = empty.clone() if values is None else values

    def append(self, count: int) -> tuple[Tensor, Tensor]:
        key, value = rows(self.cache.spec, count), rows(self.cache.spec, count)
        self.keys = torch.cat((self.keys, key), dim=2)
        self.values = torch.cat((self.values, value), dim=2)
        return self.cache.append(key, value)

    def holds(self, count: int = 1) -> bool:
        """Whether the next append returns every row this book holds, bit for bit."""
        keys, values = self.append(count)
        return torch.equal(keys, self.keys) and torch.equal(values, self.values)

    def truncate(self, length: int) -> None:
        self.cache.truncate(length)
        self.keys, self.values = self.keys[:, :, :length], self.values[:, :, :length]

    def reorder(self, order: list[int]) -> None:
        self.cache.reorder(torch.tensor(order))
        self.keys, self.values = self.keys[order], self.values[order]

    def fork(self) -> Book:
        return Book(self.cache.fork(), self.keys.clone(), self.values.clone())

    def reset(self) -> None:
        self.cache.reset()
        self.keys, self.values = self.keys[:, :, :0], self.values[:, :, :0]

    def shift(self, start: int, count: int, base: float) -> None:
        self.cache.shift(start, count)
        after = rerotate(self.keys[:, :, start + count :], -count, base)
        self.keys = torch.cat((self.keys[:, :, :start], after), dim=2)
        self.values = torch.cat(
            (self.values[:, :, :start], self.values[:, :, start + count :]), dim=2
        )


def both(name: str):
    return interplay.INTERPLAY_BUGS[name], interplay.TWINS[name]


def test_the_registry_names_ten_bugs_each_with_a_twin():
    assert len(interplay.INTERPLAY_BUGS) == 10
    assert interplay.INTERPLAY_BUGS.keys() == interplay.TWINS.keys() == interplay.KV_IMPL.keys()
    assert interplay.INTERPLAY_BUGS.keys() >= interplay.ENGINES


# --- reorder, then reorder ------------------------------------------------------------


def two_reorders(factory) -> bool:
    book = Book(factory(spec_of(batch=3)))
    book.append(5)
    book.reorder([2, 0, 1])
    book.reorder([1, 1, 0])
    return book.holds()


def reorders_each_followed_by_an_append(factory) -> bool:
    book = Book(factory(spec_of(batch=3)))
    book.append(5)
    held = []
    for order in ([2, 0, 1], [1, 1, 0], [0, 2, 2]):
        book.reorder(order)
        held.append(book.holds())
    book.reorder([2, 1, 0])
    book.truncate(3)  # a truncate between the reorder and the append: commutes
    held.append(book.holds(2))
    return all(held)


def test_lazy_gather_two_reorders_without_an_append():
    bug, twin = both("LazyGatherOverwritesPendingReorder")
    assert not two_reorders(bug)
    assert two_reorders(twin)
    assert reorders_each_followed_by_an_append(bug)
    assert reorders_each_followed_by_an_append(twin)


# --- attend, truncate, attend -----------------------------------------------------------


def attended(cache, book: Book, count: int, heads: int = 4) -> bool:
    """An attend of ``count`` new rows against the reference attention over the book's rows."""
    spec = cache.spec
    key, value = rows(spec, count), rows(spec, count)
    generator = torch.Generator().manual_seed(next(SEEDS))
    query = torch.randn((spec.batch, heads, count, spec.head_dim), generator=generator,
                        dtype=torch.float64)  # fmt: skip
    book.keys = torch.cat((book.keys, key), dim=2)
    book.values = torch.cat((book.values, value), dim=2)
    got = cache.attend(query, key, value)
    n = book.keys.shape[2]
    want = attention(query, book.keys, book.values, torch.arange(n - count, n), torch.arange(n))
    return torch.allclose(got, want, rtol=1e-9, atol=1e-12)


def attend_truncate_attend(factory) -> bool:
    cache = factory(spec_of())
    book = Book(cache)
    attended(cache, book, 8)  # the mirror synced to 8
    book.truncate(5)
    return attended(cache, book, 2)  # new rows at 5, 6; the mirror still says 5..7 synced


def truncate_without_attend_or_attend_without_truncate(factory) -> bool:
    cache = factory(spec_of())
    book = Book(cache)
    book.append(8)
    book.truncate(5)
    fine = [book.holds(2), attended(cache, book, 3), attended(cache, book, 1)]
    book.truncate(6)  # after the attends: appends see the right rows all the same
    fine.append(book.holds(3))
    return all(fine)


def test_mirror_attend_after_a_truncate_past_the_synced_mark():
    bug, twin = both("MirrorSyncedMarkSurvivesTruncate")
    assert not attend_truncate_attend(bug)
    assert attend_truncate_attend(twin)
    assert truncate_without_attend_or_attend_without_truncate(bug)
    assert truncate_without_attend_or_attend_without_truncate(twin)


# --- fork, then reset -----------------------------------------------------------------


def fork_then_reset(factory) -> bool:
    parent = Book(factory(spec_of()))
    parent.append(6)
    child = parent.fork()
    parent.reset()
    return child.holds() and parent.holds(2)


def fork_write_then_reset(factory) -> bool:
    parent = Book(factory(spec_of()))
    parent.append(6)
    child = parent.fork()
    fine = [child.holds()]  # the child copies on write: the slab is the parent's alone now
    parent.reset()
    fine += [child.holds(), parent.holds(3)]
    alone = Book(factory(spec_of()))
    alone.append(4)
    alone.reset()
    fine.append(alone.holds(2))
    return all(fine)


def test_slab_reset_of_a_fork_that_still_shares_its_slab():
    bug, twin = both("ResetScrubsSharedSlab")
    assert not fork_then_reset(bug)
    assert fork_then_reset(twin)
    assert fork_write_then_reset(bug)
    assert fork_write_then_reset(twin)


# --- import, then truncate ------------------------------------------------------------


def moved(factory, count: int) -> Book:
    source = Book(factory(spec_of()))
    source.append(count)
    exported = source.cache.export_rows()
    target = Book(factory(spec_of()), source.keys.clone(), source.values.clone())
    target.cache.import_rows(
        CacheRows(exported.keys.clone(), exported.values.clone(), exported.length)
    )
    return target


def import_then_truncate(factory) -> bool:
    target = moved(factory, 9)
    target.append(2)
    target.truncate(6)
    return target.holds()


def import_alone_and_truncate_alone(factory) -> bool:
    target = moved(factory, 9)
    fine = [target.holds(2), target.holds()]
    alone = Book(factory(spec_of()))
    alone.append(4)
    alone.append(3)
    alone.truncate(5)
    fine.append(alone.holds())
    return all(fine)


def test_chunks_truncate_after_an_import():
    bug, twin = both("ImportLeavesChunkIndexBehind")
    assert not import_then_truncate(bug)
    assert import_then_truncate(twin)
    assert import_alone_and_truncate_alone(bug)
    assert import_alone_and_truncate_alone(twin)


# --- truncate, then append_tree -------------------------------------------------------


def drafted(book: Book, parents: list[int], accepted: int) -> bool:
    """A tree drafted and one path (node 0, then its first child) committed: the rows
    returned are the committed ones then the nodes, and the next append holds the path."""
    spec = book.cache.spec
    nodes = len(parents)
    key, value = rows(spec, nodes), rows(spec, nodes)
    keys, values = book.cache.append_tree(key, value, parents)
    fine = torch.equal(keys, torch.cat((book.keys, key), dim=2))
    fine &= torch.equal(values, torch.cat((book.values, value), dim=2))
    path = [0, parents.index(0)][:accepted]
    book.cache.commit_tree([path] * spec.batch)
    book.keys = torch.cat((book.keys, key[:, :, path]), dim=2)
    book.values = torch.cat((book.values, value[:, :, path]), dim=2)
    return bool(fine) and book.holds()


def truncate_then_tree(factory) -> bool:
    book = Book(factory(spec_of()))
    book.append(7)
    assert drafted(book, [-1, 0, -1, 1], 2)
    book.truncate(4)  # back into the committed path
    return drafted(book, [-1, 0, 0], 2)


def truncate_append_then_tree(factory) -> bool:
    book = Book(factory(spec_of()))
    book.append(7)
    fine = [drafted(book, [-1, 0, -1, 1], 2)]
    book.truncate(4)
    fine.append(book.holds())  # an append moves the anchor to the length
    fine.append(drafted(book, [-1, 0, 0], 1))
    return all(fine)


def test_positions_tree_drafted_right_after_a_truncate():
    bug, twin = both("TreeAnchorSurvivesTruncate")
    assert not truncate_then_tree(bug)
    assert truncate_then_tree(twin)
    assert truncate_append_then_tree(bug)
    assert truncate_append_then_tree(twin)


# --- offload and restore, then reset --------------------------------------------------


def in_use_by_tables(pool, *caches) -> int:
    return len({block for cache in caches for table in cache.block_tables for block in table})


def restore_then_reset(pool_kind) -> bool:
    pool = pool_kind.with_blocks(32)
    book = Book(pool(spec_of()))
    book.append(10)  # 3 blocks of 4 a row
    book.cache.offload()
    other = Book(pool(spec_of()))
    other.append(9)  # takes the blocks given back
    book.cache.restore()
    fine = [book.holds(), pool.blocks_in_use == in_use_by_tables(pool, book.cache, other.cache)]
    book.cache.reset()
    fine.append(pool.blocks_in_use == in_use_by_tables(pool, book.cache, other.cache))
    other.cache.reset()
    return all(fine) and pool.blocks_in_use == 0


def offload_restore_alone_and_reset_alone(pool_kind) -> bool:
    pool = pool_kind.with_blocks(32)
    book = Book(pool(spec_of()))
    book.append(10)
    book.cache.offload()
    book.cache.restore()
    fine = [book.holds(3), pool.blocks_in_use == in_use_by_tables(pool, book.cache)]
    plain = Book(pool(spec_of()))
    plain.append(7)
    plain.truncate(2)
    plain.reset()
    fine.append(pool.blocks_in_use == in_use_by_tables(pool, book.cache, plain.cache))
    return all(fine)


def test_ledger_reset_after_a_restore_leaks_the_restored_blocks():
    bug, twin = both("RestoreSkipsLedger")
    assert not restore_then_reset(bug)
    assert restore_then_reset(twin)
    assert offload_restore_alone_and_reset_alone(bug)
    assert offload_restore_alone_and_reset_alone(twin)
    # Dropped, not reset: the same leak through the finalizer.
    for kind, leaks in ((bug, True), (twin, False)):
        pool = kind.with_blocks(16)
        book = Book(pool(spec_of()))
        book.append(5)
        book.cache.offload()
        book.cache.restore()
        del book
        gc.collect()
        assert (pool.blocks_in_use > 0) is leaks


# --- select_rows, then join -----------------------------------------------------------


def fed(cache, counts: tuple[int, ...], books: list[list[Tensor]]) -> bool:
    """``append_rows`` with ``counts``; whether each row's valid slots are its rows."""
    spec = cache.spec
    width = max(counts)
    key, value = rows(spec, width), rows(spec, width)
    for row, count in enumerate(counts):
        books[row] = [
            torch.cat((books[row][0], key[row, :, :count]), dim=1),
            torch.cat((books[row][1], value[row, :, :count]), dim=1),
        ]
    keys, values, valid = cache.append_rows(key, value, counts)
    return all(
        torch.equal(keys[row][:, valid[row]], books[row][0])
        and torch.equal(values[row][:, valid[row]], books[row][1])
        for row in range(len(counts))
    )


def empty_books(spec: CacheSpec, batch: int) -> list[list[Tensor]]:
    empty = torch.zeros((spec.kv_heads, 0, spec.head_dim), dtype=torch.float64)
    return [[empty, empty] for _ in range(batch)]


def select_then_join(factory, kept: list[int]) -> bool:
    cache = factory(spec_of(batch=3))
    books = empty_books(cache.spec, 3)
    fed(cache, (4, 6, 5), books)
    cache.select_rows(torch.tensor(kept))
    books = [books[row] for row in kept]
    joining = factory(spec_of(batch=3 - len(kept)))
    theirs = empty_books(joining.spec, 3 - len(kept))
    fed(joining, (3,) * (3 - len(kept)), theirs)
    cache.join(joining)
    return fed(cache, (1, 1, 1), books + theirs)


def test_slots_join_after_a_row_left():
    bug, twin = both("JoinReusesLiveSlot")
    assert not select_then_join(bug, [0, 2])  # slot 2 is live: the joiner takes it
    assert not select_then_join(bug, [1])  # slots 1 live: two joiners take 1 and 2
    assert select_then_join(bug, [0, 1])  # the count is a free slot when the last row left
    for kept in ([0, 2], [1], [0, 1], [2, 0]):
        assert select_then_join(twin, kept)


# --- fork, then shift -----------------------------------------------------------------


def fork_then_shift(factory) -> bool:
    spec = spec_of()
    parent = Book(factory(spec))
    parent.append(4)
    parent.append(5)
    child = parent.fork()
    parent.shift(1, 2, spec.rope_base)  # the second segment, shared, moves down by 2
    return parent.holds() and child.holds()


def shift_alone_and_fork_alone(factory) -> bool:
    spec = spec_of()
    alone = Book(factory(spec))
    alone.append(4)
    alone.append(5)
    alone.shift(1, 2, spec.rope_base)
    fine = [alone.holds()]
    parent = Book(factory(spec))
    parent.append(6)
    child = parent.fork()
    parent.truncate(3)
    fine += [parent.holds(), child.holds(2)]
    child.shift(0, 1, spec.rope_base)  # after the child's own append: the shared part is cut
    fine += [child.holds(), parent.holds()]
    return all(fine)


def test_segments_shift_of_a_fork_that_shares_a_segment():
    bug, twin = both("ShiftRotatesSharedSegments")
    assert not fork_then_shift(bug)
    assert fork_then_shift(twin)
    assert shift_alone_and_fork_alone(bug)
    assert shift_alone_and_fork_alone(twin)


# --- engines ----------------------------------------------------------------------------

CONFIG = ModelConfig(
    vocab_size=16, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8, ffn_dim=8, seed=3,
    ffn="swiglu",
)  # fmt: skip
ENGINE_SPEC = EngineSpec(3, 24, 16)


def engine_holds(factory, *events) -> bool:
    try:
        run_plan(factory, EnginePlan(CONFIG, tuple(events), 11), ENGINE_SPEC, torch.float64)
    except AssertionError:
        return False
    except Exception as error:  # the kit's failures are its own exception types
        if type(error).__module__.startswith("kvcheck"):
            return False
        raise
    return True


def decode(*feeds: tuple[int, int, int]) -> Decode:
    return Decode(tuple(Feed(*feed) for feed in feeds))


def test_lag_engine_two_shifts_before_a_decode():
    bug, twin = both("LagEngineOverwritesPendingRotation")
    two_shifts = (
        decode((0, 0, 8), (1, 0, 3)),
        Shift(0, 5, None, 3),  # a suffix moved on: 5..7 to 8..10
        decode((1, 3, 1)),  # another sequence decoded: sequence 0's rotation still waits
        Shift(0, 8, None, 2),  # the same tokens again: 10..12
        decode((0, 13, 2)),
    )
    assert not engine_holds(bug, *two_shifts)
    assert engine_holds(twin, *two_shifts)
    decoded_between = (
        decode((0, 0, 8)),
        Shift(0, 5, None, 3),
        decode((0, 11, 1)),
        Shift(0, 8, None, 2),
        decode((0, 14, 2)),
        Remove(0, 2, 4),
        Shift(0, 4, None, -2),  # a context shift
        decode((0, 14, 1)),
    )
    assert engine_holds(bug, *decoded_between)
    assert engine_holds(twin, *decoded_between)


def test_tombstone_engine_copy_before_the_source_runs_again():
    bug, twin = both("TombstoneEngineCopiesDeadEntries")
    remove_then_copy = (
        decode((0, 0, 9)),
        Remove(0, 3, 6),  # a middle span: tombstones until sequence 0 runs again
        Copy(0, 1),
        decode((1, 9, 2)),
    )
    assert not engine_holds(bug, *remove_then_copy)
    assert engine_holds(twin, *remove_then_copy)
    source_ran_between = (
        decode((0, 0, 9)),
        Remove(0, 3, 6),
        decode((0, 9, 1)),  # reclaims the tombstones
        Copy(0, 1),
        decode((1, 10, 2), (0, 10, 1)),
        Remove(1, 0, 4),
        decode((1, 12, 1)),
        Clear(),
        decode((2, 7, 3)),
    )
    assert engine_holds(bug, *source_ran_between)
    assert engine_holds(twin, *source_ran_between)


@pytest.mark.parametrize("name", sorted(set(interplay.INTERPLAY_BUGS) - interplay.ENGINES))
def test_every_cache_refuses_bad_input_and_reports_its_bytes(name):
    """A smoke check of the plain protocol, bug and twin alike."""
    for factory in both(name):
        cache = factory(spec_of(head_dim=4))
        with pytest.raises((ValueError, TypeError)):
            cache.append(torch.zeros(2, 2, 1, 5, dtype=torch.float64), torch.zeros(2, 2, 1, 5))
        book = Book(cache)
        assert book.holds(3)
        spec = cache.spec
        assert cache.nbytes >= 2 * spec.batch * spec.kv_heads * 3 * spec.head_dim * 8  # 3 rows
        assert math.isfinite(cache.nbytes)
