"""Moves of the built-ins (contract, section 11.2), checked by hand: rows fed with ``append``,
exported, imported into a fresh cache (for ``paged``, also into a pool of another block
size), and the next append's rows held bit for bit to the rows given; the move mutants fail
that same round trip; a refused import changes nothing; an imported cache goes on (reorder,
truncate, fork, attend, reset) as one fed its tokens."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.testing import assert_close

from kvimpl import CACHES, StreamingCache, WindowCache
from kvimpl.latent import LatentCache
from kvimpl.paged import PagedPool
from kvref import CacheRows, CacheSpec, attention, capabilities
from tests.mutants.moves import MOVE_MUTANTS

CPU = torch.device("cpu")
PLAIN = CacheSpec(2, 2, 4, 64, torch.float32, CPU)
WINDOWED = dataclasses.replace(PLAIN, window=5)
LATENT = CacheSpec(2, 1, 4, 64, torch.float32, CPU, value_dim=6)
FEEDS = (7, 13)  # 20 tokens: a partly filled last block in blocks of 16 and of 3
THEN = 3


def factory(name: str):
    """A fresh factory: a pool of its own for ``paged``, so that no test shares blocks."""
    if name == "paged":
        return PagedPool(16)
    return LatentCache if name == "latent" else CACHES[name]


BUILTINS = [
    *(pytest.param(name, spec, id=f"{name}-{kind}") for name in CACHES
      for kind, spec in (("plain", PLAIN), ("window", WINDOWED))),
    pytest.param("latent", LATENT, id="latent"),
]  # fmt: skip


class History:
    """The rows a cache was given since its reset, as the model would have them."""

    def __init__(self, spec: CacheSpec, seed: int = 0) -> None:
        self.spec = spec
        self.generator = torch.Generator().manual_seed(seed)
        self.keys, self.values = self.new(0)

    def new(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.spec
        shape = (s.batch, s.kv_heads, count)
        return (
            torch.randn((*shape, s.head_dim), generator=self.generator, dtype=s.dtype),
            torch.randn((*shape, s.value_width), generator=self.generator, dtype=s.dtype),
        )

    def feed(self, cache, count: int):
        """Append ``count`` new rows to ``cache``; check and return the rows it returned."""
        key, value = self.new(count)
        self.keys = torch.cat((self.keys, key), dim=2)
        self.values = torch.cat((self.values, value), dim=2)
        returned = cache.append(key, value)
        self.check(returned, count)
        return returned

    def check(self, returned, new_tokens: int) -> None:
        """``returned`` is a recent run of the history, at least what the spec needs."""
        keys, values = returned
        length, held = self.keys.shape[2], keys.shape[2]
        needed = self.spec.rows_needed(length - new_tokens, new_tokens)
        assert needed <= held <= length, f"{held} rows returned of {length} ({needed} needed)"
        assert_close(keys, self.keys[:, :, length - held :], rtol=0, atol=0)
        assert_close(values, self.values[:, :, length - held :], rtol=0, atol=0)


def round_trip(source_factory, target_factory, spec: CacheSpec) -> None:
    """Feed, export, import into a fresh cache of ``target_factory``, append: every row bit
    for bit, on both sides, the export unchanged by later calls on its source."""
    history = History(spec)
    source = source_factory(spec)
    for count in FEEDS:
        history.feed(source, count)
    moved = source.export_rows()
    assert moved.length == sum(FEEDS)
    assert moved.rows >= spec.rows_needed(moved.length)
    assert moved.block_size == getattr(source_factory, "block_size", None)
    kept = (moved.keys.clone(), moved.values.clone())
    target = target_factory(spec)
    target.import_rows(moved)
    assert target.length == moved.length
    source_history = History(spec)
    source_history.keys, source_history.values = history.keys, history.values
    history.feed(target, THEN)
    source_history.feed(source, THEN)  # the export changed nothing on its source
    source.reorder(torch.tensor([1, 0]))
    assert_close(moved.keys, kept[0], rtol=0, atol=0)  # later calls never change it
    assert_close(moved.values, kept[1], rtol=0, atol=0)


@pytest.mark.parametrize(("name", "spec"), BUILTINS)
def test_round_trip_into_a_fresh_cache(name, spec):
    pool = factory(name)
    round_trip(pool, pool, spec)


@pytest.mark.parametrize("spec", [PLAIN, WINDOWED, LATENT], ids=["plain", "window", "latent"])
@pytest.mark.parametrize(("source", "target"), [(16, 3), (3, 16), (16, 16)])
def test_paged_round_trip_between_block_sizes(source, target, spec):
    pool = PagedPool(source)
    round_trip(pool, pool.with_block_size(target), spec)


def test_rings_move_their_recent_run_between_them():
    round_trip(WindowCache, StreamingCache, WINDOWED)
    round_trip(StreamingCache, WindowCache, WINDOWED)


@pytest.mark.parametrize("mutant", MOVE_MUTANTS, ids=lambda mutant: mutant.__name__)
@pytest.mark.parametrize(("source", "target"), [(16, 3), (3, 16), (16, 16)])
def test_each_move_mutant_fails_the_round_trip(mutant, source, target):
    pool = mutant.with_block_size(source)
    other = pool.with_block_size(target)
    assert type(pool) is type(other) is type(pool.with_blocks(8)) is type(mutant)
    if source == target and mutant.__name__ == "ImportKeepsSourceBlockSize":
        round_trip(pool, other, PLAIN)  # right whenever the sizes are equal
        return
    with pytest.raises(AssertionError):
        round_trip(pool, other, PLAIN)


def snapshot(cache):
    rows = cache.export_rows()
    return cache.length, rows.keys, rows.values


def assert_unchanged(cache, before) -> None:
    length, keys, values = snapshot(cache)
    assert length == before[0]
    assert_close(keys, before[1], rtol=0, atol=0)
    assert_close(values, before[2], rtol=0, atol=0)


@pytest.mark.parametrize(("name", "spec"), BUILTINS)
def test_a_refused_import_changes_nothing(name, spec):
    pool = factory(name)
    history = History(spec)
    warm = pool(spec)
    history.feed(warm, 7)
    rows, before = warm.export_rows(), snapshot(warm)
    with pytest.raises(ValueError, match="empty"):
        warm.import_rows(rows)
    assert_unchanged(warm, before)
    history.feed(warm, THEN)  # it decodes on

    cold = pool(spec)
    wide = CacheRows(rows.keys.double(), rows.values.double(), rows.length)
    for bad, error in ((wide, ValueError), ((rows.keys, rows.values), TypeError)):
        with pytest.raises(error):
            cold.import_rows(bad)
        assert_unchanged(cold, (0, rows.keys[:, :, :0], rows.values[:, :, :0]))
    cold.import_rows(rows)  # and then takes good rows
    assert_unchanged(cold, (7, rows.keys, rows.values))


def test_caches_that_keep_every_row_refuse_a_recent_run():
    history = History(WINDOWED)
    ring = WindowCache(WINDOWED)
    for count in FEEDS:
        history.feed(ring, count)
    run = ring.export_rows()
    assert run.rows < run.length
    for name in ("concat", "preallocated", "unrotated", "chunked", "paged", "sdpa", "latent"):
        cache = factory(name)(WINDOWED)
        with pytest.raises(ValueError, match=f"start at position {run.length - run.rows}"):
            cache.import_rows(run)
        assert cache.length == 0
        assert cache.export_rows().rows == 0


def test_paged_import_refuses_on_a_pool_without_room():
    rows = PagedPool(16)(PLAIN)
    History(PLAIN).feed(rows, 20)
    moved = rows.export_rows()
    tight = PagedPool(16, num_blocks=3)  # 2 rows x 2 blocks needed
    cache = tight(PLAIN)
    with pytest.raises(ValueError, match=r"import_rows: the pool .* exhausted"):
        cache.import_rows(moved)
    assert (cache.length, cache.block_tables, tight.blocks_in_use) == (0, [[], []], 0)
    roomy = tight.with_blocks(4)(PLAIN)
    roomy.import_rows(moved)
    assert roomy.block_tables == [[0, 2], [1, 3]]
    assert roomy.pool.blocks_free == 0


def test_paged_refuses_to_export_rows_of_different_lengths_or_offloaded():
    cache = PagedPool(4)(PLAIN)
    key, value = History(PLAIN).new(3)
    cache.append_rows(key, value, (3, 1))
    with pytest.raises(ValueError, match="different numbers of tokens"):
        cache.export_rows()
    cache.truncate_rows((1, 1))
    cache.offload()
    with pytest.raises(ValueError, match="offloaded"):
        cache.export_rows()
    cache.restore()
    assert cache.export_rows().rows == 1


def test_streaming_with_sinks_refuses_to_move():
    spec = dataclasses.replace(PLAIN, window=4, sinks=2)
    cache = StreamingCache(spec)
    History(spec).feed(cache, 9)
    with pytest.raises(ValueError, match="sinks"):
        cache.export_rows()
    plain = StreamingCache(dataclasses.replace(spec, sinks=0))
    History(plain.spec).feed(plain, 9)
    empty = StreamingCache(spec)
    with pytest.raises(ValueError, match="sinks"):
        empty.import_rows(plain.export_rows())
    assert empty.length == 0


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "4", None])
def test_with_block_size_refuses_what_is_not_a_positive_int(bad):
    with pytest.raises(ValueError, match="block_size"):
        PagedPool(16).with_block_size(bad)


def test_with_block_size_keeps_room_and_block_hash():
    def block_hash(parent, tokens, salt):
        return 0

    pool = PagedPool(16, 40, block_hash=block_hash).with_block_size(5)
    assert (pool.block_size, pool.num_blocks, pool.blocks_in_use) == (5, 40, 0)
    assert pool._index.block_hash is block_hash


@pytest.mark.parametrize(("name", "spec"), BUILTINS)
def test_an_imported_cache_goes_on_as_one_fed_its_tokens(name, spec):
    pool = factory(name)
    history = History(spec)
    source = pool(spec)
    for count in FEEDS:
        history.feed(source, count)
    cache = pool(spec)
    cache.import_rows(source.export_rows())
    offered = capabilities(cache)
    flip = torch.tensor([1, 0])
    cache.reorder(flip)
    history.keys, history.values = history.keys[flip], history.values[flip]
    history.feed(cache, 2)
    cache.truncate(cache.length - 3)
    history.keys, history.values = history.keys[:, :, :-3], history.values[:, :, :-3]
    history.feed(cache, 1)
    if "fork" in offered:
        twin = cache.fork()
        twin_history = History(spec, seed=1)
        twin_history.keys, twin_history.values = history.keys, history.values
        twin_history.feed(twin, 2)
    if "attend" in offered:
        attend(cache, history, spec)
    history.feed(cache, 2)
    cache.reset()
    cache.import_rows(source.export_rows())
    assert cache.length == source.length


def attend(cache, history: History, spec: CacheSpec) -> None:
    """One ``attend`` of one new row and its query (one: a chunk would make ``sdpa`` import
    its causal mask, 1.5 s), held to the reference attention."""
    start = cache.length
    shape = (spec.batch, 2 * spec.kv_heads, 1, spec.head_dim)
    query = torch.randn(shape, generator=history.generator, dtype=spec.dtype)
    key, value = history.new(1)
    history.keys = torch.cat((history.keys, key), dim=2)
    history.values = torch.cat((history.values, value), dim=2)
    got = cache.attend(query, key, value)
    positions = torch.arange(start + 1)
    expected = attention(
        query, history.keys, history.values, positions[start:], positions, spec.window
    )
    assert_close(got, expected)
