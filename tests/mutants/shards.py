"""Broken tensor-parallel caches and plans (contract, section 11.1): each a few lines away
from the built-in ``ConcatCache`` or from ``kvref.shard_heads``, with exactly one bug.

Two are plans an engine declares (``tensor_parallel``: which heads each rank holds and
computes), two are caches that read ``spec.shard``. The first line of each docstring names
the bug, the rest the real failure it stands for.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from kvimpl import ConcatCache
from kvref import Shard, check_append, shard_heads


class KvHeadOnWrongRank(ConcatCache):
    """A plan that, replicating kv heads over more ranks than there are, gives rank r kv head
    r mod H_kv instead of r // (N / H_kv): the query heads it computes read another kv head.

    Stands for GQA sharding that splits a query group away from its kv head when the
    tensor-parallel degree exceeds the kv heads (TensorRT-LLM 6507): only layouts with
    replication and more than one kv head show it.
    """

    @staticmethod
    def tensor_parallel(num_heads: int, num_kv_heads: int, world: int) -> tuple[Shard, ...]:
        shards = shard_heads(num_heads, num_kv_heads, world)
        if num_kv_heads >= world:
            return shards
        return tuple(
            dataclasses.replace(shard, kv_heads=(shard.rank % num_kv_heads,)) for shard in shards
        )


class GatherInRankOrder(ConcatCache):
    """A plan whose ranks hold their kv heads in reverse rank order, while their outputs are
    gathered as if rank r computed the r-th block of query heads.

    Stands for an all-gather that concatenates shards in rank order when the heads were
    assigned in another (a permuted device mesh, a pipeline stage's ranks renumbered): every
    head's output lands in another head's place.
    """

    @staticmethod
    def tensor_parallel(num_heads: int, num_kv_heads: int, world: int) -> tuple[Shard, ...]:
        shards = shard_heads(num_heads, num_kv_heads, world)
        return tuple(
            dataclasses.replace(shard, kv_heads=shards[world - 1 - shard.rank].kv_heads)
            for shard in shards
        )


class ReplicaWrittenOnce(ConcatCache):
    """A cache that, on a rank whose kv head is replicated and which is not that head's first
    rank, stores zeros instead of the rows given (only the head's owner writes).

    Stands for a replicated kv head whose cache is written by one rank only, the others
    attending over what their buffers held (vllm, sglang with tp above the kv heads).
    """

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        shard = self.spec.shard
        if shard is not None and shard.replicated:
            replicas = shard.world // shard.num_kv_heads
            if shard.rank % replicas:
                check_append(self.spec, self.length, key, value)
                key, value = torch.zeros_like(key), torch.zeros_like(value)
        return super().append(key, value)


class LastRankSkipsReset(ConcatCache):
    """A cache whose reset does nothing on the last rank of a sharded run.

    Stands for a rank that misses the end of a request (its scheduler message lost, a
    condition on the rank), so that one rank's cache carries the old request's rows into the
    next while the others start afresh.
    """

    def reset(self) -> None:
        shard = getattr(self, "spec", None) and self.spec.shard
        if shard is not None and shard.rank == shard.world - 1 and hasattr(self, "key"):
            return
        super().reset()


SHARD_MUTANTS = (KvHeadOnWrongRank, GatherInRankOrder, ReplicaWrittenOnce, LastRankSkipsReset)
