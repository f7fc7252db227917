"""Two wrong verdicts of the serving properties (kvcheck/properties/serving.py and
kvcheck/prefix_books.py), each pinned by a plan that showed it.

- A pool whose caches offer no ``truncate`` keeps every row through a rollback (the run
  skips it, and the next feed only goes past what the caches hold), but the plan's sizing
  counted the request as shortened: the tight pool was blocks short, and a correct pool was
  told "the pool refused a step the plan needs" (seen in the thorough profile on a correct
  vLLM pool).
- A hit that hands back a full block at the wrong index (the block of positions 0..15 where
  16..31 belong) holds a prefix of the request's tokens, and was diagnosed as "a block
  published before it was full and written": the block was full; it is the index that is
  wrong.
"""

import dataclasses

import pytest
import torch

from kvcheck import failures
from kvcheck.kit import probe_spec
from kvcheck.properties import serving
from kvimpl.paged import PagedCache, PagedPool
from kvref import ModelConfig, capabilities
from tests.mutants.serving import (
    CollisionServedAsHit,
    PublishesBlockBeforeWritten,
    PublishesBlockOneRowEarly,
)

BLOCK = 4
_one_layer = ModelConfig(vocab_size=5, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=2)


class _UntruncatableCache(PagedCache):
    truncate = None  # a runtime protocol counts a method set to None as not offered


class UntruncatablePool(PagedPool):
    """The built-in paged pool, correct, whose caches offer no ``truncate``."""

    def __call__(self, spec) -> PagedCache:
        return _UntruncatableCache(self, spec)


def _rollback_then_arrival(*, shorter_feed: bool) -> serving.ServingPlan:
    """r0 decodes to 9 tokens (3 blocks of 4) and rolls 4 back, to 5 (2 blocks), then (with
    ``shorter_feed``) is fed up to 8; then r1 arrives with a prompt no block of r0 holds. A
    pool without truncate still holds r0's 3 blocks when r1 takes its own."""
    to_shorter = (serving.Feed(0, 3),) if shorter_feed else ()
    return serving.ServingPlan(
        _one_layer,
        torch.float64,
        2,
        ((0, 1) * 2, (1, 1, 0, 0)),
        (
            serving.Arrive(0, 1, None, 0, 4, 0, 1),
            serving.Feed(0, 4),
            serving.Feed(0, 5),
            serving.Truncate(0, 4),
            *to_shorter,
            serving.Arrive(1, 1, None, 1, 4, 0, 2),
            serving.Feed(1, 4),
            serving.Leave(0, "drop"),
            serving.Leave(1, "drop"),
        ),
    )


@pytest.mark.parametrize("shorter_feed", [False, True], ids=["rollback", "shorter feed"])
def test_a_pool_without_truncate_is_sized_for_the_rows_its_caches_keep(shorter_feed):
    plan = _rollback_then_arrival(shorter_feed=shorter_feed)
    assert "truncate" not in capabilities(UntruncatablePool(BLOCK)(probe_spec()))
    try:
        serving.check_serving(UntruncatablePool(BLOCK), plan)
    except failures.RefusesValidInput as error:
        pytest.fail(f"a correct pool without truncate was sized too small: {error}")
    serving.check_serving(PagedPool(BLOCK), plan)  # and with truncate, on its tighter pool
    # r0's 3 blocks (kept through the rollback) and r1's one; with truncate r0 keeps 2.
    kept = plan.blocks_needed(BLOCK, offered=frozenset())
    assert kept == 4, f"sized for {kept} blocks without truncate, where the caches hold 4"
    rolled_back = plan.blocks_needed(BLOCK, offered=frozenset({"truncate"}))
    assert rolled_back == 3, f"sized for {rolled_back} blocks with truncate, where 3 are held"


class _HitsItsPredecessor(PagedCache):
    def _published_prefix(self, layer: int, salt, tokens: list[int], row: int) -> list:
        size, found, key = self.pool.block_size, [], None
        for end in range(size, len(tokens) + 1, size):
            key, prefix = self._block_key(key, tokens, end, layer, salt, row)
            block = self.pool._index.find(key, prefix)
            if block is None:
                break
            found.append((found[-1][0] if found else block, key))  # the bug: one index late
        return found


class HitsBlockOneIndexLate(PagedPool):
    """A hit hands back, at every index past the first, the block found for the index
    before it: a full block of this request's own prefix, at the wrong index."""

    def __call__(self, spec) -> PagedCache:
        return _HitsItsPredecessor(self, spec)


# r0 writes a prompt of two whole blocks of 16 (both published); r1 asks for the same prompt
# and a token more: its hit's second block must be r0's positions 16..31.
_SAME_PROMPT_TWICE = serving.ServingPlan(
    _one_layer,
    torch.float64,
    2,
    ((0, 1) * 16,),
    (
        serving.Arrive(0, 1, None, 0, 32, 0, 1),
        serving.Feed(0, 32),
        serving.Arrive(1, 1, None, 0, 32, 1, 2),
        serving.Feed(1, 33),
        serving.Leave(0, "drop"),
        serving.Leave(1, "drop"),
    ),
)


@pytest.mark.parametrize(
    ("pool", "block_hash"),
    [
        (HitsBlockOneIndexLate, "the pool's own"),
        # The first block published under a key, trusted: every key collides, so index 1 is
        # handed the block of index 0.
        (CollisionServedAsHit, "one where every block collides"),
    ],
    ids=["one index late", "key trusted under collisions"],
)
def test_a_full_block_at_the_wrong_index_is_not_called_published_early(pool, block_hash):
    plan = dataclasses.replace(_SAME_PROMPT_TWICE, block_hash=block_hash)
    with pytest.raises(failures.DataLoss) as caught:
        serving.check_serving(pool(), plan)
    message = str(caught.value)
    assert "published before it was full" not in message, (
        f"a full block at the wrong index was diagnosed as published early: {message}"
    )
    assert "a block from index 0 of a table, handed back at index 1" in message, (
        f"the diagnosis does not name the block's index and the one it was handed at: {message}"
    )
    assert "positions 0..15" in message, (
        f"the diagnosis does not say which positions the block holds: {message}"
    )


@pytest.mark.parametrize("pool", [PublishesBlockBeforeWritten, PublishesBlockOneRowEarly])
def test_a_block_found_while_partly_written_is_still_called_published_early(pool):
    # r1 looks r0's prompt up while r0 has written all but the last row of a block.
    with pytest.raises(failures.DataLoss) as caught:
        serving.check_serving(pool(), serving.PINNED[5])
    message = str(caught.value)
    assert "a block published before it was full and written" in message, (
        f"a block found while one row short of full was not diagnosed as published early: {message}"
    )
