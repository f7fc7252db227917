"""Tensor-parallel shards (contract, section 11.1): how a layer's heads are cut over ranks.

A ``Shard`` (one rank's share) is part of a ``CacheSpec`` and lives beside it in
``kvref.protocol``; this module holds the cut itself, as Megatron and vLLM make it, which the
kit uses to build each rank's spec and to judge a sharded run against the whole model.
"""

from __future__ import annotations

from kvref.protocol import Shard, is_count


def shard_heads(num_heads: int, num_kv_heads: int, world: int) -> tuple[Shard, ...]:
    """The shards Megatron and vLLM cut (section 11.1): with at least as many kv heads as
    ranks, rank r holds the r-th contiguous block of them and their query heads; with fewer,
    each kv head is replicated on world / num_kv_heads consecutive ranks, which split its
    group of query heads between them. Raises ``ValueError`` where neither count divides
    the other, or a replicated group does not split evenly."""
    for name, count in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("world", world)):
        if not is_count(count) or count < 1:
            raise ValueError(f"shard_heads: {name} must be an int >= 1, got {count!r}")
    if num_heads % num_kv_heads:
        raise ValueError(f"shard_heads: {num_heads} query heads for {num_kv_heads} kv heads")
    group = num_heads // num_kv_heads
    if num_kv_heads >= world:
        if num_kv_heads % world:
            raise ValueError(f"shard_heads: {num_kv_heads} kv heads do not split over {world}")
        per = num_kv_heads // world
        return tuple(
            Shard(
                rank,
                world,
                tuple(range(rank * per, (rank + 1) * per)),
                tuple(range(rank * per * group, (rank + 1) * per * group)),
                num_kv_heads,
            )
            for rank in range(world)
        )
    if world % num_kv_heads or group % (world // num_kv_heads):
        raise ValueError(
            f"shard_heads: {num_kv_heads} kv heads of {group} query heads each do not "
            f"replicate over {world} ranks"
        )
    replicas = world // num_kv_heads
    share = group // replicas
    return tuple(
        Shard(
            rank,
            world,
            (rank // replicas,),
            tuple(range(rank * share, (rank + 1) * share)),
            num_kv_heads,
        )
        for rank in range(world)
    )
