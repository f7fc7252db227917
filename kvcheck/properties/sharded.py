"""Tensor-parallel shards (docs/contract.md, section 11.1): each rank's caches, built from
the factory for its share of the kv heads, give together what the unsharded uncached model
gives.

A plan draws a world of 2 or 4 ranks, a model whose kv heads are fewer than (replicated),
as many as or more than the ranks, with query groups that make the shard boundary matter,
the path each rank's caches take, and a list of events on one request and its forks: feeds
in chunks, truncates, reorders, forks and resets. The session engine (``kvcheck.session``)
runs it on ``ShardedCache`` layers (``kvcheck.sharded_cache``), so every step's logits are held
to the unsharded uncached model and every rank must agree on every length.

- ``sharded``: the ranks simulated in one process; searched and shrunk like every property.
- ``sharded runtime``: the same plans on real processes, ``torch.distributed``
  (``kvcheck.rank_processes``); it does not shrink (a retry restarts the group).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import torch
from hypothesis import strategies as st

from kvcheck import devices as kvdevices
from kvcheck import failures, grammar, rank_processes, reach, scripts
from kvcheck import scope as kvscope
from kvcheck import sizes as kvsizes
from kvcheck import strategies as kvst
from kvcheck import tensors as kvtensors
from kvcheck.kit import KitTests, Property, offered, path_for, property_test
from kvcheck.plan_events import Feed, Fork, Move, Reorder, Reset, Truncate
from kvcheck.session import Engine
from kvcheck.sharded_cache import Ranks, ShardedFactory, SimulatedRanks, plan_for
from kvref import CacheFactory, ModelConfig, shard_heads
from kvref.reprs import short_repr

MOST_TOKENS = 2 * kvst.EDGE + 4
EVENTS = ("feed", "truncate", "reorder", "fork", "reset")  # of kvcheck.scripts


@short_repr
@dataclasses.dataclass(frozen=True)
class ShardedPlan:
    """A world of ranks, a model, the path each rank's caches take, a batch and a dtype, and
    a script of events (``kvcheck.scripts``)."""

    world: int
    config: ModelConfig
    path: str
    batch: int
    dtype: torch.dtype
    events: tuple[tuple, ...]
    token_seed: int
    # The world each move goes to (contract, section 11.2): move i to ``moves_to[i - 1]``.
    moves_to: tuple[int, ...] = ()

    def describe(self, path: str | None = None) -> str:
        """The plan; ``path`` the one its ranks' caches took (``path``, where they have it)."""
        model = kvst.describe_config(self.config)
        said = ", ".join(event.describe() for event in self.events)
        if self.moves_to:
            said += f" (the moves to {', '.join(f'{n} ranks' for n in self.moves_to)})"
        return (
            f"sharded plan: {self.world} ranks, each rank's caches on the {path or self.path} "
            f"path, batch {self.batch}, {kvdevices.dtype_name(self.dtype)}\n  model: {model}\n"
            f"  events: {said}"
        )

    def summary(self) -> tuple[str, str, str]:
        tokens = scripts.fed(self.events)
        heads = f"{self.config.num_kv_heads}/{self.config.num_heads} heads on {self.world}"
        return f"{tokens} ({heads})", str(self.config.num_layers), str(self.batch)


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


def fits_the_domain(config: ModelConfig, world: int) -> bool:
    """Whether every rank's caches of ``config`` over ``world`` ranks are inside the domain
    the cache declares: its kv heads and its query heads per kv head."""
    domain = kvsizes.domain()
    for shard in shard_heads(config.num_heads, config.num_kv_heads, world):
        local = len(shard.kv_heads)
        if domain.kv_heads is not None and local not in domain.kv_heads:
            return False
        if domain.refuses_group(len(shard.query_heads) // local):
            return False
    return True


@st.composite
def sharded_plans(draw, dtypes: tuple = kvst.WITH_HALF, moves: bool = True) -> ShardedPlan:
    """A plan; with ``moves``, a third of them move their request to another shard count
    and back (a model that 4 ranks can shard, which 2 can too), with no forks."""
    moved = draw(st.sampled_from((0, 0, 1, 2)), label="moves") if moves else 0
    world = draw(st.sampled_from((2, 4)), label="world")
    config = draw(sharded_configs(4 if moved else world), label="config")
    if moved and not all(fits_the_domain(config, n) for n in (2, 4)):
        # A move to the other world would build ranks' caches the cache lacks: none, on
        # the 4 ranks the model was drawn for.
        moved, world = 0, 4
    kinds = tuple(kind for kind in EVENTS if kind != "fork") if moved else EVENTS
    batch = draw(kvsizes.batches(small_max=3), label="batch")
    events = draw(scripts.events(kinds, MOST_TOKENS, batch, moves=moved), label="events")
    worlds = [world]
    for _ in range(moved):
        worlds.append(draw(st.sampled_from([n for n in (2, 4) if n != worlds[-1]]), label="to"))
    return ShardedPlan(
        world=world,
        config=config,
        path=draw(st.sampled_from(("append", "attend")), label="path"),
        batch=batch,
        dtype=draw(kvst.dtypes_on_device(dtypes), label="dtype"),
        events=events,
        token_seed=draw(st.integers(0, 2**16), label="token seed"),
        moves_to=tuple(worlds[1:]),
    )


REPLICATED_HEADS = "kv heads fewer than the ranks (replicated, query groups split)"
ONE_HEAD_EVERYWHERE = "one kv head replicated on every rank"
AS_MANY = "as many kv heads as ranks"
MORE_HEADS = "more kv heads than ranks"
TWO_RANKS = "2 ranks"
FOUR_RANKS = "4 ranks"
TO_FEWER = "move to fewer ranks"
TO_MORE = "move to more ranks"
ON_EVERY_RANK = {kind: f"{kind} on every rank" for kind in ("truncate", "reorder", "fork")}
SHARD_EDGES = (
    *(reach.Edge(name) for name in (REPLICATED_HEADS, ONE_HEAD_EVERYWHERE, AS_MANY)),
    *(reach.Edge(name) for name in (MORE_HEADS, TWO_RANKS, FOUR_RANKS)),
    *(reach.Edge(name, needs=(kind,)) for kind, name in ON_EVERY_RANK.items()),
)
MOVE_EDGES = (reach.Edge(TO_FEWER, needs=("move",)), reach.Edge(TO_MORE, needs=("move",)))


def note_layout(plan: ShardedPlan) -> None:
    """The edges of the plan's heads over its ranks."""
    kv_heads, world = plan.config.num_kv_heads, plan.world
    edges = {
        REPLICATED_HEADS: kv_heads < world,
        ONE_HEAD_EVERYWHERE: kv_heads == 1,
        AS_MANY: kv_heads == world,
        MORE_HEADS: kv_heads > world,
        TWO_RANKS: world == 2,
        FOUR_RANKS: world == 4,
    }
    reach.note(*(name for name, reached in edges.items() if reached))


def note_events(plan: ShardedPlan, offered: frozenset[str]) -> None:
    """The edges of the events the script ran on every rank: those the caches offer."""
    kinds = {scripts.kind_of(event) for event in plan.events}
    reach.note(*(name for kind, name in ON_EVERY_RANK.items() if kind in kinds & offered))


def run_sharded(
    factory: CacheFactory, plan: ShardedPlan, ranks: Callable[[int], Ranks], progress=None
) -> None:
    """The plan's events through the session engine on ``ShardedCache`` layers: every
    step's logits held to the unsharded uncached model, every rank agreeing on lengths;
    ``ranks(world)`` are the ranks of a world, ``progress(said)`` hears of each event before
    it runs."""
    config = plan.config
    path = path_for(plan.path, factory)
    shards = {}  # world -> the plan's shards there

    def sharded(world: int) -> ShardedFactory:
        shards[world] = plan_for(factory, config.num_heads, config.num_kv_heads, world)
        return ShardedFactory(factory, shards[world], ranks(world), path, config.cache_layers)

    def said() -> str:
        return "".join(
            f"\n  shards over {world}: "
            + "; ".join(
                f"rank {s.rank}: kv heads {list(s.kv_heads)}, query heads {list(s.query_heads)}"
                for s in cut
            )
            for world, cut in shards.items()
        )

    def move(request, layout: int, at: str) -> None:
        worlds = (plan.world, *plan.moves_to)
        reach.note(TO_FEWER if worlds[layout] < worlds[layout - 1] else TO_MORE)
        engine.move(request, sharded(plan.moves_to[layout - 1]), path="attend", at=at)

    engine = Engine(
        sharded(plan.world),
        kvtensors.build_model(config, plan.dtype),
        max_length=MOST_TOKENS + 1,
        path="attend",
        describe=lambda: plan.describe(path) + said(),
    )
    # Every rank computes the same logits from the gathered outputs: one rank compares them
    # with the uncached model; each checks its own caches' rows and lengths.
    engine.judges_logits = 0 in engine.factory.ranks.hosted
    scripts.play(engine, plan.events, plan.batch, plan.token_seed, move=move, progress=progress)


def check_sharded(factory: CacheFactory, plan: ShardedPlan) -> None:
    """Every rank simulated in this process."""
    run_sharded(factory, plan, SimulatedRanks)
    note_plan(factory, plan)


def check_sharded_runtime(factory: CacheFactory, plan: ShardedPlan) -> None:
    """Every rank a process of its own, in a ``torch.distributed`` group."""
    rank_processes.run_on_processes(run_sharded, factory, plan)
    note_plan(factory, plan)  # here: the ranks' own notes stay in their processes


def note_plan(factory: CacheFactory, plan: ShardedPlan) -> None:
    """The edges a plan that ran reached: its heads over its ranks, and the events of its
    script that the caches offer (those ``kvcheck.scripts.play`` ran on every rank)."""
    note_layout(plan)
    note_events(plan, frozenset(offered(factory)))


# Tried first on every run: two kv heads replicated over four ranks, each rank computing
# two of a kv head's four query heads (the layout where a group split from its kv head
# hides), a prefill, a decode, a truncate and a reset; on the attend path where the cache
# offers it (else append: the drawn plans take each path half the time).
REPLICATED = ShardedPlan(
    world=4,
    config=ModelConfig(vocab_size=23, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=4),
    path="attend",
    batch=2,
    dtype=torch.float64,
    events=(Feed(0, 5), Feed(0, 1), Truncate(0, 2), Feed(0, 2), Reset(0)),
    token_seed=3,
)

# And where the caches move: the same model's request moved from 4 ranks to 2 and back,
# each move between its decodes (disaggregated prefill on one shard count, decode on another).
RESHARDED = dataclasses.replace(
    REPLICATED,
    path="append",
    events=(Feed(0, 5), Move(0, 1), Feed(0, 1), Move(0, 2), Feed(0, 2)),
    moves_to=(2, 4),
)


# Each other layout of heads over ranks, on 2 ranks: one kv head on both, as many kv heads
# as ranks, more. Pinned, so that every run reaches each layout the properties name
# (--kv-require-reach), whatever the seed: the runtime draws a tenth of the examples, too few
# to meet each of three layouts by chance.
LAYOUTS_ON_TWO = tuple(
    ShardedPlan(
        world=2,
        config=ModelConfig(
            vocab_size=11, num_layers=1, num_heads=2 * kv_heads, num_kv_heads=kv_heads, head_dim=2
        ),
        path="append",
        batch=1,
        dtype=torch.float64,
        events=(Feed(0, 3), Feed(0, 1)),
        token_seed=kv_heads,
    )
    for kv_heads in (1, 2, 4)
)


# --- Every plan within a scope (kvcheck.scope), for the bounded-exhaustive mode ---
def every_script(
    tokens: int, kinds: tuple[str, ...], batch: int, requests: int = 1
) -> Iterator[tuple[scripts.Event, ...]]:
    """Every script (``kvcheck.scripts``) that feeds exactly ``tokens`` tokens in all (over
    every request), in which an edit follows a feed (never another edit: each edit is read by
    the feed after it before the next), on a request that holds tokens: a truncate by each of
    1..held, a reorder by each index tuple of the batch, a reset, a fork (while fewer than
    ``requests`` requests live; events after it on either request); the first event a feed
    of r0, the last a feed, two feeds at least (a decode after the prefill, as the
    strategy's scripts). Of ``kinds``, those beside "feed" are the edits."""
    edits = [kind for kind in kinds if kind != "feed"]

    def moves(state, left: int):
        held, after_feed, events = state
        for request in range(len(held)):  # r0 first: it alone lives then
            # The first feed leaves a token for the feed after it at least.
            for size in range(1, left + 1 if events else left):
                fed = (*held[:request], held[request] + size, *held[request + 1 :])
                yield (Feed(request, size),), (fed, True, events + 1), size
        if not after_feed or not left:
            return  # an edit follows a feed, and a feed follows it
        for request, length in enumerate(held):
            if not length:
                continue
            for kind in edits:
                if kind == "truncate":
                    for back in range(1, length + 1):
                        cut = (*held[:request], length - back, *held[request + 1 :])
                        yield (Truncate(request, back),), (cut, False, events + 1), 0
                elif kind == "reorder":
                    for indices in kvscope.every_indices(batch):
                        yield (Reorder(request, indices),), (held, False, events + 1), 0
                elif kind == "reset":
                    gone = (*held[:request], 0, *held[request + 1 :])
                    yield (Reset(request),), (gone, False, events + 1), 0
                elif kind == "fork" and len(held) < requests:
                    fork = Fork(request, len(held))
                    yield (fork,), ((*held, length), False, events + 1), 0

    def ends(state) -> bool:
        _, after_feed, events = state
        return after_feed and events > 1

    return grammar.sentences(tokens, ((0,), False, 0), moves, ends)


def shardable(layout: kvscope.Layout, world: int) -> kvscope.Layout | None:
    """``layout`` with its query heads made as many as ``world`` ranks can shard (kv heads
    fewer than the ranks: each group a multiple of the replicas, rounded up; as many or
    more: a multiple of the ranks), or None where its kv heads cannot be (more, not a
    multiple)."""
    kv_heads, group = layout.kv_heads, layout.heads // layout.kv_heads
    if kv_heads < world:
        if world % kv_heads:
            return None
        replicas = world // kv_heads
        group = -(-group // replicas) * replicas
    elif kv_heads % world:
        return None
    return dataclasses.replace(layout, heads=kv_heads * group, why="")


def every_shard_layout(scope: kvscope.Scope) -> Iterator[tuple[int, kvscope.Layout]]:
    """Each (world of 2 or 4 ranks, layout of the scope made shardable there, ``shardable``)
    inside the domain, each once (layouts that differ only by why they are there are one)."""
    seen = set()
    for layout in scope.layouts:
        for world in (2, 4):
            made = shardable(layout, world)
            if made is None or (world, made) in seen:
                continue
            seen.add((world, made))
            if fits_the_domain(made.config(), world):
                yield world, made


def every_sharded_plan(
    scope: kvscope.Scope, kinds: tuple[str, ...] = EVENTS
) -> Iterator[ShardedPlan]:
    """Every script (``every_script``: feeds in every split, truncates by every count, a
    reorder by every index tuple, resets, forks up to ``scope.requests`` requests) of 1 to
    ``scope.tokens`` tokens fed in all, on every (world, layout) of ``every_shard_layout``.
    Fixed, and why: the append path (the attend path is the search's: the ranks' caches
    take it where offered, and it doubles every plan), no moves between worlds (each needs
    a model both worlds can shard and multiplies the plans by the moments: the search and
    the pinned ``RESHARDED`` move), seed 0."""
    for tokens in range(2, scope.tokens + 1):
        for world, layout in every_shard_layout(scope):
            config = layout.config()
            for events in every_script(tokens, kinds, layout.batch, scope.requests):
                yield ShardedPlan(
                    world=world,
                    config=config,
                    path="append",
                    batch=layout.batch,
                    dtype=scope.dtype,
                    events=events,
                    token_seed=0,
                )


RUNTIME_TOKENS = 3  # a plan runs on every process: its enumeration ends sooner


def every_sharded_runtime_plan(scope: kvscope.Scope) -> Iterator[ShardedPlan]:
    """``every_sharded_plan`` of the scope's dtype where the runtime judges it (float64 or
    float32), each run on the processes of a torch.distributed group: the same plans, the
    default tokens kept small (``RUNTIME_TOKENS``); in a half-precision scope, float32 (the
    runtime judges float64 and float32 alone: ``SHARDED_RUNTIME.dtypes``)."""
    if scope.dtype not in kvst.DTYPES:
        scope = dataclasses.replace(scope, dtype=torch.float32)
    yield from every_sharded_plan(scope)


SHARDED = Property(
    "sharded",
    "kv heads sharded over tensor-parallel ranks (replicated where fewer) give, together, "
    "the unsharded uncached model's logits through every event",
    check_sharded,
    sharded_plans(),
    failures.WRONG_RESULTS,
    pinned=(REPLICATED, RESHARDED, *LAYOUTS_ON_TWO),
    reaches=SHARD_EDGES + MOVE_EDGES,
    since="1.5",
    every_plan=every_sharded_plan,
    exhaustive_tokens=3,
    holds=(
        "each layer's kv heads over 2 or 4 ranks simulated in one process (fewer kv heads than "
        "ranks: replicated), each rank's caches from the factory for its shard: feeds, truncates, "
        "reorders, forks, resets and moves between shard counts reach every rank, the ranks agree "
        "on every length and the logits equal the unsharded uncached model's (contract, section "
        "11.1; every cache; [distributed.md](distributed.md))"
    ),
)


SHARDED_RUNTIME = Property(
    "sharded runtime",
    "the same, each rank a process of its own in a torch.distributed group (gloo), a hung "
    "rank a failure",
    check_sharded_runtime,
    sharded_plans(kvst.DTYPES, moves=False),  # a move needs every rank in one process
    failures.WRONG_RESULTS,
    pinned=(REPLICATED, *LAYOUTS_ON_TWO),
    # Its few examples run the plans `sharded` searches in full, on processes: it names the
    # layouts and the truncate of its pinned plans, not every event of those plans.
    reaches=tuple(edge for edge in SHARD_EDGES if edge.needs not in (("reorder",), ("fork",))),
    examples_share=0.1,  # each plan runs on every process; `sharded` searches the same plans
    dtypes=kvst.DTYPES,  # on the CPU, where half precision is slow and adds nothing here
    attend_dtypes=kvst.DTYPES,
    context=rank_processes.serving,
    shrinks=False,
    since="1.5",
    every_plan=every_sharded_runtime_plan,
    exhaustive_tokens=RUNTIME_TOKENS,
    holds=(
        "the same plans, without moves, on 4 forked processes in a gloo group on 127.0.0.1 (one "
        "group per pytest process), a tenth of the examples and no shrinking; a rank that hangs "
        "past 60 s fails, named with its last event (every cache)"
    ),
)


class ShardedTests(KitTests):
    """Tensor-parallel shards of every layer: every cache runs it."""

    test_sharded_ranks_equal_the_unsharded_model = property_test(SHARDED)
    test_sharded_ranks_on_processes_equal_the_unsharded_model = property_test(SHARDED_RUNTIME)
