"""Interactions: every pair of events a cache offers, run by construction (contract 14).

A random search reaches a pair of events in a particular state only as often as its draws
happen to put them together, and so a bug where two events meet (a truncate that ends on a
page boundary, then a decode; a fork, then a write to the parent) can survive every seed but
one. Here the plans are not drawn: ``kvcheck.interplay.covering_walks`` builds, for the
capabilities the cache offers, walks that run every offered pair ``A → [s] → B`` at least
once, and each walk runs on the session engine, whose checks after every event (the logits
of every feed against the uncached model over the whole history, every row returned, the
lengths, the views, a pool's books) judge it. Each feed brings new tokens, so that rows a
truncate or a reset should have dropped differ from the ones that replace them.

The verdict reports which offered pairs ran in a passing test of any property
(``interactions: M of N pairs ran``); this property makes N of N the floor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from kvcheck import failures, interplay
from kvcheck import scope as kvscope
from kvcheck import sizes as kvsizes
from kvcheck import strategies as kvst
from kvcheck import tensors as kvtensors
from kvcheck.kit import KitTests, Property, offered, probe_spec, property_test
from kvcheck.plan_events import (
    Feed,
    FeedRows,
    Fork,
    Join,
    Reorder,
    Reset,
    ResetAt,
    SelectRows,
    Shift,
    ShiftRows,
    TruncateRows,
    TruncateTo,
)
from kvcheck.properties.rows import RowEvent, RowsRun, token_source
from kvcheck.session import Engine, Request
from kvref import CacheFactory, ModelConfig
from kvref.reprs import short_repr

# The capabilities and methods a walk's events call (kvcheck.interplay.KINDS).
CALLED = frozenset(kind.needs for kind in interplay.KINDS if kind.needs is not None)


def events_offered(factory: CacheFactory) -> frozenset[str]:
    """Of what the walks' events call, what ``factory``'s caches offer: the capabilities
    ``kit.offered`` names and the methods of rows of their own (``join``, ``reset_at``...),
    asked of a probe cache itself (an adapter may offer them through ``__getattr__``)."""
    probe = factory(probe_spec())
    # append_rows is a capability (it needs row_lengths too), the others methods alone.
    methods = {name for name in CALLED - {"append_rows"} if callable(getattr(probe, name, None))}
    return frozenset((offered(factory, probe) | methods) & CALLED)


def rows_built() -> int:
    """The rows a batch with rows of their own starts with in the walks: three, where the
    declared domain allows (two leave and two requests join in turn), else its largest."""
    return min(interplay.ROWS_BUILT, kvsizes.domain().max_batch or interplay.ROWS_BUILT)


def pairs_offered(factory: CacheFactory) -> list[str]:
    """Every pair of events ``factory``'s caches offer, in the declared domain (the
    verdict's N)."""
    return interplay.offered_pairs(events_offered(factory), rows_built())


def walks_for(factory: CacheFactory) -> tuple[tuple[tuple[interplay.Step, ...], ...], int, int]:
    """The covering walks for ``factory``'s caches, the tokens they are built for and their
    page: pages of the page the cache declares (16 rows otherwise), two of them and five
    tokens more, so that every state is a few tokens from every other."""
    page = interplay.page_of(kvsizes.current().page)
    most = 2 * page + 5
    events = events_offered(factory)
    return interplay.covering_walks(events, most, page, batch=rows_built()), most, page


def model_for_the_walks() -> tuple[ModelConfig, torch.dtype, int]:
    """The smallest model and batch inside the cache's declared domain: two layers (a bug
    of one layer's bookkeeping shows against the other's), a batch of two where it may (a
    reorder moves rows), the first dtype judged to a tolerance."""
    domain = kvsizes.domain()
    head_dim = domain.head_dims[0] if domain.head_dims else 4
    kv_heads = domain.kv_heads[0] if domain.kv_heads else 1
    group = domain.groups[0] if domain.groups else 2
    config = ModelConfig(
        vocab_size=13,
        num_layers=2,
        num_heads=kv_heads * group,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        ffn_dim=16,
    )
    batch = min(2, domain.max_batch or 2)
    return config, kvst.supported_dtypes(kvst.WITH_HALF)[0], batch


@short_repr
@dataclass(frozen=True)
class Walk:
    """A walk of the exhaustive mode (``kvcheck.interplay.every_walk``): a model of the
    scope, its batch, caches built for ``tokens`` tokens, and the events from empty caches."""

    config: ModelConfig
    batch: int
    dtype: torch.dtype
    tokens: int
    steps: tuple[interplay.Step, ...]

    def describe(self) -> str:
        events = ", ".join(step.describe() for step in self.steps)
        return (
            f"{events} (caches built for {self.tokens} tokens; "
            f"{kvst.describe_config(self.config)}, batch {self.batch})"
        )

    def summary(self) -> tuple[str, str, str]:
        events = ", ".join(step.describe() for step in self.steps)
        weight = interplay.walk_weight(self.steps)
        return f"{weight} ({events})", str(self.config.num_layers), str(self.batch)


def every_walk_plan(scope: kvscope.Scope) -> Iterator[Walk]:
    """Every walk of the grammar (``kvcheck.interplay.every_walk``) to ``scope.tokens``, on
    each model of the scope, fewest tokens first: a cache runs those of the events it offers,
    and counts the others apart (``NotOffered``). Per model, of the events every cache runs,
    P(N + 1) - 1 walks (P the Pell numbers); of every event, a count the test of it holds to
    a recurrence."""
    plans = [
        Walk(layout.config(), layout.batch, scope.dtype, scope.tokens, steps)
        for layout in scope.layouts
        for steps in interplay.every_walk(CALLED, scope.tokens, layout.batch)
    ]
    yield from sorted(plans, key=lambda walk: interplay.walk_weight(walk.steps))


def check_every_offered_pair(
    factory: CacheFactory,
    walk: Walk | None = None,
    *,
    examples_scale: float = 1.0,
    path: str = "append",
) -> None:
    """Run the walks that cover every pair of events the cache offers (or, in the exhaustive
    mode, the one ``walk``); the engine judges every event of them."""
    if walk is not None:
        run_exhaustive_walk(factory, walk, path)
        return
    walks, most, page = walks_for(factory)
    config, dtype, batch = model_for_the_walks()
    model = kvtensors.build_model(config, dtype)

    def run(walk, name: str, done: list[str]) -> None:
        if walk[0].rows is not None:  # rows of their own, on a batch of their own
            run_rows_walk(factory, model, walk, most, rows_built(), path, name, done)
        else:
            run_walk(factory, model, walk, most, batch, path, name, done)

    for number, walk in enumerate(walks):
        name, done = f"walk {number + 1} of {len(walks)}", []
        try:
            run(walk, name, done)
        except failures.OutsideDomain:
            raise
        except Exception as error:
            # A covering walk is long: the failure is told on the fewest events from empty
            # caches to the pair it failed at, where those fail too.
            pairs = list(interplay.pairs_of(walk[: len(done)]))
            events = events_offered(factory)
            smaller = pairs and interplay.fewest_steps_to(
                pairs[-1], events, most, page, rows_built()
            )
            if not smaller or len(smaller) >= len(done):
                raise
            try:
                run(smaller, "the fewest events to the same pair", [])
            except Exception as again:
                again.add_note(
                    f"  found by interactions {name} at its step #{len(done) - 1} "
                    f"(pair {pairs[-1]}); these are the fewest events from empty caches to "
                    "that pair, and they fail too"
                )
                raise again from error
            raise


def run_exhaustive_walk(factory: CacheFactory, walk: Walk, path: str) -> None:
    needs = {interplay.BY_NAME[step.kind].needs for step in walk.steps} - {None}
    by_row = walk.steps[0].rows is not None
    if by_row:  # every event on rows of their own feeds them so
        needs.add("append_rows")
    if missing := sorted(needs - events_offered(factory)):
        raise failures.NotOffered(f"the walk calls {', '.join(missing)}")
    model = kvtensors.build_model(walk.config, walk.dtype)
    run = run_rows_walk if by_row else run_walk
    run(factory, model, walk.steps, walk.tokens, walk.batch, path, "exhaustive walk")


def walk_engine(factory, model, most: int, path: str, said: Callable[[], str]) -> Engine:
    """The engine a walk runs on, caches built for ``most`` tokens: a failure says
    ``said()``, the walk and its events so far."""
    return Engine(
        factory, model, max_length=most, path=path, describe=lambda: f"interactions {said()}"
    )


def run_walk(factory, model, walk, most: int, batch: int, path: str, name: str, done=None) -> None:
    """A walk of events on a batch fed as one; ``done`` (a list) gets the events as they
    start, which a failure names."""
    done = [] if done is None else done
    engine = walk_engine(factory, model, most, path, lambda: f"{name}: {', '.join(done)}")
    request = engine.start("r0", batch)
    forks: list[Request] = []
    tokens = 0  # every feed brings new tokens: the seed of the next ones
    for index, step in enumerate(walk):
        done.append(step.describe())
        event = batch_event(step, request.held, index, batch, len(forks))
        if isinstance(event, Feed):
            tokens += 1
            new = kvtensors.random_tokens(model.config, batch, event.size, tokens)
            engine.play(request, event, new=new)
        elif event is not None:
            ran = engine.play(request, event)  # the walk's events are all offered
            if not ran and isinstance(event, TruncateTo | Shift):
                break  # a window refused as it may: the rest was planned for what it would leave
            if isinstance(event, Fork):
                forks.append(engine.live[f"r{event.child}"])
        elif step.kind == interplay.TREE:
            tokens += 1
            new = kvtensors.random_tokens(model.config, batch, 3, tokens)
            draft_and_commit(engine, request, new, step.length - request.held)
        elif step.kind == "offload and restore":
            engine.offload(request)
            engine.restore(request)
        elif step.kind == "move":
            tokens = settle(engine, forks, tokens)  # a move takes a request alone (11.2)
            engine.move(request, factory, path=path)
        engine.check(f"step #{index}, {step.describe()}")
    tokens = settle(engine, forks, tokens)
    if 0 < request.held < most:  # what the last event left is read back
        new = kvtensors.random_tokens(model.config, batch, 1, tokens + 1)
        engine.feed(request, new, at=" (the walk's last feed)")
    engine.finish()


def batch_event(step: interplay.Step, held: int, index: int, batch: int, forks: int):
    """``step`` of a walk on a batch fed as one as the plan event ``Engine.play`` runs on
    ``r0``, which holds ``held`` tokens before it (``forks`` of it made so far); None for the
    walk's own (a tree, an offload and restore, a move)."""
    if step.kind in interplay.FEEDS:
        return Feed(0, step.length - held)
    if step.kind == "reset":
        return Reset(0)
    if step.kind == "truncate":
        return TruncateTo(0, step.length)
    if step.kind == "shift":
        # The span discarded alternates between the head and the middle: every later key
        # moves (keys kept before it too, in the middle).
        start = step.start if step.start is not None else step.length // 2 * (index % 2)
        return Shift(0, start, held - step.length)
    if step.kind == "reorder":
        # Reversed, then every row the last one's: a repeat shares a row two ways.
        order = list(range(batch))[::-1] if index % 2 else [batch - 1] * batch
        return Reorder(0, tuple(step.order if step.order is not None else order))
    if step.kind == "fork":
        return Fork(0, forks + 1)
    return None


def run_rows_walk(
    factory, model, walk, most: int, batch: int, path: str, name: str, done=None
) -> None:
    """A walk of events on rows of their own (contract, section 8), run as every plan of rows
    of their own is (``kvcheck.properties.rows.RowsRun``): pads of each poison in turn, a
    request of one row joining at a position of its own, every row restarting at positions
    of their own (7 apart, every other time past ``most``); ``done`` as ``run_walk``'s."""
    done = [] if done is None else done
    engine = walk_engine(factory, model, most, path, lambda: f"{name}: {', '.join(done)}")
    pads = sorted(kvtensors.POISON_VALUES)
    run = RowsRun(engine, engine.start("r0", batch), token_source(model.config, 0), pads[0])
    for index, step in enumerate(walk):
        done.append(step.describe())
        run.pad = pads[index % len(pads)]
        event = row_event(step, run.batch.row_lengths(), index, most)
        if not run.event(event, f" (step #{index})"):
            break  # a window refused as it may: the rest was planned for the rows it would leave
        engine.check(f"step #{index}, {step.describe()}")
    # What the last event left is read back: a token for every row with room.
    if any(held < most for held in run.batch.row_lengths()):
        counts = tuple(int(held < most) for held in run.batch.row_lengths())
        run.event(FeedRows(counts), " (the walk's last feed)")
    engine.finish()


def row_event(step: interplay.Step, held: list[int], index: int, most: int) -> RowEvent:
    """``step`` of a walk on rows of their own as the plan event ``RowsRun`` runs, the rows
    holding ``held`` tokens each before it."""
    left = step.rows
    if step.kind == "feed rows":
        return FeedRows(tuple(n - h for n, h in zip(left, held, strict=True)))
    if step.kind == "truncate rows":
        return TruncateRows(left)
    if step.kind == "select rows":
        return SelectRows(step.order)
    if step.kind == "shift rows":
        return ShiftRows(step.starts, tuple(h - n for n, h in zip(left, held, strict=True)))
    if step.kind == "join":
        return Join(((left[-1], 3 * index),))
    if step.kind == "reset rows":
        return ResetAt(tuple(most * (index % 2) + 7 * row for row in range(len(left))))
    raise ValueError(f"{step.kind!r} is no event on rows of their own")


def settle(engine: Engine, forks: list[Request], tokens: int) -> int:
    """Each fork fed a token where it has room (it holds its own history still, whatever
    its parent did since), then dropped; the seed of the next tokens."""
    for fork in forks:
        if 0 < fork.held < engine.max_length:
            tokens += 1
            new = kvtensors.random_tokens(engine.model.config, fork.batch, 1, tokens)
            engine.feed(fork, new, at=" (fork)")
        engine.drop(fork)
    forks.clear()
    return tokens


def draft_and_commit(engine: Engine, request: Request, new: torch.Tensor, depth: int) -> None:
    """A draft tree of a root and its two children (tokens ``new``), each row committing
    the root, and at ``depth`` 2 a child of its own: paths of one length down different
    branches."""
    batch = new.shape[0]
    accepted = tuple((0, 1 + row % 2)[:depth] for row in range(batch))
    label = "a tree of parents [-1, 0, 0]"
    nothing = tuple(() for _ in range(batch))
    handed = engine.draft_tree(
        request, (-1, 0, 0), new, poisoned=nothing, poison=0.0, accepted=accepted, label=label
    )
    engine.commit_tree(request, handed, new, accepted, label=label)


INTERACTIONS = Property(
    name="interactions",
    title="every pair of events the cache offers, each in every state it can leave, runs as "
    "the uncached model does",
    check=check_every_offered_pair,
    strategy=None,  # not drawn: built per cache (kvcheck.interplay.covering_walks)
    every_plan=every_walk_plan,
    exhaustive_tokens=4,
    severity=failures.WRONG_RESULTS,
    paths=True,
    since="1.8",
    holds="Walks that run every offered pair `A → [s] → B` of prefill, decode, chunk, reset "
    "and the capabilities truncate, shift, tree drafts, reorder, fork, offload and move (each pair "
    "at least once, state `s` one of empty, warm, page edge, full), on two layers and a "
    "batch of two; the "
    "engine judges every event; docs/interactions.md lists the pairs and those the contract "
    "rules out.",
)


class InteractionTests(KitTests):
    """Every pair of events the cache offers, by construction."""

    test_every_offered_pair_of_events = property_test(INTERACTIONS)
