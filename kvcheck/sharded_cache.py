"""Tensor-parallel shards of an attention layer (docs/contract.md, section 11.1).

A ``ShardedCache`` is what the reference model sees in one layer of a sharded run: one
object offering ``attend`` over every query head, behind which each rank this process hosts
has a cache of its own, built from the user's factory for its shard of kv heads. A call
slices the rank's heads, attends through its cache (``attend`` where the cache offers it,
``append`` and ``kvref.attention`` over the rows returned otherwise) and gathers every
rank's output into the query heads the plan gave it. The ranks live either here
(``SimulatedRanks``: all of them in this process, the gather a list) or one per process
(``kvcheck.rank_processes.ProcessGroupRanks``: ``torch.distributed``), so both tests of
``kvcheck/properties/sharded.py`` run one engine.

Every event the session engine sends (reset, truncate, reorder, fork) reaches every rank's
cache. In one process ``length`` reads every rank's, and ranks that disagree are a failure
naming them; across processes each rank reads its own, held to the history by the engine.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from kvcheck import asserts as kvassert
from kvcheck import failures, pool_books
from kvcheck.harness import Recorder, build, offers_attend
from kvref import (
    CacheContractError,
    CacheFactory,
    CacheRows,
    CacheSpec,
    Shard,
    attention,
    shard_heads,
)
from kvref.capabilities import capabilities

POOL_BLOCKS = 4096  # each rank's pool, where the factory is a kvref.BlockPool


class Ranks(Protocol):
    """The ranks of one sharded run, as this process sees them."""

    world: int
    hosted: tuple[int, ...]  # the ranks whose caches live in this process

    def gather(self, local: Sequence[Tensor]) -> list[Tensor]:
        """Every rank's tensor, in rank order, from those of the hosted ranks (equal shapes)."""
        ...


class SimulatedRanks:
    """Every rank in this process: a gather is the list itself."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.hosted = tuple(range(world))

    def gather(self, local: Sequence[Tensor]) -> list[Tensor]:
        return list(local)


def plan_for(factory: CacheFactory, num_heads: int, num_kv_heads: int, world: int):
    """The shards of a layer: the factory's own ``tensor_parallel`` plan where it has one
    (checked that it can be run), else ``kvref.shard_heads``."""
    declared = getattr(factory, "tensor_parallel", None)
    if not callable(declared):
        return shard_heads(num_heads, num_kv_heads, world)
    shards = tuple(declared(num_heads, num_kv_heads, world))
    check_plan(shards, num_heads, num_kv_heads, world)
    return shards


def check_plan(shards: Sequence[Shard], num_heads: int, num_kv_heads: int, world: int) -> None:
    """A declared plan can be run: one ``Shard`` per rank in rank order, every query head
    computed by exactly one rank, each rank's query heads a multiple of its kv heads and as
    many as every other rank's (an all-gather needs equal shapes)."""
    what = f"tensor_parallel({num_heads}, {num_kv_heads}, {world})"
    if len(shards) != world or any(
        not isinstance(shard, Shard) or shard.rank != rank or shard.world != world
        for rank, shard in enumerate(shards)
    ):
        raise CacheContractError(f"{what} must return {world} kvref.Shard, rank r at index r")
    computed = sorted(head for shard in shards for head in shard.query_heads)
    if computed != list(range(num_heads)):
        raise CacheContractError(
            f"{what}: the shards compute query heads {computed}, not each of 0..{num_heads - 1} "
            f"once: {shards}"
        )
    for shard in shards:
        heads = len(shard.query_heads)
        if not shard.kv_heads or heads % len(shard.kv_heads) or heads != num_heads // world:
            raise CacheContractError(
                f"{what}: rank {shard.rank} computes {heads} query heads over "
                f"{len(shard.kv_heads)} kv heads; every rank needs {num_heads // world}, a "
                f"multiple of its kv heads: {shard}"
            )
        if any(not 0 <= head < num_kv_heads for head in shard.kv_heads):
            raise CacheContractError(f"{what}: rank {shard.rank} holds kv heads {shard.kv_heads}")


class ShardedCache:
    """One layer's caches on every rank this process hosts, presented to the model as one
    cache that attends over every query head (see the module docstring)."""

    builds_through_kit = True  # the declared domain is its ranks' caches', not its own

    def __init__(
        self,
        spec: CacheSpec,
        shards: Sequence[Shard],
        ranks: Ranks,
        recorders: dict,
        layer: int | None = None,
    ) -> None:
        self.spec = spec
        self.shards = tuple(shards)
        self.ranks = ranks
        self.recorders = recorders  # rank -> Recorder of that rank's cache
        self.layer = layer  # of the model, for messages

    # --- what the model reads -------------------------------------------------------------
    @property
    def length(self) -> int:
        # Every rank's in one process; across processes this rank's alone (a gather at every
        # read would cost a collective each, and the engine holds each to the history).
        lengths = [recorder.length for recorder in self.recorders.values()]
        if len(set(lengths)) > 1:
            said = ", ".join(f"rank {rank} {n}" for rank, n in enumerate(lengths))
            layer = "one layer" if self.layer is None else f"layer {self.layer}"
            raise failures.DataLoss(
                f"the ranks' caches of {layer} disagree on length ({said}): every rank must "
                f"see every event (a reset, truncate or append that one rank skipped)\n"
                f"  shards: {self.describe()}"
            )
        return lengths[0]

    @property
    def nbytes(self) -> int:
        return sum(recorder.nbytes for recorder in self.recorders.values())

    @property
    def kv_storage(self):
        """The storage its ranks' caches declare (contract, section 10.1): one factory's."""
        return getattr(next(iter(self.recorders.values())).cache, "kv_storage", None)

    def attend(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        start = self.length
        outputs = []
        for rank, recorder in self.recorders.items():
            shard = self.shards[rank]
            heads = torch.tensor(shard.kv_heads, device=key.device)
            local = query[:, list(shard.query_heads)], key[:, heads], value[:, heads]
            outputs.append(self._attend_rank(rank, recorder, *local, start))
        gathered = self.ranks.gather(outputs)
        mixed = torch.empty_like(query)
        for shard, output in zip(self.shards, gathered, strict=True):
            mixed[:, list(shard.query_heads)] = output.to(query.device)
        return mixed

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """Each rank appends its kv heads; the rows they return, gathered, by global head
        (a model path that reads rows: none of the kit's sharded plans, a patched model's)."""
        start = self.length
        returned = []
        for rank in self.recorders:
            heads = torch.tensor(self.shards[rank].kv_heads, device=key.device)
            keys, values = self._append_rank(rank, key[:, heads], value[:, heads], start)
            returned.append(torch.cat((keys, values), dim=-1))
        rows = returned[0].shape[2]
        if any(part.shape[2] != rows for part in returned):
            raise failures.DataLoss(
                f"the ranks' caches returned {[part.shape[2] for part in returned]} rows: every "
                f"rank holds the same tokens\n  shards: {self.describe()}"
            )
        gathered = self.ranks.gather(returned)
        held = torch.empty(
            (key.shape[0], self.spec.kv_heads, rows, key.shape[3] + value.shape[3]),
            dtype=key.dtype,
            device=key.device,
        )
        for shard, part in zip(self.shards, gathered, strict=True):
            held[:, list(shard.kv_heads)] = part.to(key.device)
        return held.split((key.shape[3], value.shape[3]), dim=-1)

    def _append_rank(self, rank: int, key: Tensor, value: Tensor, start: int):
        """``rank``'s append of its heads' rows, held to the rows it was given."""
        recorder = self.recorders[rank]
        keys, values = recorder.append(key, value)
        where = f"step at positions {start}..{start + key.shape[2] - 1}"
        kvassert.assert_returned_rows(recorder, who=self._who(rank), where=where)
        return keys, values

    def _attend_rank(self, rank, recorder, query, key, value, start: int) -> Tensor:
        if recorder.path == "attend":
            return recorder.attend(query, key, value)
        keys, values = self._append_rank(rank, key, value, start)
        end = start + key.shape[2]
        positions = torch.arange(end - keys.shape[2], end, device=query.device)
        return attention(
            query, keys, values, positions[-key.shape[2] :], positions, self.spec.window
        )

    # --- events, on every rank ------------------------------------------------------------
    def reset(self) -> None:
        for recorder in self.recorders.values():
            recorder.reset()

    # --- for messages ---------------------------------------------------------------------
    def _who(self, rank: int) -> str:
        shard = self.shards[rank]
        layer = "" if self.layer is None else f"layer {self.layer}, "
        return (
            f"{layer}rank {rank} of {shard.world} (kv heads {list(shard.kv_heads)}, query "
            f"heads {list(shard.query_heads)})"
        )

    def describe(self) -> str:
        return "; ".join(self._who(rank) for rank in range(len(self.shards)))


def local_spec(spec: CacheSpec, shard: Shard) -> CacheSpec:
    """What a rank's cache is built for: its kv heads, and its shard."""
    from dataclasses import replace

    return replace(spec, kv_heads=len(shard.kv_heads), shard=shard)


class _Truncates:
    def truncate(self, length: int) -> None:
        for recorder in self.recorders.values():
            recorder.truncate(length)


class _Reorders:
    def reorder(self, indices: Tensor) -> None:
        for recorder in self.recorders.values():
            recorder.reorder(indices)


class _Forks:
    def fork(self) -> ShardedCache:
        forks = {rank: recorder.fork() for rank, recorder in self.recorders.items()}
        return type(self)(self.spec, self.shards, self.ranks, forks, self.layer)


class _Moves:
    """Moves between shard counts (contract, section 11.2), with every rank in this process:
    each rank's rows out, the replicas of a kv head held to agree bit for bit, the heads put
    together by global id; in, each rank's heads sliced from them."""

    def export_rows(self) -> CacheRows:
        exported = {
            rank: self.recorders[rank].cache.export_rows() for rank in self._all_here("export_rows")
        }
        first = exported[0]
        for rank, rows in exported.items():  # every rank the same tokens, however many heads
            if (rows.length, rows.rows) != (first.length, first.rows):
                raise failures.DataLoss(
                    f"{self._who(rank)}: export_rows() gave {rows.rows} rows for a length of "
                    f"{rows.length}; {self._who(0)} gave {first.rows} for {first.length}"
                    f"\n  shards: {self.describe()}"
                )
        by_head: dict[int, tuple[int, Tensor, Tensor]] = {}
        for rank, rows in exported.items():
            for local, head in enumerate(self.shards[rank].kv_heads):
                mine = (rows.keys[:, local : local + 1], rows.values[:, local : local + 1])
                if head not in by_head:
                    by_head[head] = (rank, *mine)
                    continue
                holder, *theirs = by_head[head]
                if any(kvassert.differing_rows(a, b) for a, b in zip(mine, theirs, strict=True)):
                    raise failures.DataLoss(
                        f"kv head {head}'s replicas differ: {self._who(rank)}'s export_rows() "
                        f"is not rank {holder}'s (every rank holding a kv head must hold the "
                        f"same rows)\n  shards: {self.describe()}"
                    )
        heads = [by_head[head] for head in sorted(by_head)]
        keys = torch.cat([keys for _, keys, _ in heads], dim=1)
        values = torch.cat([values for _, _, values in heads], dim=1)
        return CacheRows(keys, values, first.length)

    def import_rows(self, rows: CacheRows) -> None:
        for rank in self._all_here("import_rows"):
            heads = list(self.shards[rank].kv_heads)
            mine = CacheRows(rows.keys[:, heads], rows.values[:, heads], rows.length)
            self.recorders[rank].cache.import_rows(mine)

    def take_history(self, other: ShardedCache) -> None:
        """What each rank was given, from the ranks of ``other``, another shard count."""
        given = other.given_by_head()
        for rank in self._all_here("take_history"):
            heads = list(self.shards[rank].kv_heads)
            mine = None if given is None else tuple(rows[:, heads] for rows in given)
            self.recorders[rank].hold_given(mine)  # codes move with them (contract, 10.1)

    def given_by_head(self) -> tuple[Tensor, Tensor] | None:
        """The rows every kv head was given since the reset, by global id (from the first
        rank that holds it); None when nothing was."""
        holder = {}
        for rank in reversed(self._all_here("given_by_head")):
            for local, head in enumerate(self.shards[rank].kv_heads):
                holder[head] = (self.recorders[rank].given, local)
        held = [holder[head] for head in sorted(holder)]
        if any(given is None for given, _ in held):
            return None
        return tuple(
            torch.cat([given[which][:, local : local + 1] for given, local in held], dim=1)
            for which in (0, 1)
        )

    def _all_here(self, call: str) -> tuple[int, ...]:
        if len(self.ranks.hosted) != self.ranks.world:
            raise TypeError(f"{call} of a sharded cache needs every rank in this process")
        return self.ranks.hosted


EVENTS = {"truncate": _Truncates, "reorder": _Reorders, "fork": _Forks, "move": _Moves}
_TYPES: dict[frozenset, type] = {}


def sharded_type(offered: set[str]) -> type:
    """A ``ShardedCache`` class offering exactly the events the ranks' caches offer (a
    capability is offered by having the method: contract, section 4)."""
    events = frozenset(EVENTS) & frozenset(offered)
    if events not in _TYPES:
        mixins = tuple(EVENTS[name] for name in sorted(events))
        _TYPES[events] = type("ShardedCache", (*mixins, ShardedCache), {})
    return _TYPES[events]


class ShardedFactory:
    """The factory a sharded engine builds its caches from: for a layer's spec (the whole
    layer's kv heads), a ``ShardedCache`` over every hosted rank's cache from ``factory``,
    each built through ``kvcheck.harness.build`` for its own spec (the domain is the ranks')."""

    builds_through_kit = True

    def __init__(
        self, factory, shards: Sequence[Shard], ranks: Ranks, path: str, layers: Sequence[int]
    ) -> None:
        # A pool of its own per rank, as each tensor-parallel rank of an engine has.
        self.factories = {
            rank: pool_books.fresh_pool(factory, POOL_BLOCKS) for rank in ranks.hosted
        }
        self.shards = tuple(shards)
        self.ranks = ranks
        self.path = path
        # The model builds its layers' caches in layer order, every layer at every start.
        self.layers = itertools.cycle(layers)
        self.__name__ = f"sharded {getattr(factory, '__name__', type(factory).__name__)}"

    def __call__(self, spec: CacheSpec) -> ShardedCache:
        recorders = {}
        for rank, factory in self.factories.items():
            local = build(factory, local_spec(spec, self.shards[rank]))
            if self.path == "attend" and not offers_attend(local):
                raise CacheContractError(f"rank {rank}'s cache has no attend()")
            recorders[rank] = Recorder(local, spec.window, self.path, spec.sinks, spec.rope_base)
        offered = capabilities(next(iter(recorders.values())).cache)
        cache = sharded_type(offered)
        return cache(spec, self.shards, self.ranks, recorders, next(self.layers))
