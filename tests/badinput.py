"""Bad input and what must follow it: a clear error, and nothing changed.

``BAD_APPENDS`` and ``BAD_CALLS`` are tables of bad input for ``LayerCache.append`` and for
the model called with caches, each with the error it must raise and a regex its message must
match. The checks apply one to a state built from a drawn plan (a cache at a random length;
a model's caches after a random prefill, a random layer made inconsistent) and read the
caches back: same length, and the same rows, bit for bit, as before the bad call.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from kvref import CacheFactory, CacheSpec, ModelConfig, ReferenceTransformer
from tests import checks as kvchk
from tests import scenarios as kvst

OVERFLOW_WORDS = r"overflow|capacity|max_length|exceed|full"


@dataclass(frozen=True)
class BadInput:
    name: str
    make: Callable  # builds the bad arguments from good ones
    error: type[Exception]
    message: str  # a regex the error message must match: it has to name the problem

    def __str__(self) -> str:
        return self.name


def other_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype == torch.float64 else torch.float64


def grow(tensor: torch.Tensor, axis: int) -> torch.Tensor:
    """One more entry along ``axis``: a copy of the first."""
    return torch.cat((tensor, tensor.narrow(axis, 0, 1)), dim=axis)


BAD_APPENDS = [
    BadInput("key of rank 3", lambda k, v: (k[..., 0], v), ValueError, r"\brank\b|ndim"),
    BadInput("value of rank 5", lambda k, v: (k, v[None]), ValueError, r"\brank\b|ndim"),
    BadInput(
        "value with one token more than key",
        lambda k, v: (k, grow(v, 2)),
        ValueError,
        r"differ|mismatch|match",
    ),
    BadInput("wrong batch", lambda k, v: (grow(k, 0), grow(v, 0)), ValueError, r"batch"),
    BadInput(
        "wrong kv_heads", lambda k, v: (grow(k, 1), grow(v, 1)), ValueError, r"kv_heads|kv heads"
    ),
    BadInput(
        "wrong head_dim", lambda k, v: (grow(k, 3), grow(v, 3)), ValueError, r"head_dim|head dim"
    ),
    BadInput(
        "zero new tokens",
        lambda k, v: (k[:, :, :0], v[:, :, :0]),
        ValueError,
        r"zero|empty|T = 0|at least",
    ),
    BadInput(
        "wrong dtype",
        lambda k, v: (k.to(other_dtype(k.dtype)), v.to(other_dtype(v.dtype))),
        ValueError,
        r"dtype",
    ),
    BadInput(
        "wrong dtype of value only", lambda k, v: (k, v.to(torch.float16)), ValueError, r"dtype"
    ),
    BadInput("wrong device", lambda k, v: (k.to("meta"), v.to("meta")), ValueError, r"device"),
    BadInput("key not a tensor", lambda k, v: (k.tolist(), v), TypeError, r"[Tt]ensor"),
    BadInput("value not a tensor", lambda k, v: (k, v.numpy()), TypeError, r"[Tt]ensor"),
]


def raised_by(call: Callable) -> Exception | None:
    try:
        call()
    except Exception as error:  # which exception is what the callers check
        return error
    return None


def assert_rejected(call: Callable, case: BadInput, where: str) -> None:
    error = raised_by(call)
    assert error is not None, f"{case}: accepted without an error{where}"
    assert isinstance(error, case.error), (
        f"{case}: expected {case.error.__name__}, got {type(error).__name__}: {error}{where}"
    )
    assert re.search(case.message, str(error)), (
        f"{case}: the message does not name the problem (expected to match "
        f"{case.message!r}): {str(error)!r}{where}"
    )


def assert_unchanged(cache: kvchk.WatchedCache, spec: CacheSpec, *, layer: int, at: str) -> None:
    """Same length, and a read-back append returns the rows held before, then the new one."""
    assert cache.length == cache.held_length, (
        f"layer {layer}: length is {cache.length} after a rejected call, was "
        f"{cache.held_length}{at}"
    )
    row = kvst.random_rows(spec, 1, seed=cache.held_length)
    cache.append(row, -row)
    kvchk.assert_returned_what_is_held(cache, layer=layer, at=f" (reading back){at}")


def check_bad_append(factory: CacheFactory, case: BadInput, plan: kvst.CachePlan, new_tokens: int):
    """``case`` applied to a warm cache raises its error and changes nothing."""
    cache = kvchk.warm(factory, plan)
    good = kvst.random_rows(plan.spec, new_tokens, seed=7)
    key, value = case.make(good, good.clone())
    at = f"\n  at {plan.describe()}"
    assert_rejected(lambda: cache.cache.append(key, value), case, at)
    assert_unchanged(cache, plan.spec, layer=0, at=at)


def check_overflow(factory: CacheFactory, plan: kvst.CachePlan, tokens_over: int) -> None:
    """Past max_length a cache may refuse or grow, but never drop, wrap or overwrite."""
    cache = kvchk.warm(factory, plan)
    rows = plan.spec.max_length - cache.held_length + tokens_over
    new = kvst.random_rows(plan.spec, rows, seed=rows)
    at = f"\n  at {rows} tokens appended to {plan.describe()}"
    error = raised_by(lambda: cache.append(new, new * 2))
    if error is None:
        assert cache.length == cache.held_length, (
            f"overflow accepted but length is {cache.length}, not {cache.held_length}{at}"
        )
        kvchk.assert_returned_what_is_held(cache, layer=0, at=at)
        return
    assert isinstance(error, ValueError), f"overflow refused with {error!r}, not ValueError{at}"
    assert re.search(OVERFLOW_WORDS, str(error)), (
        f"overflow refused, but the message does not say so: {str(error)!r}{at}"
    )
    assert_unchanged(cache, plan.spec, layer=0, at=at)


@dataclass
class ModelState:
    """A model, its watched caches after a prefill and some decode steps, and good next tokens."""

    model: ReferenceTransformer
    caches: list[kvchk.WatchedCache]
    spare: kvchk.WatchedCache  # one more cache from the same factory, never used
    spec: CacheSpec
    tokens: torch.Tensor
    layer: int  # the layer a case may make inconsistent

    def describe(self) -> str:
        return (
            f"{len(self.caches)} layers holding {self.caches[0].held_length} tokens each "
            f"(caches built for {self.spec}); layer picked: {self.layer}"
        )


@dataclass(frozen=True)
class ModelPlan:
    """What a ModelState is built from: a model, a batch, the chunks fed, a layer, a seed."""

    config: ModelConfig
    dtype: torch.dtype
    batch: int
    chunks: tuple[int, ...]
    layer: int
    token_seed: int

    def build(self, factory: CacheFactory) -> ModelState:
        model = kvst.build_model(self.config, self.dtype)
        fed = sum(self.chunks)
        spec = model.cache_spec(self.batch, max_length=fed + 3)  # room to break and read back
        caches = [kvchk.WatchedCache(factory(spec)) for _ in range(self.config.num_layers)]
        generator = torch.Generator().manual_seed(self.token_seed)
        history = torch.randint(
            0, self.config.vocab_size, (self.batch, fed + 2), generator=generator
        )
        start = 0
        for size in self.chunks:
            model(history[:, start : start + size], caches=caches)
            start += size
        spare = kvchk.WatchedCache(factory(spec))
        return ModelState(model, caches, spare, spec, history[:, start:], self.layer)


@st.composite
def model_plans(draw) -> ModelPlan:
    config = draw(kvst.model_configs(min_layers=2, max_layers=3))
    max_total = kvst.DEFAULT_CHUNK_SIZE + 1
    return ModelPlan(
        config=config,
        dtype=draw(st.sampled_from(kvst.DTYPES)),
        batch=draw(st.integers(1, 3)),
        chunks=tuple(draw(kvst.chunk_plans(max_total, min_chunks=1, max_chunks=3))),
        layer=draw(st.integers(0, config.num_layers - 1)),
        token_seed=draw(st.integers(0, 2**16)),
    )


def with_token(tokens: torch.Tensor, token: int) -> torch.Tensor:
    bad = tokens.clone()
    bad[-1, -1] = token
    return bad


def lengthen(state: ModelState) -> list:
    row = kvst.random_rows(state.spec, 1, seed=1)
    state.caches[state.layer].append(row, row)
    return state.caches


def empty(state: ModelState) -> list:
    state.caches[state.layer].reset()
    return state.caches


BAD_CALLS = [
    BadInput("one cache too few", lambda s: (s.tokens, s.caches[:-1]), ValueError, r"number"),
    BadInput(
        "one cache too many", lambda s: (s.tokens, [*s.caches, s.spare]), ValueError, r"number"
    ),
    BadInput(
        "one object for two layers",
        lambda s: (s.tokens, [s.caches[0], *s.caches[:-1]]),
        ValueError,
        r"same",
    ),
    BadInput(
        "layers of different lengths", lambda s: (s.tokens, lengthen(s)), ValueError, r"length"
    ),
    BadInput("some layers empty, some not", lambda s: (s.tokens, empty(s)), ValueError, r"empty"),
    BadInput(
        "caches built for another batch size",
        lambda s: (grow(s.tokens, 0), s.caches),
        ValueError,
        r"batch",
    ),
    BadInput("token ids of rank 1", lambda s: (s.tokens[0], s.caches), ValueError, r"rank"),
    BadInput("token ids of rank 3", lambda s: (s.tokens[None], s.caches), ValueError, r"rank"),
    BadInput("float token ids", lambda s: (s.tokens.double(), s.caches), ValueError, r"dtype"),
    BadInput("uint8 token ids", lambda s: (s.tokens.byte(), s.caches), ValueError, r"dtype"),
    BadInput(
        "token id past the vocabulary",
        lambda s: (with_token(s.tokens, s.model.config.vocab_size), s.caches),
        ValueError,
        r"vocabulary",
    ),
    BadInput(
        "negative token id",
        lambda s: (with_token(s.tokens, -1), s.caches),
        ValueError,
        r"vocabulary",
    ),
    BadInput("no token ids", lambda s: (s.tokens[:, :0], s.caches), ValueError, r"empty"),
    BadInput(
        "token ids not a tensor", lambda s: (s.tokens.tolist(), s.caches), TypeError, r"[Tt]ensor"
    ),
]


def check_bad_model_call(factory: CacheFactory, case: BadInput, plan: ModelPlan) -> None:
    """``case`` raises its error before any cache changes."""
    state = plan.build(factory)
    tokens, caches = case.make(state)
    at = f"\n  at {state.describe()}"
    assert_rejected(lambda: state.model(tokens, caches=caches), case, at)
    for layer, cache in enumerate([*state.caches, state.spare]):
        assert_unchanged(cache, state.spec, layer=layer, at=at)


def check_every_bad_append(factory: CacheFactory, plan: kvst.CachePlan, new_tokens: int) -> None:
    """Every case of BAD_APPENDS, each on a fresh cache warmed by ``plan``."""
    for case in BAD_APPENDS:
        check_bad_append(factory, case, plan, new_tokens)


def check_every_bad_model_call(factory: CacheFactory, plan: ModelPlan) -> None:
    """Every case of BAD_CALLS, each on fresh caches warmed by ``plan``."""
    for case in BAD_CALLS:
        check_bad_model_call(factory, case, plan)
