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
from dataclasses import dataclass

import torch
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from kvcheck import badinput as kvbad
from kvcheck import failures
from kvcheck import sizes as kvsizes
from kvcheck import strategies as kvst
from kvcheck.devices import dtype_name
from kvcheck.harness import PATHS
from kvcheck.kit import KitTests, Property, on_both_paths, path_for, property_test
from kvcheck.properties.rejection import check_refused
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
from kvref import CacheFactory, ModelConfig


@dataclass(frozen=True)
class Rollback:
    """Draft ``drafted`` tokens, then keep the first ``kept`` of them and forget the rest
    (speculative decoding: the target model accepted ``kept``)."""

    drafted: int
    kept: int

    def describe(self) -> str:
        return f"draft {self.drafted}, keep {self.kept}"


@dataclass(frozen=True)
class Rewind:
    """Forget the last ``back`` tokens, or all of them when fewer are held (edit and
    regenerate); a window cache may refuse once it has dropped positions the next query
    needs."""

    back: int

    def describe(self) -> str:
        return f"rewind {self.back} tokens"

    def target(self, held: int) -> int:
        return max(held - self.back, 0)


@dataclass(frozen=True)
class RewindTo:
    """Forget every token at position >= ``position`` (none when fewer are held): back to
    the start of a long history, past what a window cache keeps."""

    position: int

    def describe(self) -> str:
        return f"rewind to {self.position}"

    def target(self, held: int) -> int:
        return min(self.position, held)


@dataclass(frozen=True)
class Reorder:
    """Batch row b becomes the old row ``indices[b]`` (beam search); never the identity."""

    indices: tuple[int, ...]

    def describe(self) -> str:
        return f"reorder {list(self.indices)}"


@dataclass(frozen=True)
class Rollbacks:
    """Draft ``drafted`` tokens, then forget ``first`` of them and, with no append between,
    ``second`` more (a draft rejected in two verdicts): rollbacks back to back."""

    drafted: int
    first: int
    second: int

    def describe(self) -> str:
        return f"draft {self.drafted}, forget {self.first} then {self.second} more"


@dataclass(frozen=True)
class ForkHere:
    """Continue on a fork of the caches; the parent is kept, fed ``parent_tokens`` at the
    end, and must still match the model on its own history (where fork is offered)."""

    parent_tokens: int

    def describe(self) -> str:
        return f"fork (the parent decodes {self.parent_tokens} at the end)"


Step = int | Rollback | Rollbacks | Rewind | RewindTo | Reorder | ForkHere


@dataclass(frozen=True)
class EditPlan:
    """A model, a batch and a prompt, then steps that append, roll back, rewind or reorder the
    caches; after each, the caches must behave exactly as if they had only been given the
    history that remains (the uncached model on it is the oracle)."""

    config: ModelConfig
    batch: int
    dtype: torch.dtype
    prompt: int
    steps: tuple[Step, ...]  # an int is a chunk of new tokens
    token_seed: int
    path: str = "append"  # the model's path through a cache that offers attend

    @property
    def max_length(self) -> int:
        total = self.prompt
        for step in self.steps:
            total += step if isinstance(step, int) else getattr(step, "drafted", 0)
        return total + sum(getattr(step, "parent_tokens", 0) for step in self.steps)

    def describe(self) -> str:
        steps = [describe_step(step) for step in self.steps]
        return (
            f"prompt {self.prompt}, then {steps}\n  model: {describe_config(self.config)}, "
            f"batch {self.batch}, {dtype_name(self.dtype)}"
        )

    def summary(self) -> tuple[str, str, str]:
        steps = ", ".join(describe_step(step) for step in self.steps)
        plan = f"{self.max_length} (prompt {self.prompt}; {steps})"
        return plan, str(self.config.num_layers), str(self.batch)


def describe_step(step: Step) -> str:
    return f"chunk of {step}" if isinstance(step, int) else step.describe()


def reorders(batch: int) -> st.SearchStrategy[Reorder]:
    """Indices for ``batch`` rows with repeats allowed, never the identity."""
    identity = tuple(range(batch))
    indices = st.lists(st.integers(0, batch - 1), min_size=batch, max_size=batch).map(tuple)
    return indices.filter(lambda drawn: drawn != identity).map(Reorder)


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
    kinds = [chunk_sizes, st.integers(1, 4)]  # mostly decode-sized chunks: windows fill up
    if rollbacks:
        drafts = st.integers(1, 8).flatmap(
            lambda k: st.builds(Rollback, st.just(k), st.integers(0, k))
        )
        # Rewinds of nothing, of a few tokens, across a window's edge, and of everything.
        backs = st.one_of(st.integers(0, 4), st.integers(5, 2 * EDGE + 1), st.just(MAX_SESSION))
        twice = st.integers(2, 8).flatmap(
            lambda k: st.builds(Rollbacks, st.just(k), st.integers(0, k), st.integers(0, k))
        )
        kinds += [
            drafts,
            drafts,
            twice,
            st.builds(Rewind, backs),
            st.builds(RewindTo, st.integers(0, 8)),
        ]
    if reorder:
        kinds += [reorders(batch), reorders(batch)]
    kinds.append(st.builds(ForkHere, st.integers(1, 3)))
    steps = draw(st.lists(st.one_of(kinds), min_size=2, max_size=10), label="steps")
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


_one_layer = ModelConfig(
    vocab_size=5, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=2, ffn_dim=8
)
# - A rewind to position 1 after the ring of a window-2 cache dropped position 0, which the
#   next query needs: a cache that takes it instead of refusing (WindowTruncateUnchecked).
# - A rewind of everything after a window-1 ring dropped position 0: truncate(0) needs no
#   position, so a cache must not refuse it (RefusesTruncateZero).
PINNED_EDITS = (
    EditPlan(
        ModelConfig(
            vocab_size=11, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=2, seed=3, window=2
        ),
        batch=1,
        dtype=torch.float64,
        prompt=1,
        steps=(1, 1, RewindTo(1), 1),
        token_seed=1,
    ),
    EditPlan(
        dataclasses.replace(_one_layer, window=1),
        batch=1,
        dtype=torch.float64,
        prompt=1,
        steps=(1, Rewind(MAX_SESSION)),
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
        steps=(1, 1, 1, 1, 1, 2, Rollback(1, 0), Reorder((0, 0)), 1),
        token_seed=0,
    ),
    EditPlan(
        _one_layer,
        batch=3,
        dtype=torch.float64,
        prompt=1,
        steps=(Reorder((0, 0, 0)), Rewind(0), 1),
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
        steps=(ForkHere(1), Reorder((1, 0)), 1),
        token_seed=0,
    ),
)


def check_edits(factory: CacheFactory, plan: EditPlan) -> None:
    """After every rollback, rewind, reorder or fork, the caches behave exactly as if they
    had been given only the history that remains: logits, lengths and rows, step after step."""
    model = kvst.build_model(plan.config, plan.dtype)
    engine = Engine(
        factory,
        model,
        max_length=plan.max_length,
        path=path_for(plan.path, factory),
        describe=plan.describe,
    )
    request = engine.start("the request", plan.batch)
    parents = []  # (request, tokens to decode at the end)
    fed = [0]

    def feed(size: int, at: str) -> None:
        fed[0] += 1
        seed = plan.token_seed * 1000 + fed[0]
        engine.feed(request, kvst.random_tokens(plan.config, plan.batch, size, seed), at=at)

    feed(plan.prompt, " (the prompt)")
    engine.check("the prompt")
    for index, step in enumerate(plan.steps):
        at = f", step #{index} ({describe_step(step)})"
        if isinstance(step, int):
            feed(step, at)
        elif isinstance(step, Rollback):
            feed(step.drafted, at)
            engine.truncate(request, request.held - step.drafted + step.kept, at=at)
        elif isinstance(step, Rollbacks):
            feed(step.drafted, at)
            engine.truncate(request, max(request.held - step.first, 0), at=at)
            engine.truncate(request, max(request.held - step.second, 0), at=at)
        elif isinstance(step, Rewind | RewindTo):
            engine.truncate(request, step.target(request.held), at=at)
        elif isinstance(step, ForkHere):
            parents.append((request, step.parent_tokens))
            request = engine.fork(request, f"fork #{len(parents)}", at=at)
        else:
            if step.indices == tuple(range(plan.batch)):  # it would prove nothing
                raise InvalidArgument(f"{at}: a reorder plan must not be the identity")
            engine.reorder(request, torch.tensor(step.indices), at=at)
        engine.check(at.removeprefix(", "))
    # Every parent left behind by a fork is still its own history.
    for parent, tokens in parents:
        request = parent
        feed(tokens, f", after the plan ({parent.name} decodes)")
        engine.check(f"{parent.name} decodes")
    engine.finish()


def check_bad_truncate(factory: CacheFactory, plan: kvst.CachePlan, case: kvbad.BadInput):
    """``truncate`` with ``case``'s argument is refused and changes nothing."""
    check_refused(factory, plan, case, "truncate", lambda cache: case.make(cache.given_length))


def check_bad_reorder(factory: CacheFactory, plan: kvst.CachePlan, case: kvbad.BadInput):
    """``reorder`` with ``case``'s indices is refused and changes nothing."""
    check_refused(factory, plan, case, "reorder", lambda cache: case.make(plan.spec))


TRUNCATE = Property(
    "truncate",
    "after a rollback (speculative decoding) or a rewind, caches act on the history left",
    check_edits,
    edit_plans(),
    failures.WRONG_RESULTS,
    requires=("truncate",),
    pinned=on_both_paths(PINNED_EDITS),
)
BAD_TRUNCATE = Property(
    "bad truncate",
    "truncate to a negative, too large or non-int length is refused, changing nothing",
    check_bad_truncate,
    kvst.cache_plans(room=1),
    failures.ACCEPTS_BAD_INPUT,
    cases=tuple(kvbad.BAD_TRUNCATES),
    requires=("truncate",),
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
)
BAD_REORDER = Property(
    "bad reorder",
    "reorder with indices of a wrong dtype, shape, range or device is refused, changing nothing",
    check_bad_reorder,
    kvst.cache_plans(room=1),
    failures.ACCEPTS_BAD_INPUT,
    cases=tuple(kvbad.BAD_REORDERS),
    requires=("reorder",),
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
    examples_share=0.5,  # truncate and reorder each have their own full search
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
