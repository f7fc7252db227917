"""Tensor-parallel shards (docs/contract.md, section 11.1): each rank's caches, built from
the factory for its share of the kv heads, give together what the unsharded uncached model
gives.

A plan draws a world of 2 or 4 ranks, a model whose kv heads are fewer than (replicated),
as many as or more than the ranks, with query groups that make the shard boundary matter,
the path each rank's caches take, and a list of events on one request and its forks: feeds
in chunks, truncates, reorders, forks and resets. The session engine (``kvcheck.session``)
runs it on ``ShardedCache`` layers (``kvcheck.sharding``), so every step's logits are held
to the unsharded uncached model and every rank must agree on every length.

- ``sharded``: the ranks simulated in one process; searched and shrunk like every property.
- ``sharded runtime``: the same plans on real processes, ``torch.distributed``
  (``kvcheck.distributed``); it does not shrink (a retry restarts the group).
"""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import strategies as st

from kvcheck import devices as kvdevices
from kvcheck import distributed as kvdistributed
from kvcheck import failures
from kvcheck import sizes as kvsizes
from kvcheck import strategies as kvst
from kvcheck.kit import KitTests, Property, path_for, property_test
from kvcheck.session import Engine
from kvcheck.sharding import Ranks, ShardedFactory, SimulatedRanks, plan_for
from kvref import CacheFactory, ModelConfig

MOST_TOKENS = 2 * kvst.EDGE + 4
EVENTS = ("feed", "truncate", "reorder", "fork", "reset")


@dataclasses.dataclass(frozen=True)
class ShardedPlan:
    """A world of ranks, a model, the path each rank's caches take, a batch and a dtype, and
    events: ("feed", request, tokens), ("truncate", request, back), ("reorder", request,
    seed), ("fork", request), ("reset", request); request i is the i-th started (0 the
    first, each fork the next)."""

    world: int
    config: ModelConfig
    path: str
    batch: int
    dtype: torch.dtype
    events: tuple[tuple, ...]
    token_seed: int

    def describe(self) -> str:
        model = kvst.describe_config(self.config)
        said = ", ".join(_event_said(event) for event in self.events)
        return (
            f"sharded plan: {self.world} ranks, each rank's caches on the {self.path} path, "
            f"batch {self.batch}, {kvdevices.dtype_name(self.dtype)}\n  model: {model}\n"
            f"  events: {said}"
        )

    def summary(self) -> tuple[str, str, str]:
        tokens = sum(event[2] for event in self.events if event[0] == "feed")
        heads = f"{self.config.num_kv_heads}/{self.config.num_heads} heads on {self.world}"
        return f"{tokens} ({heads})", str(self.config.num_layers), str(self.batch)


def _event_said(event: tuple) -> str:
    kind, request, *rest = event
    on = "request A" if request == 0 else f"fork {request}"
    if kind == "feed":
        return f"feed {rest[0]} to {on}"
    if kind == "truncate":
        return f"truncate {on} by {rest[0]}"
    return f"{kind} {on}"


@st.composite
def sharded_configs(draw, world: int) -> ModelConfig:
    """A model that ``world`` ranks can shard: kv heads fewer than the ranks (each kv head
    replicated, its query group split), as many, or more; query heads per rank within the
    sizes the kit draws (and the cache's declared domain, rank by rank)."""
    layout = draw(st.sampled_from(("fewer", "as many", "more")), label="kv heads vs ranks")
    if (
        layout == "fewer"
        and kvsizes.domain().kv_heads not in (None,)
        and (1 not in kvsizes.domain().kv_heads)
    ):
        layout = "more"  # a replicated rank holds one kv head, which the cache does not support
    if layout == "fewer":
        kv_heads = draw(st.sampled_from([n for n in (1, 2) if n < world]), label="kv_heads")
        replicas = world // kv_heads
        group = replicas * draw(kvsizes.groups(room=4), label="query heads per rank")
    else:
        local = 1 if layout == "as many" else draw(kvsizes.kv_head_counts(2), label="per rank")
        if (supported := kvsizes.domain().kv_heads) is not None and local not in supported:
            local = supported[0]
        kv_heads = local * world
        group = draw(kvsizes.groups(room=3), label="heads per kv head")
    head_dim = draw(kvsizes.head_dims(room=32), label="head_dim")
    fields = draw(kvst.any_attention(st.integers(1, 2)), label="model")
    return ModelConfig(
        **fields, num_heads=kv_heads * group, num_kv_heads=kv_heads, head_dim=head_dim
    )


@st.composite
def sharded_plans(draw, dtypes: tuple = kvst.WITH_HALF) -> ShardedPlan:
    world = draw(st.sampled_from((2, 4)), label="world")
    config = draw(sharded_configs(world), label="config")
    events, held, requests = [], [0], 1
    for _ in range(draw(st.integers(1, 7), label="events")):
        request = draw(st.integers(0, requests - 1), label="on request")
        kind = draw(st.sampled_from(EVENTS), label="event") if held[request] else "feed"
        if kind == "feed":
            room = MOST_TOKENS - held[request]
            if room < 1:
                continue
            tokens = draw(st.integers(1, min(room, 2 * kvst.EDGE + 1)), label="tokens")
            events.append(("feed", request, tokens))
            held[request] += tokens
        elif kind == "truncate":
            back = draw(st.integers(1, held[request]), label="truncate by")
            events.append(("truncate", request, back))
            held[request] -= back
        elif kind == "reorder":
            events.append(("reorder", request, draw(st.integers(0, 2**16), label="seed")))
        elif kind == "fork":
            events.append(("fork", request))
            held.append(held[request])
            requests += 1
        else:
            events.append(("reset", request))
            held[request] = 0
    if not any(event[0] == "feed" for event in events[1:]):  # a decode after the prefill
        events.append(("feed", 0, 1))
    return ShardedPlan(
        world=world,
        config=config,
        path=draw(st.sampled_from(("append", "attend")), label="path"),
        batch=draw(kvsizes.batches(small_max=3), label="batch"),
        dtype=draw(kvst.dtypes_on_device(dtypes), label="dtype"),
        events=tuple(events),
        token_seed=draw(st.integers(0, 2**16), label="token seed"),
    )


def run_sharded(factory: CacheFactory, plan: ShardedPlan, ranks: Ranks, progress=None) -> None:
    """The plan's events through the session engine on ``ShardedCache`` layers: every
    step's logits held to the unsharded uncached model, every rank agreeing on lengths;
    ``progress(said)`` hears of each event before it runs."""
    config = plan.config
    shards = plan_for(factory, config.num_heads, config.num_kv_heads, plan.world)
    path = path_for(plan.path, factory)
    sharded = ShardedFactory(factory, shards, ranks, path)
    model = kvst.build_model(config, plan.dtype)
    most = MOST_TOKENS + 1
    said = "; ".join(
        f"rank {s.rank}: kv heads {list(s.kv_heads)}, query heads {list(s.query_heads)}"
        for s in shards
    )
    engine = Engine(
        sharded,
        model,
        max_length=most,
        path="attend",
        describe=lambda: f"{plan.describe()}\n  shards: {said}",
    )
    generator = torch.Generator().manual_seed(plan.token_seed)
    requests = [engine.start("request A", plan.batch)]
    for step, event in enumerate(plan.events):
        kind, index, *rest = event
        request = requests[index]
        at = f" (event #{step}: {_event_said(event)})"
        if progress is not None:
            progress(f"event #{step}: {_event_said(event)}")
        if kind == "feed":
            new = torch.randint(0, config.vocab_size, (plan.batch, rest[0]), generator=generator)
            engine.feed(request, new.to(kvdevices.current()), at=at)
        elif kind == "truncate" and "truncate" in request.offered:
            engine.truncate(request, request.held - rest[0], at=at)
        elif kind == "reorder" and "reorder" in request.offered:
            order = torch.Generator().manual_seed(rest[0])
            indices = torch.randint(0, plan.batch, (plan.batch,), generator=order)
            engine.reorder(request, indices.to(kvdevices.current()), at=at)
        elif kind == "fork":
            requests.append(engine.fork(request, f"fork {len(requests)}", at=at))
        elif kind == "reset":
            engine.reset(request)
        elif kind in ("truncate", "reorder"):  # not offered: the rest of the plan still runs
            continue
        engine.check(f"event #{step}: {_event_said(event)}")
    engine.finish(blocks_back=False)


def check_sharded(factory: CacheFactory, plan: ShardedPlan) -> None:
    """Every rank simulated in this process."""
    run_sharded(factory, plan, SimulatedRanks(plan.world))


def check_sharded_runtime(factory: CacheFactory, plan: ShardedPlan) -> None:
    """Every rank a process of its own, in a ``torch.distributed`` group."""
    kvdistributed.run_on_processes(factory, plan)


# Tried first on every run: two kv heads replicated over four ranks, each rank computing
# two of a kv head's four query heads (the layout where a group split from its kv head
# hides), a prefill, a decode, a truncate and a reset.
REPLICATED = ShardedPlan(
    world=4,
    config=ModelConfig(vocab_size=23, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=4),
    path="append",
    batch=2,
    dtype=torch.float64,
    events=(("feed", 0, 5), ("feed", 0, 1), ("truncate", 0, 2), ("feed", 0, 2), ("reset", 0)),
    token_seed=3,
)

SHARDED = Property(
    "sharded",
    "kv heads sharded over tensor-parallel ranks (replicated where fewer) give, together, "
    "the unsharded uncached model's logits through every event",
    check_sharded,
    sharded_plans(),
    failures.WRONG_RESULTS,
    pinned=(REPLICATED, dataclasses.replace(REPLICATED, path="attend")),
)


SHARDED_RUNTIME = Property(
    "sharded runtime",
    "the same, each rank a process of its own in a torch.distributed group (gloo), a hung "
    "rank a failure",
    check_sharded_runtime,
    sharded_plans(kvst.DTYPES),
    failures.WRONG_RESULTS,
    pinned=(REPLICATED,),
    examples_share=0.1,  # each plan runs on every process; `sharded` searches the same plans
    dtypes=kvst.DTYPES,  # on the CPU, where half precision is slow and adds nothing here
    attend_dtypes=kvst.DTYPES,
    context=kvdistributed.serving,
    shrinks=False,
)


class ShardedTests(KitTests):
    """Tensor-parallel shards of every layer: every cache runs it."""

    test_sharded_ranks_equal_the_unsharded_model = property_test(SHARDED)
    test_sharded_ranks_on_processes_equal_the_unsharded_model = property_test(SHARDED_RUNTIME)
