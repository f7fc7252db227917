"""Edits: truncate (speculative decoding, regenerate) and reorder (beam search).

An ``EditPlan`` is a prompt, then steps that append, roll back (once, or twice back to
back), rewind, reorder or fork the caches; after each, the caches must behave exactly as if
they had only been given the history that remains: the uncached model on that history is
the oracle, step after step, on the session engine. A window cache may refuse a truncate
only where the contract allows it (``kvref.may_refuse_truncate``).

The bad-argument tables for ``truncate`` and ``reorder`` are in ``kvcheck.badinput``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from kvcheck import badinput as kvbad
from kvcheck import failures, grammar, reach
from kvcheck import scope as kvscope
from kvcheck import sizes as kvsizes
from kvcheck import strategies as kvst
from kvcheck import tensors as kvtensors
from kvcheck.devices import dtype_name
from kvcheck.harness import PATHS
from kvcheck.kit import KitTests, Property, on_both_paths, path_for, property_test
from kvcheck.plan_events import Feed, Reorder, Truncate, TruncateTo, reorder_indices
from kvcheck.properties.rejection import STATE_EDGES, check_refused, every_refusal
from kvcheck.session import Engine
from kvcheck.strategies import (
    DTYPES,
    EDGE,
    MAX_SESSION,
    attention_room,
    chunk_sizes,
    describe_config,
    dtypes_on_device,
    model_configs,
    window_from,
    windows,
)
from kvref import CacheFactory, ModelConfig, may_refuse_truncate
from kvref.reprs import short_repr


@dataclass(frozen=True)
class ForkHere:
    """Fork the caches and continue on the fork, the parent kept, fed ``parent_tokens`` at
    the end and held to the model on its own history (where fork is offered); with
    ``on_parent``, continue on the parent instead, the fork the one left behind: an edit of
    either must leave the other's history alone."""

    parent_tokens: int
    on_parent: bool = False

    def describe(self) -> str:
        if self.on_parent:
            return (
                f"fork, going on with the parent (the fork decodes {self.parent_tokens} at the end)"
            )
        return f"fork (the parent decodes {self.parent_tokens} at the end)"


Step = Feed | Truncate | TruncateTo | Reorder | ForkHere


@short_repr
@dataclass(frozen=True)
class EditPlan:
    """A model, a batch and a prompt, then steps that append, roll back, rewind or reorder the
    caches; after each, the caches must behave exactly as if they had only been given the
    history that remains (the uncached model on it is the oracle)."""

    config: ModelConfig
    batch: int
    dtype: torch.dtype
    prompt: int
    steps: tuple[Step, ...]
    token_seed: int
    path: str = "append"  # the model's path through a cache that offers attend

    @property
    def max_length(self) -> int:
        fed = sum(step.size for step in self.steps if isinstance(step, Feed))
        return self.prompt + fed + sum(getattr(step, "parent_tokens", 0) for step in self.steps)

    def describe(self) -> str:
        steps = [step.describe() for step in self.steps]
        return (
            f"prompt {self.prompt}, then {steps}\n  model: {describe_config(self.config)}, "
            f"batch {self.batch}, {dtype_name(self.dtype)}"
        )

    def summary(self) -> tuple[str, str, str]:
        steps = ", ".join(step.describe() for step in self.steps)
        plan = f"{self.max_length} (prompt {self.prompt}; {steps})"
        return plan, str(self.config.num_layers), str(self.batch)


def reorders(batch: int) -> st.SearchStrategy[Reorder]:
    """A reorder of r0's ``batch`` rows over the whole domain (``reorder_indices``) but the
    identity, which moves nothing."""
    identity = tuple(range(batch))
    indices = reorder_indices(batch).filter(lambda drawn: drawn != identity)
    return indices.map(lambda drawn: Reorder(0, drawn))


EDIT_TOKENS = 128  # what an edit plan's model attends over, mostly: its attention budget


@st.composite
def edit_plans(draw, *, rollbacks: bool = True, reorder: bool = False) -> EditPlan:
    """Plans of chunks and rollbacks (and rewinds), or with ``reorder`` of chunks and
    reorders (batch 2 to 4)."""
    config = draw(model_configs(max_layers=3, tokens=EDIT_TOKENS), label="config")
    # Small windows fill up within a few steps, so that rewinds meet dropped positions.
    window = draw(window_from(st.one_of(st.integers(1, 6), windows)), label="edit window")
    config = dataclasses.replace(config, window=window)
    room = attention_room(config, EDIT_TOKENS)
    batch = draw(kvsizes.batches(low=2 if reorder else 1, room=room), label="batch")
    # Each kind draws a run of events: a chunk, a draft and its verdict, a reorder, a fork.
    chunks = st.one_of(chunk_sizes, st.integers(1, 4))  # mostly decode-sized: windows fill up
    kinds = [chunks.map(lambda size: (Feed(0, size),))] * 2
    if rollbacks:
        # Speculative decoding: draft k tokens, then the target model keeps some of them (a
        # truncate of the rest), or rejects them in two verdicts (truncates back to back).
        drafts = st.integers(1, 8).flatmap(
            lambda k: st.integers(0, k).map(lambda kept: (Feed(0, k), Truncate(0, k - kept)))
        )
        twice = st.integers(2, 8).flatmap(
            lambda k: st.tuples(
                st.just(Feed(0, k)), *[st.builds(Truncate, st.just(0), st.integers(0, k))] * 2
            )
        )
        # Rewinds of nothing, of a few tokens, across a window's edge, and of everything.
        backs = st.one_of(st.integers(0, 4), st.integers(5, 2 * EDGE + 1), st.just(MAX_SESSION))
        kinds += [
            drafts,
            drafts,
            twice,
            backs.map(lambda back: (Truncate(0, back),)),
            st.integers(0, 8).map(lambda position: (TruncateTo(0, position),)),
        ]
    if reorder:
        kinds += [reorders(batch).map(lambda event: (event,))] * 2
    kinds.append(st.builds(ForkHere, st.integers(1, 3), st.booleans()).map(lambda f: (f,)))
    runs = draw(st.lists(st.one_of(kinds), min_size=2, max_size=10), label="steps")
    steps = [event for run in runs for event in run]
    plan = EditPlan(
        config=config,
        batch=batch,
        dtype=draw(dtypes_on_device(DTYPES), label="dtype"),
        # Small prompts often: a ring sized by a small prompt wraps within a few steps.
        prompt=draw(st.one_of(st.integers(1, 4), chunk_sizes), label="prompt"),
        steps=tuple(steps),
        token_seed=draw(st.integers(0, 2**16), label="token seed"),
        path=draw(st.sampled_from(PATHS), label="path"),
    )
    while len(plan.steps) > 2 and plan.max_length > kvsizes.longest(plan.max_length):
        plan = dataclasses.replace(plan, steps=plan.steps[:-1])  # within the domain
    return plan


# --- Every plan within a scope (kvcheck.scope), for the bounded-exhaustive mode ---
#
# An exhaustive edit plan is chunks (the prompt first), one moment of edits once ``before``
# tokens are fed, then chunks again: every split of the tokens before and after it, every
# edit of the moment at every held length. Each truncate is a ``TruncateTo`` its target: a
# ``Truncate`` makes the same ``truncate(target)`` call on the caches, so one step per target
# is sound. Forks are left out: without a pool they feed a fork's history
# again as a prompt (``Engine.fork``), and with one they are the fork properties' plans. Plans
# without an edit are left out too: they are the core properties' sessions. The path is
# append (the attend path over an edited history is the random search's). At most one moment
# of edits a plan: more make the space explode (a truncate frees tokens to feed again).
def every_edit_plan(
    scope: kvscope.Scope,
    moments: Callable[[int, int], Iterator[tuple[Step, ...]]],
    *,
    least_batch: int = 1,
) -> Iterator[EditPlan]:
    """Every plan of chunks summing to 1 to ``scope.tokens`` tokens, with one moment of edits
    (``moments(held, batch)``: each the edits made back to back, nothing fed between) after
    some of its chunks: fewest tokens first, then the scope's layouts, each at a batch of at
    least ``least_batch`` rows (a reorder needs 2: a batch of 1 takes 2)."""
    for tokens in range(1, scope.tokens + 1):
        for layout in scope.layouts:
            batch = max(layout.batch, least_batch)
            for events in edited_feeds(tokens, moments, batch):
                yield EditPlan(
                    config=layout.config(),
                    batch=batch,
                    dtype=scope.dtype,
                    prompt=events[0].size,
                    steps=events[1:],
                    token_seed=0,
                )


def edited_feeds(
    tokens: int, moments: Callable[[int, int], Iterator[tuple[Step, ...]]], batch: int
) -> Iterator[tuple[Step, ...]]:
    """Every sequence of feeds of ``tokens`` tokens in all with one moment of ``moments``
    after some feed (``kvcheck.grammar``)."""

    def moves(state, left: int):
        held, edited = state
        for size in range(1, left + 1):
            yield (Feed(0, size),), (held + size, edited), size
        if held and not edited:  # the moment's edits after the feeds so far
            for moment in moments(held, batch):
                yield moment, (held, True), 0

    return grammar.sentences(tokens, (0, False), moves, lambda state: state[1])


def feeds(chunks: tuple[int, ...]) -> tuple[Feed, ...]:
    """``chunks`` fed one after another."""
    return tuple(Feed(0, size) for size in chunks)


def truncate_moments(held: int, batch: int) -> Iterator[tuple[Step, ...]]:
    """A truncate to every length of 0 to ``held``."""
    return ((TruncateTo(0, target),) for target in range(held + 1))


def reorder_moments(held: int, batch: int) -> Iterator[tuple[Step, ...]]:
    """A reorder by every index tuple of the batch's rows."""
    return ((Reorder(0, indices),) for indices in kvscope.every_indices(batch))


def mixed_moments(held: int, batch: int) -> Iterator[tuple[Step, ...]]:
    """A truncate to every length of 0 to ``held`` and a reorder by every index tuple, back
    to back, the truncate first, then the reorder first."""
    for target in range(held + 1):
        for indices in kvscope.every_indices(batch):
            yield TruncateTo(0, target), Reorder(0, indices)
    for indices in kvscope.every_indices(batch):
        for target in range(held + 1):
            yield Reorder(0, indices), TruncateTo(0, target)


def every_truncate_plan(scope: kvscope.Scope) -> Iterator[EditPlan]:
    """Every plan of chunks with one truncate (``every_edit_plan``) to each length 0..held,
    after each split of the tokens before it and before each split of those after: at n
    tokens 2^(n-3) (n^2 + 5n + 2) plans a layout (sum over the truncate's point a of
    2^(a-1) splits before, a + 1 lengths, 2^(n-a-1) splits after, or 1 where a = n)."""
    return every_edit_plan(scope, truncate_moments)


def every_reorder_plan(scope: kvscope.Scope) -> Iterator[EditPlan]:
    """Every plan of chunks with one reorder (``every_edit_plan``) by each of the B^B index
    tuples of its B rows (repeats and the identity too; a batch of 1 taken as 2): at n
    tokens B^B 2^(n-2) (n + 1) plans a layout."""
    return every_edit_plan(scope, reorder_moments, least_batch=2)


def every_mixed_plan(scope: kvscope.Scope) -> Iterator[EditPlan]:
    """Every plan of chunks with a truncate (to each length 0..held) and a reorder (by each
    of the B^B index tuples) back to back, in either order (``every_edit_plan``; a batch of
    1 taken as 2): at n tokens B^B 2^(n-2) (n^2 + 5n + 2) plans a layout."""
    return every_edit_plan(scope, mixed_moments, least_batch=2)


_one_layer = ModelConfig(
    vocab_size=5, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=2, ffn_dim=8
)
# - A rewind to position 1 after the ring of a window-2 cache dropped position 0, which the
#   next query needs: a cache that takes it instead of refusing (WindowTruncateUnchecked).
# - A rewind of everything after a window-1 ring dropped position 0: truncate(0) needs no
#   position, so a cache must not refuse it (RefusesTruncateZero).
# - A parent rolled back into the block it shares with its fork, decoding on before the fork
#   does: copy-on-write on the fork's side only (ParentTruncatesSharedBlocks).
PINNED_EDITS = (
    EditPlan(
        ModelConfig(
            vocab_size=11, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=2, seed=3, window=2
        ),
        batch=1,
        dtype=torch.float64,
        prompt=1,
        steps=(Feed(0, 1), Feed(0, 1), TruncateTo(0, 1), Feed(0, 1)),
        token_seed=1,
    ),
    EditPlan(
        dataclasses.replace(_one_layer, window=1),
        batch=1,
        dtype=torch.float64,
        prompt=1,
        steps=(Feed(0, 1), Truncate(0, MAX_SESSION)),
        token_seed=0,
    ),
    EditPlan(
        _one_layer,
        batch=1,
        dtype=torch.float64,
        prompt=9,
        steps=(ForkHere(1, on_parent=True), Truncate(0, 3), Feed(0, 1)),
        token_seed=0,
    ),
)
# - A reorder after a rollback left a wrapped ring's rows away from slot 0: a ring that
#   reorders slots from 0 instead of its held rows (ReorderFromSlotZero).
# - A reorder, then a truncate (of nothing), then a token: a reorder kept pending until the
#   next append must survive the truncate (TruncateDropsPendingReorder).
PINNED_MIXED_EDITS = (
    EditPlan(
        dataclasses.replace(_one_layer, window=1),
        batch=2,
        dtype=torch.float64,
        prompt=1,
        steps=(
            *feeds((1, 1, 1, 1, 1, 2, 1)),
            Truncate(0, 1),  # the draft of 1 rejected
            Reorder(0, (0, 0)),
            Feed(0, 1),
        ),
        token_seed=0,
    ),
    EditPlan(
        _one_layer,
        batch=3,
        dtype=torch.float64,
        prompt=1,
        steps=(Reorder(0, (0, 0, 0)), Truncate(0, 0), Feed(0, 1)),
        token_seed=0,
    ),
)
# - A reorder on a fork while its parent still reads the blocks they share: a reorder that
#   moves rows between shared blocks in place (ReorderPermutesSharedBlocks).
PINNED_REORDERS = (
    EditPlan(
        _one_layer,
        batch=2,
        dtype=torch.float64,
        prompt=5,
        steps=(ForkHere(1), Reorder(0, (1, 0)), Feed(0, 1)),
        token_seed=0,
    ),
)


# The edges of truncate (contract, section 4): each boundary of the length, of a window's
# refusal rule (kvref.may_refuse_truncate) and of a fork's sharing.
TO_ZERO = "truncate to 0"
OF_NOTHING = "truncate to the length held (nothing dropped)"
BY_ONE = "truncate by one"
TRUNCATES_BACK_TO_BACK = "two truncates back to back"
AFTER_WRAP = "truncate after a window's ring wrapped"
MAY_REFUSE = "truncate a window may refuse"
TO_ZERO_AFTER_WRAP = "truncate to 0 after a window's ring wrapped"
ACROSS_WINDOW = "truncate from past a window to within it"
BELOW_WINDOW = "truncate to one below a window"
TRUNCATED_FORK = "truncate of a fork whose parent lives on"
TRUNCATED_PARENT = "truncate of a parent whose fork lives on"
# Of reorder: the shapes of indices, and what it meets.
WITH_REPEATS = "reorder with repeats"
EVERY_ROW = "reorder permuting every row"
REVERSAL = "reorder reversing 3 or more rows"
ONE_FOR_ALL = "reorder of one row into all"
REORDERS_BACK_TO_BACK = "two reorders back to back"
REORDER_AFTER_WRAP = "reorder after a window's ring wrapped"
REORDERED_FORK = "reorder of a fork whose parent lives on"
REORDERED_PARENT = "reorder of a parent whose fork lives on"
# Of the two mixed.
REORDER_AFTER_TRUNCATE = "reorder right after a truncate"
TRUNCATE_AFTER_REORDER = "truncate right after a reorder"


def truncate_edges(windows: set[int], held: int, target: int, last: str) -> list[str]:
    """The edges a truncate from ``held`` to ``target`` runs on layers of ``windows``, the
    event before it ``last``."""
    edges = {
        TO_ZERO: target == 0 < held,
        OF_NOTHING: target == held > 0,
        BY_ONE: target == held - 1,
        TRUNCATES_BACK_TO_BACK: last == "truncate",
        TRUNCATE_AFTER_REORDER: last == "reorder",
        AFTER_WRAP: any(held > w for w in windows),
        MAY_REFUSE: may_refuse_truncate(windows, held, target),
        TO_ZERO_AFTER_WRAP: target == 0 and any(held > w for w in windows),
        ACROSS_WINDOW: any(held > w >= target for w in windows),
        BELOW_WINDOW: any(target == w - 1 < held for w in windows),
    }
    return [name for name, reached in edges.items() if reached]


def reorder_edges(indices: tuple[int, ...], windows: set[int], held: int, last: str):
    """The edges a reorder by ``indices`` of ``held`` tokens runs."""
    rows = len(indices)
    edges = {
        WITH_REPEATS: len(set(indices)) < rows,
        EVERY_ROW: len(set(indices)) == rows and indices != tuple(range(rows)),
        REVERSAL: rows >= 3 and indices == tuple(range(rows))[::-1],
        ONE_FOR_ALL: len(set(indices)) == 1,
        REORDERS_BACK_TO_BACK: last == "reorder",
        REORDER_AFTER_TRUNCATE: last == "truncate",
        REORDER_AFTER_WRAP: any(held > w for w in windows),
    }
    return [name for name, reached in edges.items() if reached]


def check_edits(factory: CacheFactory, plan: EditPlan) -> None:
    """After every rollback, rewind, reorder or fork, the caches behave exactly as if they
    had been given only the history that remains: logits, lengths and rows, step after step."""
    model = kvtensors.build_model(plan.config, plan.dtype)
    engine = Engine(
        factory,
        model,
        max_length=plan.max_length,
        path=path_for(plan.path, factory),
        describe=plan.describe,
    )
    windows = {model.config.layer_window(layer) for layer in range(plan.config.num_layers)}
    windows.discard(None)
    request = engine.start("r0", plan.batch)
    behind = []  # (request, tokens to decode at the end): the other side of each fork
    fed = [0]
    last = ["feed"]  # the event before the one running: edits back to back
    roles = {"fork": set(), "parent": set()}  # names of the requests each side of a fork

    def feed(size: int, at: str) -> None:
        fed[0] += 1
        seed = plan.token_seed * 1000 + fed[0]
        engine.feed(request, kvtensors.random_tokens(plan.config, plan.batch, size, seed), at=at)
        last[0] = "feed"

    def truncate(target: int, at: str) -> None:
        held = request.held
        engine.truncate(request, target, at=at)  # done, or refused as a window may
        reach.note(*truncate_edges(windows, held, target, last[0]), *forked(TRUNCATED))
        last[0] = "truncate"

    def forked(names: tuple[str, str]) -> list[str]:
        """The edges of an edit of ``request`` while the other side of a fork lives on: a
        fork whose parent does (names[0]), a parent whose fork does (names[1])."""
        if "fork" not in request.offered:
            return []
        return [
            name
            for name, role in zip(names, ("fork", "parent"), strict=True)
            if request.name in roles[role]
        ]

    feed(plan.prompt, " (the prompt)")
    engine.check("the prompt")
    for index, step in enumerate(plan.steps):
        at = f", step #{index} ({step.describe()})"
        if isinstance(step, Feed):
            feed(step.size, at)
        elif isinstance(step, Truncate | TruncateTo):
            truncate(step.target(request.held), at)
        elif isinstance(step, ForkHere):
            fork = engine.fork(request, f"fork #{len(behind) + 1}", at=at)
            if step.on_parent:
                roles["parent"].add(request.name)
                behind.append((fork, step.parent_tokens))
            else:
                roles["fork"].add(fork.name)
                behind.append((request, step.parent_tokens))
                request = fork
        else:
            held = request.held
            engine.reorder(request, torch.tensor(step.indices), at=at)
            reach.note(*reorder_edges(step.indices, windows, held, last[0]), *forked(REORDERED))
            last[0] = "reorder"
        engine.check(at.removeprefix(", "))
    # Every request left behind by a fork is still its own history.
    for other, tokens in behind:
        request = other
        feed(tokens, f", after the plan ({other.name} decodes)")
        engine.check(f"{other.name} decodes")
    engine.finish()


TRUNCATED = (TRUNCATED_FORK, TRUNCATED_PARENT)
REORDERED = (REORDERED_FORK, REORDERED_PARENT)


def check_bad_truncate(factory: CacheFactory, plan: kvst.CachePlan, case: kvbad.BadInput):
    """``truncate`` with ``case``'s argument is refused and changes nothing."""
    check_refused(factory, plan, case, "truncate", lambda cache: case.make(cache.given_length))


def check_bad_reorder(factory: CacheFactory, plan: kvst.CachePlan, case: kvbad.BadInput):
    """``reorder`` with ``case``'s indices is refused and changes nothing."""
    check_refused(factory, plan, case, "reorder", lambda cache: case.make(plan.spec))


def edges(*names: str, needs: tuple[str, ...] = ()) -> tuple[reach.Edge, ...]:
    """``names`` as edges, those of a fork needing ``fork`` beside ``needs``."""
    forks = (*TRUNCATED, *REORDERED)
    return tuple(
        reach.Edge(name, needs=(*needs, "fork") if name in forks else needs) for name in names
    )


TRUNCATE_EDGES = edges(
    TO_ZERO,
    OF_NOTHING,
    BY_ONE,
    TRUNCATES_BACK_TO_BACK,
    AFTER_WRAP,
    MAY_REFUSE,
    TO_ZERO_AFTER_WRAP,
    ACROSS_WINDOW,
    BELOW_WINDOW,
    *TRUNCATED,
    needs=("truncate",),
)
REORDER_EDGES = edges(
    WITH_REPEATS,
    EVERY_ROW,
    REVERSAL,
    ONE_FOR_ALL,
    REORDERS_BACK_TO_BACK,
    REORDER_AFTER_WRAP,
    *REORDERED,
    needs=("reorder",),
)
MIXED_EDGES = edges(REORDER_AFTER_TRUNCATE, TRUNCATE_AFTER_REORDER, needs=("truncate", "reorder"))

TRUNCATE = Property(
    "truncate",
    "after a rollback (speculative decoding) or a rewind, caches act on the history left",
    check_edits,
    edit_plans(),
    failures.WRONG_RESULTS,
    requires=("truncate",),
    pinned=on_both_paths(PINNED_EDITS),
    reaches=TRUNCATE_EDGES,
    every_plan=every_truncate_plan,
    exhaustive_tokens=6,
    since="1.0",
    holds=(
        "a session of chunks, speculative rollbacks (draft k tokens, keep 0 to k, truncate) and "
        "rewinds (a few tokens, past the window's edge, all, none), each step equal to the uncached"
        " model on the history left; a window cache may refuse a rollback or rewind only when the "
        "next query needs a position it was not bound to keep (and then must change nothing); any "
        "other refusal is a crash"
    ),
)
BAD_TRUNCATE = Property(
    "bad truncate",
    "truncate to a negative, too large or non-int length is refused, changing nothing",
    check_bad_truncate,
    kvst.cache_plans(room=1),
    failures.ACCEPTS_BAD_INPUT,
    cases=tuple(kvbad.BAD_TRUNCATES),
    requires=("truncate",),
    reaches=STATE_EDGES,
    every_plan=every_refusal,
    exhaustive_tokens=12,
    since="1.0",
    holds=("a negative, too large or non-int length is refused, changing nothing"),
)
REORDER = Property(
    "reorder",
    "after a reorder (beam search, repeats allowed), caches act on the permuted histories",
    check_edits,
    edit_plans(rollbacks=False, reorder=True),
    failures.WRONG_RESULTS,
    requires=("reorder",),
    min_batch=2,
    pinned=on_both_paths(PINNED_REORDERS),
    reaches=REORDER_EDGES,
    every_plan=every_reorder_plan,
    exhaustive_tokens=6,
    since="1.0",
    holds=(
        "reorders with repeats (never the identity) between chunks: every later step equals the "
        "uncached model on the permuted histories"
    ),
)
BAD_REORDER = Property(
    "bad reorder",
    "reorder with indices of a wrong dtype, shape, range or device is refused, changing nothing",
    check_bad_reorder,
    kvst.cache_plans(room=1),
    failures.ACCEPTS_BAD_INPUT,
    cases=tuple(kvbad.BAD_REORDERS),
    requires=("reorder",),
    reaches=STATE_EDGES,
    every_plan=every_refusal,
    exhaustive_tokens=8,
    since="1.0",
    holds=(
        "indices of another dtype, shape or device, out of range, or not a tensor are refused, "
        "changing nothing"
    ),
)
EDITS = Property(
    "truncate and reorder",
    "rollbacks, rewinds and reorders mixed: a reorder after a truncate, a truncate after one",
    check_edits,
    edit_plans(rollbacks=True, reorder=True),
    failures.WRONG_RESULTS,
    requires=("truncate", "reorder"),
    min_batch=2,
    pinned=on_both_paths(PINNED_MIXED_EDITS),
    reaches=MIXED_EDGES,
    examples_share=0.5,  # truncate and reorder each have their own full search
    every_plan=every_mixed_plan,
    exhaustive_tokens=4,
    since="1.0",
    holds=("the two mixed in one session: a reorder after a rollback, a rollback after a reorder"),
)


class TruncateTests(KitTests):
    """``truncate(length)``, for speculative decoding and regenerate: run when offered."""

    test_rollbacks_and_rewinds_act_on_the_history_left = property_test(TRUNCATE)
    test_bad_truncate_is_refused_and_changes_nothing = property_test(BAD_TRUNCATE)


class ReorderTests(KitTests):
    """``reorder(indices)``, for beam search: run when offered."""

    test_reorders_act_on_the_permuted_histories = property_test(REORDER)
    test_bad_reorder_is_refused_and_changes_nothing = property_test(BAD_REORDER)
    test_truncates_and_reorders_mixed_act_on_the_history_left = property_test(EDITS)
