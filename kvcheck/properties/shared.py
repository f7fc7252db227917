"""Layers that share one cache (docs/contract.md, section 10.3): cross-layer KV sharing, as
in Gemma 3n's last layers or YOCO's second half, where a layer attends over the rows an
earlier layer's cache returned instead of keeping its own.

Sharing is declared by the model (``ModelConfig.kv_sources``), not by the cache, and asks
nothing of a cache beyond rule 2 (what ``append`` returned stays valid until that cache's
next call, which comes after every reader): so every cache runs it. A plan draws a model
(windows, MLA for a latent cache), which of its layers read which earlier one, and one
prompt, and feeds the same tokens three ways: as one prefill, in drawn chunks on the reset
caches, and token by token on fresh ones. Every step's logits must equal the uncached
model's over the same sharing, and every source layer's append must return the rows it was
given. A reader whose queries sit where its source's length is after the append (mlx-lm
1702) goes wrong only when a chunk brings more than one token, hence the three ways.

Through rows of their own and trees (section 10.3, "Rows of their own and trees"): a reader
attends over what its source's ``append_rows`` returned, each row at its own positions, and
over what its ``append_tree`` returned under the same tree mask; the per-row edits and the
commit go to the source layers alone. A rows plan feeds a shared model's rows counts of their
own (an empty slot, pads poisoned, first positions of their own where ``reset_at`` is
offered), rolls rows back and lets rows leave where offered, each edit followed by a feed,
and holds every row's new logits to that row alone, uncached; a tree plan drafts a tree
after a prefix, holds each node to its path, commits one and decodes after it.

- ``shared layers``: every cache.
- ``shared layers through rows``: where ``append_rows`` is offered.
- ``shared layers under a tree``: where ``append_tree`` is offered.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Iterator
from typing import ClassVar

import torch
from hypothesis import strategies as st
from torch import Tensor

from kvcheck import asserts as kvassert
from kvcheck import devices as kvdevices
from kvcheck import failures, reach
from kvcheck import scope as kvscope
from kvcheck import sizes as kvsizes
from kvcheck import strategies as kvst
from kvcheck import tensors as kvtensors
from kvcheck.harness import Recorder, builder, record
from kvcheck.kit import KitTests, Property, property_test
from kvcheck.plan_events import FeedRows, SelectRows, TruncateRows
from kvcheck.properties import rows as kvrows
from kvcheck.properties import tree as kvtree
from kvcheck.session import assert_logits
from kvref import CacheContractError, CacheFactory, ModelConfig, may_refuse_truncate
from kvref.model import ReferenceTransformer
from kvref.reprs import short_repr
from kvref.rows import row_slots, rows_laid_out
from kvref.tree import tree_paths

MOST_TOKENS = 2 * kvst.EDGE + 1  # past two 16-row blocks: chunks straddle them


@short_repr
@dataclasses.dataclass(frozen=True)
class SharedPlan:
    """A model whose layers share caches (``config.kv_sources``), a batch and a dtype, one
    prompt's tokens (``token_seed``) and the chunks of its second feeding (the first is one
    prefill, the third token by token)."""

    config: ModelConfig
    batch: int
    dtype: torch.dtype
    chunks: tuple[int, ...]
    token_seed: int

    @property
    def tokens(self) -> int:
        return sum(self.chunks)

    @property
    def feedings(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """The three ways the tokens are fed: (name, chunks)."""
        return (
            ("one prefill", (self.tokens,)),
            ("chunked, on the reset caches", self.chunks),
            ("token by token, on fresh caches", (1,) * self.tokens),
        )

    def describe(self) -> str:
        model = kvst.describe_config(self.config)
        return (
            f"shared-layers plan: {self.tokens} tokens fed as one prefill, then in chunks "
            f"{list(self.chunks)}, then token by token\n  model: {model}, batch {self.batch}, "
            f"{kvdevices.dtype_name(self.dtype)}"
        )

    def summary(self) -> tuple[str, str, str]:
        chunks = "+".join(map(str, self.chunks))
        return f"{self.tokens} x 3 ({chunks})", str(self.config.num_layers), str(self.batch)


@st.composite
def shared_configs(draw, tokens: int) -> ModelConfig:
    """A model of 2 or 3 layers, some reading an earlier one's cache (``kv_sources``)."""
    config = draw(kvst.model_configs(min_layers=2, max_layers=3, tokens=tokens), label="config")
    if config.num_layers == 2:  # alternate windows would leave no layer one it can read
        config = dataclasses.replace(config, window_layers="all")
    return dataclasses.replace(config, kv_sources=draw(kvst.kv_sources(config), label="kv_sources"))


@st.composite
def shared_plans(draw) -> SharedPlan:
    config = draw(shared_configs(MOST_TOKENS))
    total = draw(st.one_of(st.integers(2, 8), st.integers(9, MOST_TOKENS)), label="tokens")
    chunks = draw(kvst.chunk_plans(total, min_chunks=1), label="chunks")
    if sum(chunks) < total:  # the rest in one chunk: every feeding gives the same tokens
        chunks.append(total - sum(chunks))
    return SharedPlan(
        config=config,
        batch=draw(
            kvsizes.batches(small_max=3, room=kvst.attention_room(config, MOST_TOKENS)),
            label="batch",
        ),
        dtype=draw(kvst.dtypes_on_device(kvst.WITH_HALF), label="dtype"),
        chunks=tuple(chunks),
        token_seed=draw(st.integers(0, 2**16), label="token seed"),
    )


SHARING_EDGES = tuple(
    reach.Edge(name)
    for name in (
        "two readers of one source",
        "a reader of the layer just before it",
        "a reader two layers after its source",
        "a window layer that reads",
        "a chunk of several tokens after the first",
    )
)


def note_sharing(plan: SharedPlan) -> None:
    """Note which of ``SHARING_EDGES`` the plan's sharing and chunks reach."""
    config = plan.config
    readers = {
        layer: source for layer, source in enumerate(config.kv_sources) if source is not None
    }
    sources = list(readers.values())
    for name, reached in (
        ("two readers of one source", len(sources) > len(set(sources))),
        ("a reader of the layer just before it", any(r - s == 1 for r, s in readers.items())),
        ("a reader two layers after its source", any(r - s >= 2 for r, s in readers.items())),
        ("a window layer that reads", any(config.layer_window(r) for r in readers)),
        ("a chunk of several tokens after the first", any(n > 1 for n in plan.chunks[1:])),
    ):
        if reached:
            reach.note(name)


def check_shared_layers(factory: CacheFactory, plan: SharedPlan) -> None:
    """Each way of feeding the tokens gives, at every step, the uncached model's logits over
    the same sharing; each source layer's append returns the rows it was given."""
    note_sharing(plan)
    model = kvtensors.build_model(plan.config, plan.dtype)
    tokens = kvtensors.random_tokens(plan.config, plan.batch, plan.tokens, plan.token_seed)
    expected = model(tokens)
    truth = functools.cache(lambda: kvtensors.build_model(plan.config, torch.float64)(tokens))
    owned = plan.config.cache_layers
    caches = None
    for feeding, (name, chunks) in enumerate(plan.feedings):
        if feeding == 1:
            for layer in owned:
                caches[layer].reset()
        else:
            built = model.new_caches(builder(factory), batch=plan.batch, max_length=plan.tokens)
            caches = record(built, plan.config)
        start = 0
        for step, size in enumerate(chunks):
            where = (
                f"{name}: step #{step} (of {len(chunks)}), {size} token{'s' * (size > 1)} at "
                f"positions {start}..{start + size - 1}\n  {plan.describe()}"
            )
            logits = model(tokens[:, start : start + size], caches=caches)
            for layer in owned:
                kvassert.assert_length(
                    caches[layer], start + size, who=f"layer {layer}", where=where
                )
                kvassert.assert_returned_rows(caches[layer], who=f"layer {layer}", where=where)
            assert_logits(
                logits,
                expected[:, start : start + size],
                lambda s=start, n=size: truth()[:, s : s + n],
                where=where,
                start=start,
                path="append",
                lossy=kvassert.coarsest([caches[layer] for layer in owned]),
            )
            start += size


# Tried first on every run: four layers, the last two reading layer 1, a chunk of 3 then
# single tokens (a reader at its source's length after the append is 3 positions off).
LAST_TWO_READ_ONE = SharedPlan(
    config=ModelConfig(
        vocab_size=19,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=4,
        kv_sources=(None, None, 1, 1),
    ),
    batch=2,
    dtype=torch.float64,
    chunks=(3, 1, 5, 1),
    token_seed=5,
)


# --- Every plan within a scope (kvcheck.scope), for the bounded-exhaustive mode ---
def every_kv_sources(config: ModelConfig) -> Iterator[tuple[int | None, ...]]:
    """Every assignment of which earlier layer each layer reads (None: its own cache) that
    ``kvcheck.strategies.kv_sources`` draws: a layer reads one of those ``readable_by`` it,
    and at least one layer reads. For 2 layers of one window: one, (None, 0)."""

    def extend(sources: tuple) -> Iterator[tuple]:
        layer = len(sources)
        if layer == config.num_layers:
            if any(source is not None for source in sources):
                yield sources
            return
        eligible = kvst.readable_by(config, layer, sources)
        for source in (None, *eligible):
            yield from extend((*sources, source))

    yield from extend(())


def every_shared_config(scope: kvscope.Scope) -> Iterator[tuple[kvscope.Layout, ModelConfig]]:
    """Each 2-layer layout of the scope (one layer has none to read) with each of its
    ``every_kv_sources``: its window on both layers (as ``shared_configs`` makes a 2-layer
    model: alternate windows would leave no layer one it can read)."""
    for layout in scope.layouts:
        if layout.layers != 2:
            continue
        windows = {"window_layers": "all"} if layout.window is not None else {}
        plain = layout.config(**windows)
        for sources in every_kv_sources(plain):
            yield layout, dataclasses.replace(plain, kv_sources=sources)


def every_shared_plan(scope: kvscope.Scope) -> Iterator[SharedPlan]:
    """Every prompt of 1 to ``scope.tokens`` tokens in every split of its chunked feeding
    (``kvscope.compositions``), on each shared model of ``every_shared_config``: 2^(T - 1)
    plans of T tokens a model (3 models in the default scope, one kv_sources each). The
    tokens counted are the prompt's: the plan feeds them three times (one prefill, its
    chunks, token by token), which are not choices of the plan but its check. Seed 0."""
    for tokens in range(1, scope.tokens + 1):
        for layout, config in every_shared_config(scope):
            for chunks in kvscope.compositions(tokens):
                yield SharedPlan(config, layout.batch, scope.dtype, chunks, token_seed=0)


SHARED_LAYERS = Property(
    "shared layers",
    "layers that read an earlier layer's cache compute what the uncached model computes, "
    "fed as one prefill, in chunks and token by token",
    check_shared_layers,
    shared_plans(),
    failures.WRONG_RESULTS,
    pinned=(LAST_TWO_READ_ONE,),
    reaches=SHARING_EDGES,
    since="1.4",
    every_plan=every_shared_plan,
    exhaustive_tokens=8,
    holds=(
        "a model of 2 or 3 layers, some reading an earlier layer's cache (`ModelConfig.kv_sources`:"
        " the last layers sharing one source, a layer reading the one before, any other), windows "
        "and MLA included: the same tokens fed as one prefill, in drawn chunks on the reset caches "
        "and token by token on fresh ones, every step's logits equal the uncached model's over the "
        "same sharing, and each source layer's `append` returns the rows given (contract, section "
        "10.3; every cache)"
    ),
)


# --- through rows of their own (section 8.1) and trees (section 9.2) --------------------

ROWS_MAX_LENGTH = 24  # per row: prompts, chunks and rollbacks around a 16-row block


@short_repr
@dataclasses.dataclass(frozen=True)
class SharedRowsPlan(kvrows.RowsPlan):
    """A shared model's batch and its events, a ``RowsPlan``'s of three kinds: ``FeedRows``,
    ``TruncateRows`` and ``SelectRows``."""

    TITLE: ClassVar[str] = "shared rows plan"


@st.composite
def shared_rows_plans(draw) -> SharedRowsPlan:
    """Prompts of their own lengths, then 1 to 3 events (a decode step, a chunk, a per-row
    rollback, rows leaving or reordered), each edit followed by a feed that reads it."""
    batch = draw(kvsizes.batches(low=2, small_max=3), label="batch")
    prompts = draw(kvrows.prompt_counts(batch, ROWS_MAX_LENGTH // 2), label="prompts")
    events, lengths = [FeedRows(prompts)], list(prompts)
    for _ in range(draw(st.integers(1, 3), label="events")):
        kind = draw(st.sampled_from(("feed", "truncate", "select")), label="event")
        if kind == "truncate":
            lengths = [n - draw(kvrows.rejected_counts(n), label="rejected") for n in lengths]
            events.append(TruncateRows(tuple(lengths)))
        elif kind == "select":
            kept = draw(kvrows.selections(len(lengths)), label="rows kept")
            events.append(SelectRows(kept))
            lengths = [lengths[row] for row in kept]
        most = [min(4, ROWS_MAX_LENGTH - n) for n in lengths]
        counts = tuple(draw(st.integers(0, room), label="new tokens") for room in most)
        if not any(counts):  # a feed reads what the event left
            counts = tuple(int(room > 0) for room in most)
        events.append(FeedRows(counts))
        lengths = [n + c for n, c in zip(lengths, counts, strict=True)]
    models = shared_configs(ROWS_MAX_LENGTH + 8)
    return kvrows.drawn_rows_plan(
        draw, SharedRowsPlan, models, batch=batch, events=events, config_label=None
    )


READER_ROWS = "reader through append_rows"
READER_ROWS_APART = "reader beside rows of different lengths"
READER_AFTER_TRUNCATE = "reader after a per-row truncate"
READER_AFTER_SELECT = "reader after select_rows"
READER_FIRSTS = "reader of rows at first positions of their own"
READER_PAST_A_LAYER = "reader with a layer of its own cache between it and its source"
READER_TREE = "reader under a tree draft"
READER_TREE_SIBLINGS = "reader under a tree with siblings"
READER_AFTER_COMMIT = "reader after commit_tree"

SHARED_ROWS_EDGES = (
    reach.Edge(READER_ROWS),
    reach.Edge(READER_ROWS_APART),
    reach.Edge(READER_AFTER_TRUNCATE, needs=("truncate_rows",)),
    reach.Edge(READER_AFTER_SELECT, needs=("select_rows",)),
    reach.Edge(READER_FIRSTS, needs=("reset_at",)),
    reach.Edge(READER_PAST_A_LAYER),
)
SHARED_TREE_EDGES = (
    reach.Edge(READER_TREE),
    reach.Edge(READER_TREE_SIBLINGS),
    reach.Edge(READER_AFTER_COMMIT),
    reach.Edge(READER_PAST_A_LAYER),
)


def reads_past_a_layer(config: ModelConfig) -> bool:
    """Whether a reader's source lies before another layer with a cache of its own, whose
    call comes between the source's and the reader's (rule 2's reach through a reader)."""
    owned = set(config.cache_layers)
    return any(
        any(between in owned for between in range(source + 1, reader))
        for reader, source in enumerate(config.kv_sources)
        if source is not None
    )


class SharedRun:
    """A shared model's caches as a plan drives them: built from the factory and recorded,
    readers None; the source layers alone take the edits and the commit."""

    def __init__(self, factory: CacheFactory, config: ModelConfig, dtype, batch: int, most: int):
        self.config = config
        self.model = kvtensors.build_model(config, dtype)
        built = self.model.new_caches(builder(factory), batch=batch, max_length=most)
        self.caches = record(built, config)
        self.max_length = most

    @functools.cached_property
    def truth(self) -> ReferenceTransformer:
        return kvtensors.build_model(self.config, torch.float64)

    @property
    def sources(self) -> list[Recorder]:
        return [self.caches[layer] for layer in self.config.cache_layers]

    @property
    def lossy(self):
        return kvassert.coarsest(self.sources)

    def offers(self, name: str) -> bool:
        return callable(getattr(self.sources[0].cache, name, None))

    def check_row_lengths(self, rows: list[Tensor], what: str, where: str) -> None:
        want = tuple(len(row) for row in rows)
        for layer in self.config.cache_layers:
            got = tuple(self.caches[layer].row_lengths)
            if got != want:
                raise failures.DataLoss(
                    f"layer {layer}: row_lengths {got} after {what}; the rows hold {want}\n"
                    f"  at {where}"
                )


def feed_shared_rows(run: SharedRun, rows, firsts, new, pad: str, where: str) -> list[Tensor]:
    """Row b of the batch fed ``new[b]`` through ``forward_rows`` on the shared model; each
    row's new logits against that row alone, uncached, at its positions. Returns the rows."""
    padding = getattr(run.sources[0], "padding", "right")
    laid, counts = rows_laid_out(new, padding, run.model.device)
    poison = kvtensors.poison_value(pad, run.model.dtype)
    lengths = [len(row) for row in rows]
    fits = all(n + c <= run.max_length for n, c in zip(lengths, counts, strict=True))
    try:
        logits = run.model.forward_rows(laid, counts, run.caches, pad=poison)
    except ValueError as error:
        if type(error) is ValueError and fits:  # capacity is per row (section 8.1)
            raise failures.RefusesValidInput(
                f"append_rows refused rows that each fit in max_length {run.max_length}, with "
                f"ValueError: {error}\n  at {where}"
            ) from error
        raise
    rows = [torch.cat((row, tokens)) for row, tokens in zip(rows, new, strict=True)]
    for b, count in enumerate(counts):
        if not count:
            continue
        history = rows[b][None]
        expected = run.model(history, start_position=firsts[b])[:, -count:]
        start = firsts[b] + lengths[b]
        assert_logits(
            logits[b : b + 1, row_slots(padding, laid.shape[1], count)],
            expected,
            lambda h=history, f=firsts[b], n=count: run.truth(h, start_position=f)[:, -n:],
            where=(
                f"row {b} (held {lengths[b]}, its neighbours {lengths}), new positions "
                f"{start}..{start + count - 1}, against that row alone at batch 1\n  at {where}"
            ),
            start=start,
            path="append",
            lossy=run.lossy,
        )
    run.check_row_lengths(rows, f"rows fed {list(counts)}", where)
    return rows


def truncate_shared_rows(run: SharedRun, rows, keep, where: str) -> bool:
    """The source layers' ``truncate_rows(keep)``, widest window first; False where the first
    refuses as section 4 allows a window layer to (nothing changed)."""
    windows = [run.config.layer_window(layer) for layer in range(run.config.num_layers)]
    for done, layer in enumerate(run.model.widest_window_first()):
        error = kvassert.raised_by(lambda i=layer: run.caches[i].truncate_rows(tuple(keep)))
        if error is None:
            continue
        allowed = isinstance(error, ValueError) and not isinstance(error, CacheContractError)
        spans = zip(rows, keep, strict=True)
        if done == 0 and allowed and any(may_refuse_truncate(windows, len(r), n) for r, n in spans):
            run.check_row_lengths(rows, f"a refused truncate_rows to {list(keep)}", where)
            return False
        raise failures.RefusesValidInput(
            f"layer {layer}: truncate_rows to {list(keep)} refused with "
            f"{type(error).__name__}: {error}; every position a row's next query needs is "
            f"among those a window keeps\n  at {where}"
        ) from error
    return True


def check_shared_rows(factory: CacheFactory, plan: SharedRowsPlan) -> None:
    """Every row's new logits, at every feed, equal that row alone through the uncached model
    over the same sharing; the edits go to the source layers alone."""
    run = SharedRun(factory, plan.config, plan.dtype, plan.batch, ROWS_MAX_LENGTH)
    generator = torch.Generator().manual_seed(plan.token_seed)
    device = kvdevices.current()
    rows = [torch.empty(0, dtype=torch.long, device=device)] * plan.batch
    firsts = [0] * plan.batch
    if plan.firsts is not None and run.offers("reset_at"):
        for cache in run.sources:
            cache.reset_at(tuple(plan.firsts))
        firsts = list(plan.firsts)
        if len(set(firsts)) > 1:
            reach.note(READER_FIRSTS)
    after = None  # the edit the next feed reads
    for index, event in enumerate(plan.events):
        where = f"event #{index} of {plan.describe()}"
        if isinstance(event, FeedRows):
            vocab, counts = plan.config.vocab_size, event.counts
            new = [torch.randint(0, vocab, (n,), generator=generator) for n in counts]
            held = [len(row) for row in rows]
            rows = feed_shared_rows(run, rows, firsts, [t.to(device) for t in new], plan.pad, where)
            note_shared_feed(plan.config, held, counts, after)
            after = None
        elif isinstance(event, TruncateRows):
            if not run.offers("truncate_rows"):
                break  # not offered: the rest was drawn for the rows it would leave
            if truncate_shared_rows(run, rows, event.keep, where):
                rows = [row[:n] for row, n in zip(rows, event.keep, strict=True)]
                after = "truncate"
        else:
            if not run.offers("select_rows"):
                break
            kept = event.kept
            chosen = torch.tensor(kept, dtype=torch.long, device=run.model.device)
            for cache in run.sources:
                cache.select_rows(chosen)
            rows, firsts, after = [rows[b] for b in kept], [firsts[b] for b in kept], "select"
            run.check_row_lengths(rows, event.describe(), where)


def note_shared_feed(config: ModelConfig, held: list[int], counts, after: str | None) -> None:
    """The edges a feed of ``counts`` on rows holding ``held`` ran through a reader."""
    reach.note(READER_ROWS)
    if any(counts) and len(set(held)) > 1:  # the rows' offsets differ: each its own
        reach.note(READER_ROWS_APART)
    if after == "truncate":
        reach.note(READER_AFTER_TRUNCATE)
    elif after == "select":
        reach.note(READER_AFTER_SELECT)
    if reads_past_a_layer(config):
        reach.note(READER_PAST_A_LAYER)


@short_repr
@dataclasses.dataclass(frozen=True)
class SharedTreePlan:
    """A shared model, a prefix fed in chunks, a draft tree, the path every row accepts
    (one length for every row, as any tree cache takes) and the decode steps after."""

    config: ModelConfig
    dtype: torch.dtype
    batch: int
    prefix: tuple[int, ...]
    parents: tuple[int, ...]
    accepted: tuple[int, ...]
    after: int
    token_seed: int

    def describe(self) -> str:
        return (
            f"shared tree plan: batch {self.batch}, {kvdevices.dtype_name(self.dtype)}, a prefix "
            f"in chunks {list(self.prefix)}, a tree of parents {list(self.parents)}, path "
            f"{list(self.accepted)} accepted, {self.after} decode steps after\n  model: "
            f"{kvst.describe_config(self.config)}"
        )

    def summary(self) -> tuple[str, str, str]:
        fed = sum(self.prefix) + len(self.parents) + self.after
        return f"{fed} (prefix, tree, steps)", str(self.config.num_layers), str(self.batch)


TREE_MAX_NODES = 6


@st.composite
def shared_tree_plans(draw) -> SharedTreePlan:
    prefix = draw(st.lists(st.integers(1, kvst.EDGE + 1), min_size=1, max_size=2), label="prefix")
    parents = draw(kvtree.draft_trees(TREE_MAX_NODES), label="parents")
    path = tree_paths(parents)[draw(st.integers(0, len(parents) - 1), label="leaf")]
    accepted = path[: draw(st.integers(0, len(path)), label="accepted")]
    tokens = sum(prefix) + len(parents) + 2
    return SharedTreePlan(
        config=draw(shared_configs(tokens)),
        dtype=draw(kvst.dtypes_on_device(kvst.WITH_HALF), label="dtype"),
        batch=draw(kvsizes.batches(small_max=3), label="batch"),
        prefix=tuple(prefix),
        parents=parents,
        accepted=accepted,
        after=draw(st.integers(1, 2), label="steps after"),
        token_seed=draw(st.integers(0, 2**16), label="token seed"),
    )


def check_shared_tree(factory: CacheFactory, plan: SharedTreePlan) -> None:
    """Each node's logits equal the uncached model's on the prefix and its path over the same
    sharing; after the commit (the source layers alone), each step is the uncached model's
    on the prefix, the accepted path and the steps."""
    most = sum(plan.prefix) + len(plan.parents) + plan.after
    run = SharedRun(factory, plan.config, plan.dtype, plan.batch, most)
    tokens = kvtensors.random_tokens(plan.config, plan.batch, most, plan.token_seed)
    held = sum(plan.prefix)
    history, nodes = tokens[:, :held], tokens[:, held : held + len(plan.parents)]
    start = 0
    for size in plan.prefix:
        run.model(history[:, start : start + size], caches=run.caches)
        start += size
    where = plan.describe()
    assert_logits(
        run.model.forward_tree(nodes, plan.parents, run.caches),
        run.model.forward_tree_uncached(history, nodes, plan.parents),
        lambda: run.truth.forward_tree_uncached(history, nodes, plan.parents),
        where=f"the tree's nodes, after {held} tokens, against each one's path\n  at {where}",
        start=held,
        path="append",
        what="each node's logits and the uncached model's on the prefix and the node's path",
        lossy=run.lossy,
    )
    note_shared_tree(plan)
    for cache in run.sources:  # a reader has no cache: it reads its source's commit
        cache.commit_tree([plan.accepted] * plan.batch)
    kept = torch.cat((history, nodes[:, list(plan.accepted)]), dim=1)
    steps = tokens[:, held + len(plan.parents) :]
    for step in range(plan.after):
        kept = torch.cat((kept, steps[:, step : step + 1]), dim=1)
        at = kept.shape[1] - 1
        assert_logits(
            run.model(steps[:, step : step + 1], caches=run.caches),
            run.model(kept)[:, -1:],
            lambda k=kept: run.truth(k)[:, -1:],
            where=f"step #{step} after the commit, at position {at}\n  at {where}",
            start=at,
            path="append",
            lossy=run.lossy,
        )
        reach.note(READER_AFTER_COMMIT)


def note_shared_tree(plan: SharedTreePlan) -> None:
    reach.note(READER_TREE)
    if len(set(plan.parents)) < len(plan.parents):  # two nodes of one parent (or two roots)
        reach.note(READER_TREE_SIBLINGS)
    if reads_past_a_layer(plan.config):
        reach.note(READER_PAST_A_LAYER)


# The model of the plans tried first on every run: layer 2 reads layer 0 past a layer of
# its own.
MODEL_PAST_A_LAYER = ModelConfig(
    vocab_size=19, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=4, kv_sources=(None, None, 0)
)
# Rows of their own first positions and lengths, a rollback per row, then the two rows
# swapped.
ROWS_PAST_A_LAYER = SharedRowsPlan(
    config=MODEL_PAST_A_LAYER,
    dtype=torch.float64,
    batch=2,
    events=(
        FeedRows((5, 2)),
        TruncateRows((4, 1)),
        FeedRows((2, 0)),
        SelectRows((1, 0)),
        FeedRows((1, 1)),
    ),
    token_seed=3,
    firsts=(7, 255),
    pad="nan",
)
# A tree of two roots and siblings under a reader two layers after its source.
TREE_PAST_A_LAYER = SharedTreePlan(
    config=MODEL_PAST_A_LAYER,
    dtype=torch.float64,
    batch=2,
    prefix=(3, 2),
    parents=(-1, 0, 0, 1, -1),
    accepted=(0, 1, 3),
    after=2,
    token_seed=9,
)


def every_shared_rows_plan(scope: kvscope.Scope) -> Iterator[SharedRowsPlan]:
    """Every plan of feeds with a count per row (``kvrows.row_feeds``: prompts of their own,
    an empty slot, rows idle beside rows decoding, chunks) of 1 to ``scope.tokens`` tokens
    over all rows, on each shared model of ``every_shared_config`` (a batch of 1 taken as
    2: rows of their own need two): c_B(n) plans of n tokens a model, as ``mixed lengths``'
    (for 2 rows 2, 7, 24, 82, 280, 956 at 1 to 6 tokens).

    Fixed, and why: as ``kvrows.every_rows_plan``: rows at position 0, pads of nan, no
    ``truncate_rows`` or ``select_rows`` events (each multiplies the plans by the lengths or
    rows held: the search draws them), seed 0."""
    models = every_shared_config(scope)
    return kvrows.every_plan_of_rows(scope, SharedRowsPlan, kvrows.row_feeds, models)


TREE_ENUMERATED_NODES = 3  # the most nodes of an enumerated tree


def every_shared_tree_plan(scope: kvscope.Scope) -> Iterator[SharedTreePlan]:
    """Every plan of a prefix of p >= 1 tokens in every split, a tree of n <= 3 nodes in
    every parent assignment (``kvtree.every_parents``), every path accepted (none, or a root
    down to any node) and a >= 1 decode steps after, p + n + a tokens in all, on each shared
    model of ``every_shared_config``: at T tokens, sum over p + n + a = T of 2^(p - 1) x n!
    x (n + 1) plans a model. Seed 0."""
    for tokens in range(1, scope.tokens + 1):
        for layout, config in every_shared_config(scope):
            for prefix_tokens in range(1, tokens - 1):
                for nodes in range(1, min(tokens - prefix_tokens - 1, TREE_ENUMERATED_NODES) + 1):
                    after = tokens - prefix_tokens - nodes
                    for prefix, parents in itertools.product(
                        list(kvscope.compositions(prefix_tokens)), list(kvtree.every_parents(nodes))
                    ):
                        for accepted in ((), *tree_paths(parents)):
                            yield SharedTreePlan(
                                config=config,
                                dtype=scope.dtype,
                                batch=layout.batch,
                                prefix=prefix,
                                parents=parents,
                                accepted=accepted,
                                after=after,
                                token_seed=0,
                            )


SHARED_ROWS = Property(
    "shared layers through rows",
    "layers that read an earlier layer's cache through append_rows compute what each row "
    "alone computes, uncached, through rollbacks and rows leaving",
    check_shared_rows,
    shared_rows_plans(),
    failures.WRONG_RESULTS,
    requires=("append_rows",),
    min_batch=2,
    pinned=(ROWS_PAST_A_LAYER,),
    reaches=SHARED_ROWS_EDGES,
    since="1.6",
    every_plan=every_shared_rows_plan,
    exhaustive_tokens=6,
    holds=(
        "a shared model's batch of 2 or 3 rows through `forward_rows`: prompts of their own lengths"
        " (an empty slot, pads poisoned with nan, inf, -inf or 1e30, first positions of their own "
        "where `reset_at` is offered), then decode steps, chunks, per-row rollbacks "
        "(`truncate_rows`) and rows leaving or reordered (`select_rows`) on the source layers where"
        " offered, each followed by a feed; every row's new logits equal that row alone through the"
        " uncached model over the same sharing (contract, section 10.3; where `append_rows` is "
        "offered)"
    ),
)

SHARED_TREE = Property(
    "shared layers under a tree",
    "layers that read an earlier layer's cache verify a draft tree under the same tree mask, "
    "and read the committed path after",
    check_shared_tree,
    shared_tree_plans(),
    failures.WRONG_RESULTS,
    requires=("tree",),
    pinned=(TREE_PAST_A_LAYER,),
    reaches=SHARED_TREE_EDGES,
    since="1.6",
    every_plan=every_shared_tree_plan,
    exhaustive_tokens=6,
    holds=(
        "a shared model's prefix, then a draft tree (up to 6 nodes, siblings and several roots) "
        "through `forward_tree`: each node's logits equal the uncached model's on the prefix and "
        "the node's path; one path committed on the source layers, then 1 or 2 decode steps equal "
        "the uncached model's on the prefix, the path and the steps (contract, section 10.3; where "
        "`append_tree` is offered)"
    ),
)


class SharedLayersTests(KitTests):
    """Layers that share a cache, declared by the model: every cache runs it; through rows of
    their own and trees where the cache offers them."""

    test_layers_sharing_a_cache_equal_the_uncached_model = property_test(SHARED_LAYERS)
    test_shared_layers_through_rows_of_their_own = property_test(SHARED_ROWS)
    test_shared_layers_under_a_tree = property_test(SHARED_TREE)
