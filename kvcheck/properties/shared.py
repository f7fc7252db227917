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

- ``shared layers``: every cache.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from hypothesis import strategies as st

from kvcheck import asserts as kvassert
from kvcheck import devices as kvdevices
from kvcheck import failures, reach
from kvcheck import sizes as kvsizes
from kvcheck import strategies as kvst
from kvcheck.harness import builder, record
from kvcheck.kit import KitTests, Property, property_test
from kvcheck.session import assert_logits
from kvref import CacheFactory, ModelConfig

MOST_TOKENS = 2 * kvst.EDGE + 1  # past two 16-row blocks: chunks straddle them


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
def kv_sources(draw, config: ModelConfig) -> tuple[int | None, ...]:
    """Which earlier layer each layer reads (None: its own cache), at least one reader: each
    layer may read any earlier layer that has a cache of its own and the same window (the
    last layers reading one source, alternate layers reading the one before, and the rest)."""

    def attends(layer: int) -> tuple:
        return config.layer_window(layer), config.layer_sinks(layer)

    sources: list[int | None] = [None] * config.num_layers
    for layer in range(1, config.num_layers):
        eligible = [j for j in range(layer) if sources[j] is None and attends(j) == attends(layer)]
        sources[layer] = draw(st.sampled_from([None, *eligible]), label=f"layer {layer} reads")
    if all(source is None for source in sources):  # the last layer that can read, reads
        pairs = [
            (layer, j)
            for layer in range(1, config.num_layers)
            for j in range(layer)
            if attends(j) == attends(layer)
        ]
        if pairs:
            layer, source = pairs[-1]
            sources[layer] = source
    return tuple(sources)


@st.composite
def shared_plans(draw) -> SharedPlan:
    config = draw(
        kvst.model_configs(min_layers=2, max_layers=3, tokens=MOST_TOKENS), label="config"
    )
    if config.num_layers == 2:  # alternate windows would leave no layer one it can read
        config = dataclasses.replace(config, window_layers="all")
    config = dataclasses.replace(config, kv_sources=draw(kv_sources(config), label="kv_sources"))
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
    model = kvst.build_model(plan.config, plan.dtype)
    tokens = kvst.random_tokens(plan.config, plan.batch, plan.tokens, plan.token_seed)
    expected = model(tokens)
    truth = functools.cache(lambda: kvst.build_model(plan.config, torch.float64)(tokens))
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
)


class SharedLayersTests(KitTests):
    """Layers that share a cache, declared by the model: every cache runs it."""

    test_layers_sharing_a_cache_equal_the_uncached_model = property_test(SHARED_LAYERS)
