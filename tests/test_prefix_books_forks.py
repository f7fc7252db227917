"""The prefix books follow the blocks of a fork (kvcheck/session/events/fork.py and
kvcheck/prefix_books.py), whether it copies them or shares them.

- A pool may give a fork fresh blocks holding copies of its parent's rows (SGLang shares
  only through its tree, so its adapter copies a request's own pages at a fork) and publish
  those copies once the parent is gone. Before the books recorded a fork's blocks, the probe
  after the parent left said "no request wrote that block" of the copy: a false alarm.
- A request that rolls back into a block it wrote full, then forks, shares that block,
  which stays published with every row written. Before the books kept what a block held
  past a fork's end, they took the fork's three rows for the block's last write and said
  "a block published before it was full" of a hit on it: a false alarm, found by the README's
  random-seed run on the radix pool.
"""

import pytest
import torch

from kvcheck.properties import serving
from kvimpl import PagedPool
from kvref import ModelConfig
from tests.independent.coded_radix_pool import CodedRadixPool
from tests.independent.radix_prefix_pool import RadixPrefixCache, RadixPrefixPool


class _CopyingForkCache(RadixPrefixCache):
    def fork(self) -> RadixPrefixCache:
        pool = self.pool
        child = RadixPrefixCache(pool, self.spec)
        for row, table in enumerate(self._tables):
            taken = pool._take(len(table), self._slab)
            for source, target in zip(table, taken, strict=True):
                self._slab.copy(source, target)
            child._tables[row].extend(taken)
        child._tokens = [list(tokens) for tokens in self._tokens]
        child._key = self._key
        child._undeclared_from = self._undeclared_from
        child._count = self._count
        child._publish_full_blocks()  # twins of the parent's blocks, in the same nodes
        return child


class _CopyingForkPool(RadixPrefixPool):
    def __call__(self, spec) -> RadixPrefixCache:
        return _CopyingForkCache(self, spec)

    def with_blocks(self, num_blocks: int, *, block_hash=None) -> RadixPrefixPool:
        return _CopyingForkPool(self.block_size, num_blocks)


def test_a_fork_that_copies_its_parents_blocks_holds_the_prefix_caching_property():
    config = ModelConfig(vocab_size=2, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=2)
    plan = serving.ServingPlan(
        config=config,
        dtype=torch.float64,
        vocab=2,
        systems=((0, 1) * 8,),
        events=(
            serving.Arrive(request=0, batch=1, salt=None, system=0, shared=8, own=0, seed=1),
            serving.Feed(request=0, size=8),
            serving.Fork(parent=0, child=1),
            serving.Leave(request=0, how="drop"),
            serving.Feed(request=1, size=1),
            serving.Leave(request=1, how="drop"),
        ),
    )
    serving.check_serving(_CopyingForkPool(), plan)


# The independent pools run in the soak tier: each costs the default run a second.
@pytest.mark.parametrize(
    "pool",
    [
        pytest.param(RadixPrefixPool, marks=pytest.mark.soak),
        pytest.param(CodedRadixPool, marks=pytest.mark.soak),
        PagedPool,
    ],
)
def test_a_fork_after_a_rollback_into_a_full_block_shares_it_whole(pool):
    config = ModelConfig(vocab_size=5, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=2)
    plan = serving.ServingPlan(
        config=config,
        dtype=torch.float64,
        vocab=2,
        systems=((0,) * 17,),
        events=(
            serving.Arrive(request=0, batch=1, salt=None, system=0, shared=17, own=0, seed=0),
            serving.Feed(request=0, size=17),
            serving.Feed(request=0, size=3),  # positions 16..19: a block written full
            serving.Truncate(request=0, back=1),  # holds 3 of its rows, still published
            serving.Fork(parent=0, child=1),  # shares it
            serving.Feed(request=1, size=1),  # a copy written full: a twin; the probe finds it
            serving.Leave(request=0, how="drop"),
            serving.Leave(request=1, how="drop"),
        ),
        block_hash="one of two values",
    )
    serving.check_serving(pool(), plan)
