"""The independent radix-tree prefix pool (tests/independent/radix_prefix_pool.py) against
the contract's prefix-caching and offload rules (docs/contract.md, 9.1 and 9.3), with torch
and kvref only: hits, partly written blocks, salts and layers, eviction, the books, offload,
refusals, and a seeded random walk of requests checked against rows that are a function of
their own tokens."""

from __future__ import annotations

import gc
import math
import random
import zlib

import pytest
import torch

import kvref
from kvcheck.session import young_objects_only
from tests.independent.radix_prefix_pool import PoolExhausted, RadixPrefixPool

BLOCK = 4


def make_spec(batch: int = 1, max_length: int = 64) -> kvref.CacheSpec:
    return kvref.CacheSpec(batch, 1, 2, max_length, torch.float64, torch.device("cpu"))


def row_of(salt, layer: int, prefix: list[int]) -> list[float]:
    """The row a position gets: a function of its salt, layer and tokens up to it, so that a
    hit on another prefix, salt or layer shows."""
    code = zlib.crc32(repr((salt, layer, tuple(prefix))).encode())
    return [code / 2**32, float(layer) + len(prefix) / 1000]


def rows_for(salt, layer: int, history: list[list[int]], start: int, stop: int) -> torch.Tensor:
    """(B, 1, stop - start, 2): the rows of positions start..stop-1 of every batch row."""
    return torch.tensor(
        [
            [[row_of(salt, layer, tokens[: p + 1]) for p in range(start, stop)]]
            for tokens in history
        ],
        dtype=torch.float64,
    )


def ids(*rows: list[int]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64)


def check_books(pool: RadixPrefixPool, live) -> None:
    tables = set()
    for cache in live:
        if cache.offloaded:
            assert cache.block_tables == [[] for _ in range(cache.spec.batch)]
            continue
        for table in cache.block_tables:
            assert len(table) == math.ceil(cache.length / pool.block_size)
            tables.update(table)
        assert cache.nbytes >= kvref.min_nbytes(cache.spec, cache.length)
    assert pool.blocks_in_use == len(tables)
    assert pool.blocks_in_use + pool.blocks_free == pool.room
    assert 0 <= pool.blocks_evictable <= pool.blocks_cached
    assert pool.blocks_cached - pool.blocks_evictable <= pool.blocks_in_use
    assert pool.blocks_in_use + pool.blocks_evictable <= pool.room


def feed(caches, salt, history: list[list[int]], stop: int):
    """Append the rows of positions length..stop-1 to every layer; the last layer's return."""
    out = None
    for layer, cache in enumerate(caches):
        rows = rows_for(salt, layer, history, cache.length, stop)
        out = cache.append(rows, rows.clone())
    return out


def assert_holds(caches, salt, history: list[list[int]], *, tolerant: bool = False) -> None:
    """Every layer returns exactly its rows when given one more, then is truncated back.

    ``history`` is every declared token of each row: the row appended is the next declared
    token's where there is one (its truncate forgets the tokens declared past it, which are
    then declared again), else the row of the undeclared token 9. ``tolerant``: a layer whose
    probe the pool refuses for want of blocks is not probed."""
    for layer, cache in enumerate(caches):
        length = cache.length
        declared = len(history[0])
        longer = [
            [*tokens[:length], tokens[length] if declared > length else 9] for tokens in history
        ]
        new = rows_for(salt, layer, longer, length, length + 1)
        try:
            keys, values = cache.append(new, new.clone())
        except PoolExhausted:
            if not tolerant:
                raise
            assert cache.length == length
            continue
        want = rows_for(salt, layer, longer, 0, length + 1)
        assert torch.equal(keys, want)
        assert torch.equal(values, want)
        cache.truncate(length)
        if declared > length:
            cache.declare_tokens(ids(*(tokens[length:] for tokens in history)))


def request(pool, tokens: list[list[int]], *, salt=None, layers: int = 2, written=None):
    """A request's caches, looked up with ``tokens`` and fed up to ``written`` of them."""
    caches = [pool(make_spec(len(tokens))) for _ in range(layers)]
    hit = pool.lookup_prefix(caches, ids(*tokens), salt=salt)
    feed(caches, salt, tokens, len(tokens[0]) if written is None else written)
    return caches, hit


def test_it_is_a_prefix_caching_block_pool():
    pool = RadixPrefixPool(block_size=BLOCK, num_blocks=16)
    cache = pool(make_spec())
    assert isinstance(pool, kvref.BlockPool)
    assert isinstance(pool, kvref.PrefixCaching)
    assert isinstance(cache, kvref.LayerCache)
    assert isinstance(cache, kvref.BlockTables)
    assert isinstance(cache, kvref.Offloadable)
    assert {"truncate", "reorder", "fork", "offload"} <= kvref.capabilities(cache)
    assert "attend" not in kvref.capabilities(cache)
    hashed = pool.with_blocks(8, block_hash=lambda parent, tokens, salt: 0)
    assert (hashed.block_size, hashed.blocks_free, hashed.blocks_in_use) == (BLOCK, 8, 0)


def test_a_second_request_hits_the_full_blocks_a_first_one_wrote():
    pool = RadixPrefixPool(block_size=BLOCK, num_blocks=64)
    prompt = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
    first, hit = request(pool, prompt)
    assert hit == 0
    assert pool.blocks_cached == 2 * 2  # two full blocks, two layers
    second = [pool(make_spec()) for _ in range(2)]
    assert pool.lookup_prefix(second, ids([*prompt[0], 11])) == 8
    for old, new in zip(first, second, strict=True):
        assert new.length == 8
        assert new.block_tables[0] == old.block_tables[0][:2]
    assert_holds(second, None, [[*prompt[0], 11]])
    check_books(pool, first + second)
    # A prompt that leaves the first one inside its second block hits its first block only.
    third = [pool(make_spec()) for _ in range(2)]
    assert pool.lookup_prefix(third, ids([1, 2, 3, 4, 5, 6, 0, 8, 9])) == 4
    assert_holds(third, None, [[1, 2, 3, 4, 5, 6, 0, 8, 9]])
    check_books(pool, first + second + third)


def test_a_partly_written_or_undeclared_block_is_never_hit():
    pool = RadixPrefixPool(block_size=BLOCK, num_blocks=64)
    prompt = [[1, 2, 3, 4, 5, 6, 7, 8]]
    writer, _ = request(pool, prompt, written=6)  # declared 8, written 6
    reader = [pool(make_spec()) for _ in range(2)]
    assert pool.lookup_prefix(reader, ids(*prompt)) == 4
    # Written but declared only in part: rows past the declared tokens are never published.
    undeclared = [pool(make_spec()) for _ in range(2)]
    pool.lookup_prefix(undeclared, ids([5, 5, 5, 5, 5, 5]))
    feed(undeclared, None, [[5] * 12], 12)
    probe = [pool(make_spec()) for _ in range(2)]
    assert pool.lookup_prefix(probe, ids([5] * 12)) == 4
    # Written and declared afterwards does not make them declared before: still unpublished.
    for cache in undeclared:
        cache.declare_tokens(ids([5] * 4))
    again = [pool(make_spec()) for _ in range(2)]
    assert pool.lookup_prefix(again, ids([5] * 12)) == 4
    # A cache given no lookup publishes nothing.
    loner = pool(make_spec())
    loner.declare_tokens(ids([7] * 8))
    loner.append(*(rows_for(None, 0, [[7] * 8], 0, 8),) * 2)
    alone = pool(make_spec())
    assert pool.lookup_prefix([alone], ids([7] * 8)) == 0
    check_books(pool, [*writer, *reader, *undeclared, *probe, *again, loner, alone])


def test_salts_and_layers_are_kept_apart():
    pool = RadixPrefixPool(block_size=BLOCK, num_blocks=64)
    prompt = [[1, 1, 2, 2, 3, 3, 4, 4]]
    tenant, _ = request(pool, prompt, salt="a")
    other = [pool(make_spec()) for _ in range(2)]
    assert pool.lookup_prefix(other, ids(*prompt), salt="b") == 0
    unsalted = [pool(make_spec()) for _ in range(2)]
    assert pool.lookup_prefix(unsalted, ids(*prompt)) == 0
    same = [pool(make_spec()) for _ in range(2)]
    assert pool.lookup_prefix(same, ids(*prompt), salt="a") == 8
    # Only layer 0 was written by a one-layer request: a two-layer request's layer 1 has
    # nothing, so the hit (the least over layers) is 0.
    single, _ = request(pool, [[6] * 8], layers=1)
    both = [pool(make_spec()) for _ in range(2)]
    assert pool.lookup_prefix(both, ids([6] * 8)) == 0
    # Every row must find it: the hit is the least over rows.
    rows = [pool(make_spec(batch=2)) for _ in range(2)]
    assert (
        pool.lookup_prefix(rows, ids([1, 1, 2, 2, 3, 3, 4, 4], [1, 1, 2, 2, 0, 0, 0, 0]), salt="a")
        == 4
    )
    check_books(pool, [*tenant, *other, *unsalted, *same, *single, *both, *rows])


def test_a_tight_pool_evicts_the_least_recently_used_unreferenced_blocks():
    pool = RadixPrefixPool(block_size=BLOCK, num_blocks=6)
    a, _ = request(pool, [[1] * 8], layers=1)
    c, _ = request(pool, [[2] * 8], layers=1)
    for cache in a + c:
        cache.reset()
    assert (pool.blocks_in_use, pool.blocks_free, pool.blocks_cached) == (0, 6, 4)
    assert pool.blocks_evictable == 4
    touched = [pool(make_spec())]
    assert pool.lookup_prefix(touched, ids([1] * 8)) == 8  # a's blocks are now the recent ones
    touched[0].reset()
    big, _ = request(pool, [[3] * 16], layers=1)  # 4 blocks: 2 free ones, then c's 2 evicted
    check_books(pool, big)
    assert pool.blocks_evictable == 2
    probe = [pool(make_spec())]
    assert pool.lookup_prefix(probe, ids([2] * 8)) == 0
    assert pool.lookup_prefix([pool(make_spec())], ids([1] * 8)) == 8
    # Referenced blocks are never evicted: the pool refuses, changing nothing.
    blocks = (pool.blocks_in_use, pool.blocks_free, pool.blocks_cached)
    with pytest.raises(ValueError, match="pool"):
        probe[0].append(*(rows_for(None, 0, [[0] * 20], 0, 20),) * 2)
    assert probe[0].length == 0
    assert (pool.blocks_in_use, pool.blocks_free, pool.blocks_cached) == blocks


def test_evicted_and_unpublished_blocks_leave_the_tree_before_reuse():
    pool = RadixPrefixPool(block_size=BLOCK, num_blocks=3)  # a spare one for the probes
    writer, _ = request(pool, [[1] * 8], layers=1)
    writer[0].truncate(6)  # back into a published block, referenced by this row alone
    history = [[1, 1, 1, 1, 1, 1, 0, 0]]
    writer[0].declare_tokens(ids([0, 0]))
    feed(writer, None, history, 8)
    assert_holds(writer, None, history)
    reader = [pool(make_spec())]
    assert pool.lookup_prefix(reader, ids([1] * 8)) == 4  # the old second block is gone
    reader[0].reset()
    assert pool.lookup_prefix(reader, ids(history[0])) == 8
    assert_holds(reader, None, history)
    check_books(pool, [writer[0], reader[0]])


def test_a_shared_block_is_copied_before_it_is_written():
    pool = RadixPrefixPool(block_size=BLOCK, num_blocks=16)
    prompt = [[1, 2, 3, 4, 5, 6, 7, 8]]
    owner, _ = request(pool, prompt)
    sharer = [pool(make_spec()) for _ in range(2)]
    assert pool.lookup_prefix(sharer, ids(*prompt)) == 8
    edited = [[1, 2, 3, 4, 5, 6, 0, 0]]
    for cache in sharer:
        cache.truncate(6)
        cache.declare_tokens(ids([0, 0]))
    feed(sharer, None, edited, 8)
    for mine, theirs in zip(sharer, owner, strict=True):
        assert mine.block_tables[0][0] == theirs.block_tables[0][0]
        assert mine.block_tables[0][1] != theirs.block_tables[0][1]
    assert_holds(owner, None, prompt)
    assert_holds(sharer, None, edited)
    for tokens in (prompt, edited):
        probe = [pool(make_spec()) for _ in range(2)]
        assert pool.lookup_prefix(probe, ids(*tokens)) == 8
        assert_holds(probe, None, tokens)
        for cache in probe:
            cache.reset()
    check_books(pool, owner + sharer)


def test_fork_and_reorder_carry_the_declared_tokens():
    pool = RadixPrefixPool(block_size=BLOCK, num_blocks=32)
    history = [[1, 1, 1, 1, 2, 2, 2, 2], [3, 3, 3, 3, 4, 4, 4, 4]]
    parent, _ = request(pool, history, written=5)
    child = [cache.fork() for cache in parent]
    for cache in child:
        cache.reorder(torch.tensor([1, 0]))
    flipped = history[::-1]
    feed(child, None, flipped, 8)
    assert_holds(child, None, flipped)
    assert_holds(parent, None, history)  # the fork's writes never reach the parent
    for tokens in ([history[0]], [history[1]]):
        probe = [pool(make_spec()) for _ in range(2)]
        assert pool.lookup_prefix(probe, ids(*tokens)) == 8
        assert_holds(probe, None, tokens)
        for cache in probe:
            cache.reset()
    check_books(pool, parent + child)


@young_objects_only()  # a collection of what the test made, not of the whole heap
def test_reset_and_collection_give_every_block_back():
    pool = RadixPrefixPool(block_size=BLOCK, num_blocks=32)
    kept, _ = request(pool, [[1] * 9, [2] * 9])
    dropped, _ = request(pool, [[1] * 9, [5] * 9])
    forks = [cache.fork() for cache in dropped]
    assert pool.blocks_in_use > 0
    for cache in kept:
        cache.reset()
        assert cache.block_tables == [[], []]
    del dropped, forks
    gc.collect()
    assert pool.blocks_in_use == 0
    assert pool.blocks_free == 32
    assert pool.blocks_cached == pool.blocks_evictable > 0
    # reset forgets the lookup and the declared tokens: rows appended afterwards, declared
    # or not, are never published (a cache given no lookup has no layer to publish for).
    cache = kept[0]
    cache.append(*(rows_for(None, 0, [[8] * 4] * 2, 0, 4),) * 2)
    cache.declare_tokens(ids([8] * 4, [8] * 4))
    cache.append(*(rows_for(None, 0, [[8] * 8] * 2, 4, 8),) * 2)
    assert pool.lookup_prefix([pool(make_spec(2))], ids([8] * 8, [8] * 8)) == 0
    cache.reset()
    cache.declare_tokens(ids([8] * 8, [8] * 8))
    cache.append(*(rows_for(None, 0, [[8] * 8] * 2, 0, 8),) * 2)
    assert pool.lookup_prefix([pool(make_spec(2))], ids([8] * 8, [8] * 8)) == 0
    assert pool.lookup_prefix([pool(make_spec(2))], ids([8] * 8, [8] * 8)) == 0


def test_offloaded_rows_come_back_bit_for_bit_after_their_blocks_were_reused():
    pool = RadixPrefixPool(block_size=BLOCK, num_blocks=6)
    history = [[1, 2, 3, 4, 5, 6], [6, 5, 4, 3, 2, 1]]
    swapped, _ = request(pool, history, layers=1)
    (cache,) = swapped
    before_tables = {block for table in cache.block_tables for block in table}
    before_bytes = cache.nbytes
    cache.offload()
    assert cache.offloaded
    assert cache.length == 6
    assert cache.nbytes == kvref.min_nbytes(cache.spec, 6) < before_bytes  # the host rows
    assert pool.blocks_in_use == 0
    check_books(pool, [cache])
    # Every block, the ones given back among them (the cached ones evicted).
    other, _ = request(pool, [[9] * 12, [8] * 12], layers=1)
    assert before_tables <= {block for table in other[0].block_tables for block in table}
    # No room: refused, nothing changed.
    books = (pool.blocks_in_use, pool.blocks_free, pool.blocks_cached, pool.blocks_evictable)
    with pytest.raises(ValueError, match="pool"):
        cache.restore()
    assert cache.offloaded
    assert cache.length == 6
    assert books == (
        pool.blocks_in_use,
        pool.blocks_free,
        pool.blocks_cached,
        pool.blocks_evictable,
    )
    other[0].reset()
    cache.restore()
    assert not cache.offloaded
    check_books(pool, [cache, other[0]])
    # Restored rows are published again: a lookup finds them.
    probe = pool(make_spec(2))
    assert pool.lookup_prefix([probe], ids(*history)) == 4
    assert_holds(swapped, None, history)
    assert_holds([probe], None, history)


def test_bad_input_is_refused_and_changes_nothing():
    pool = RadixPrefixPool(block_size=BLOCK, num_blocks=16)
    written, _ = request(pool, [[1] * 8])
    elsewhere = RadixPrefixPool(block_size=BLOCK, num_blocks=16)(make_spec())
    fresh = [pool(make_spec()) for _ in range(2)]
    good = ids([1] * 8)
    bad_calls = {
        "a cache not empty": lambda: pool.lookup_prefix([fresh[0], written[1]], good),
        "a cache of another pool": lambda: pool.lookup_prefix([fresh[0], elsewhere], good),
        "one cache twice": lambda: pool.lookup_prefix([fresh[0], fresh[0]], good),
        "no caches": lambda: pool.lookup_prefix([], good),
        "not a list": lambda: pool.lookup_prefix(fresh[0], good),
        "tokens int32": lambda: pool.lookup_prefix(fresh, good.int()),
        "tokens of rank 1": lambda: pool.lookup_prefix(fresh, good[0]),
        "tokens of batch 2": lambda: pool.lookup_prefix(fresh, ids([1] * 8, [1] * 8)),
        "tokens a list": lambda: pool.lookup_prefix(fresh, [[1] * 8]),
        "salt unhashable": lambda: pool.lookup_prefix(fresh, good, salt=["a"]),
        "declare float": lambda: fresh[0].declare_tokens(good.double()),
        "declare batch 2": lambda: fresh[0].declare_tokens(ids([1], [1])),
        "truncate past": lambda: written[0].truncate(9),
        "truncate negative": lambda: written[0].truncate(-1),
        "truncate float": lambda: written[0].truncate(2.0),
        "reorder range": lambda: written[0].reorder(torch.tensor([1])),
        "reorder dtype": lambda: written[0].reorder(torch.tensor([0], dtype=torch.int32)),
        "restore not offloaded": lambda: written[0].restore(),
        "append overflow": lambda: written[0].append(*(torch.zeros(1, 1, 57, 2),) * 2),
        "append head_dim": lambda: written[0].append(*(torch.zeros(1, 1, 1, 3),) * 2),
        "append float32": lambda: written[0].append(*(torch.zeros(1, 1, 1, 2),) * 2),
    }

    def state():
        return (
            pool.blocks_in_use,
            pool.blocks_free,
            pool.blocks_cached,
            pool.blocks_evictable,
            [(c.length, c.block_tables, c.offloaded) for c in [*written, *fresh]],
        )

    for name, call in bad_calls.items():
        before = state()
        with pytest.raises(ValueError):  # noqa: PT011 - the wording is the pool's own
            call()
        assert state() == before, name
    assert pool.lookup_prefix(fresh, good) == 8  # the same caches, still usable
    assert_holds(written, None, [[1] * 8])
    assert_holds(fresh, None, [[1] * 8])
    check_books(pool, written + fresh)


# The random walk's events, the more frequent ones repeated.
EVENTS = (
    *("start", "start", "feed", "feed", "feed", "truncate", "fork", "reorder"),
    *("offload", "restore", "restore", "finish", "finish", "finish"),
)


STEMS = ([0, 1, 0, 1, 1, 0, 0, 1], [0, 1, 0, 1, 0, 0, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1])


def feed_or_roll_back(r: dict, stop: int):
    """Feed every layer up to ``stop``; where the pool refuses a layer, the layers already fed
    are truncated back (and their declared tokens declared again), so the request is as it was."""
    caches, history = r["caches"], r["history"]
    length = caches[0].length
    fed = []
    try:
        for layer, cache in enumerate(caches):
            rows = rows_for(r["salt"], layer, history, length, stop)
            keys, _ = cache.append(rows, rows.clone())
            fed.append(cache)
    except PoolExhausted:
        for cache in fed:
            cache.truncate(length)
            cache.declare_tokens(ids(*(tokens[length:] for tokens in history)))
        assert all(cache.length == length for cache in caches)
        return None
    return keys


# Twelve walks under --soak (some two seconds of CPU each); the default run holds the pool to
# the kit's serving properties (tests/test_independent_caches.py).
@pytest.mark.soak
@pytest.mark.parametrize("seed", range(12))
def test_a_random_walk_of_requests_holds_every_rule(seed):
    """Requests of two tenants over a vocabulary of 2 start (on fresh or reset caches, with
    a lookup), feed in chunks (declaring first), truncate, fork, reorder, offload, restore,
    reset and are dropped on a tight pool. Every returned row is its own tokens' row; every
    hit is at least the whole blocks a live request of that salt holds; the books hold."""
    rng = random.Random(seed)
    size = 2
    pool = RadixPrefixPool(block_size=size, num_blocks=rng.choice([8, 16, 32]))
    # Each request: its caches (one per layer), salt, declared tokens per row, whether away.
    live: list[dict] = []
    spare: list = []  # reset caches, reused by later requests

    def lower_bound(salt, tokens: list[list[int]]) -> int:
        """The whole blocks of these tokens that live requests of the salt hold written."""
        least = None
        for row_tokens in tokens:
            best = 0
            for other in live:
                if other["salt"] != salt or other["offloaded"]:
                    continue
                held = min(other["caches"][0].length, len(row_tokens))
                for history in other["history"]:
                    same = 0
                    while same < held and history[same] == row_tokens[same]:
                        same += 1
                    best = max(best, same // size)
            least = best if least is None else min(least, best)
        return least * size

    def step(event: str) -> bool:
        """One event (a function, so that no name of it outlives a dropped request)."""
        movable = [r for r in live if not r["offloaded"]]
        if event == "start" or not live:
            batch, salt, width = rng.choice([1, 2]), rng.choice([None, "t"]), rng.randrange(9)
            # Prompts drawn from a few stems, so that they share prefixes most of the time.
            prompt = [rng.choice(STEMS)[:width] for _ in range(batch)]
            caches = []
            for _ in range(2):
                reusable = [c for c in spare if c.spec.batch == batch]
                caches.append(reusable[0] if reusable else pool(make_spec(batch)))
                if reusable:
                    spare.remove(reusable[0])
            want = lower_bound(salt, prompt)
            hit = pool.lookup_prefix(caches, ids(*prompt), salt=salt)
            assert hit % size == 0
            assert want <= hit <= width
            assert all(cache.length == hit for cache in caches)
            live.append({"caches": caches, "salt": salt, "history": prompt, "offloaded": False})
        elif event == "feed" and movable:
            r = rng.choice(movable)
            length, declared = r["caches"][0].length, len(r["history"][0])
            if declared == length:
                extra = rng.randrange(1, 4)
                new = [[rng.randrange(2) for _ in range(extra)] for _ in r["history"]]
                for cache in r["caches"]:
                    cache.declare_tokens(ids(*new))
                for row, tokens in zip(r["history"], new, strict=True):
                    row.extend(tokens)
            stop = rng.randrange(length + 1, len(r["history"][0]) + 1)
            if stop > 64:
                return False
            keys = feed_or_roll_back(r, stop)
            if keys is not None:
                assert torch.equal(keys, rows_for(r["salt"], 1, r["history"], 0, stop))
        elif event == "truncate" and movable:
            r = rng.choice(movable)
            length = rng.randrange(r["caches"][0].length + 1)
            for cache in r["caches"]:
                cache.truncate(length)
            r["history"] = [row[:length] for row in r["history"]]
        elif event == "fork" and movable:
            r = rng.choice(movable)
            forked = [cache.fork() for cache in r["caches"]]
            history = [list(row) for row in r["history"]]
            live.append({**r, "caches": forked, "history": history})
        elif event == "reorder" and movable:
            r = rng.choice(movable)
            order = [rng.randrange(len(r["history"])) for _ in r["history"]]
            for cache in r["caches"]:
                cache.reorder(torch.tensor(order))
            r["history"] = [list(r["history"][i]) for i in order]
        elif event == "offload" and movable:
            r = rng.choice(movable)
            for cache in r["caches"]:
                cache.offload()
            r["offloaded"] = True
        elif event == "restore" and len(movable) < len(live):
            r = rng.choice([r for r in live if r["offloaded"]])
            restored = []
            try:
                for cache in r["caches"]:
                    cache.restore()
                    restored.append(cache)
            except PoolExhausted:
                assert all(cache.offloaded for cache in r["caches"] if cache not in restored)
                for cache in restored:
                    cache.offload()
                return False
            r["offloaded"] = False
        elif event == "finish":
            r = live.pop(rng.randrange(len(live)))
            if rng.random() < 0.5 and not r["offloaded"]:
                for cache in r["caches"]:
                    cache.reset()
                spare.extend(r["caches"])
                return False
            return True  # dropped
        return False

    def audit() -> None:
        for r in live:
            if not r["offloaded"]:
                assert_holds(r["caches"], r["salt"], r["history"], tolerant=True)
        check_books(pool, [cache for r in live for cache in r["caches"]] + spare)

    for _ in range(80):
        if step(rng.choice(EVENTS)):
            gc.collect()  # a finished request not reset is dropped: its blocks come back
        audit()
    while live:
        for cache in live.pop()["caches"]:
            cache.reset()
    check_books(pool, spare)
    assert pool.blocks_in_use == 0
    assert pool.blocks_cached == pool.blocks_evictable
