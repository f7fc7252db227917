"""The tensors the kit writes into caches and the models it runs them under: token ids, rows
of keys and values, poison, each from a seed of its own; and the reference model on the
kit's device.

Plans (``kvcheck.strategies``) hold seeds and kinds, never tensors, so that Hypothesis
shrinks how many tokens and in which calls, not numbers; the tensors are made here when a
plan runs. Beside noise, each kind of tokens or rows is one a cache that reads lengths or
identity from its contents goes wrong on (all-zero rows, one row repeated, rows equal across
the batch, the dtype's finite extremes).
"""

from __future__ import annotations

import functools

import torch

from kvcheck import devices as kvdevices
from kvref import CacheSpec, ModelConfig, ReferenceTransformer
from kvref.model import ZERO_TOKEN

POISON_VALUES = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"), "huge": 1e30}


def build_model(config: ModelConfig, dtype: torch.dtype) -> ReferenceTransformer:
    """The reference model for ``config`` in ``dtype`` on the kit's device."""
    return _build_model(config, dtype, kvdevices.current())


@functools.lru_cache(maxsize=64)
def _build_model(config: ModelConfig, dtype: torch.dtype, device) -> ReferenceTransformer:
    # Models are pure functions of (config, dtype); building one per example would dominate.
    return ReferenceTransformer(config, dtype=dtype, device=device)


# --- tokens, through a model ---------------------------------------------------------------


def random_tokens(config: ModelConfig, batch: int, length: int, seed: int) -> torch.Tensor:
    """Token ids from a seed of their own, so that no test depends on the global RNG (drawn
    on the CPU, so that every device gets the same ones), on the kit's device."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (batch, length), generator=generator)
    return tokens.to(kvdevices.current())


# What the rows a session writes look like, beside noise. The first layer's keys and values
# depend on the token alone (values) or the token and its position (keys), and token 0
# embeds to zeros (kvref.model.ZERO_TOKEN), so:
# - "padding": every other token is 0: all-zero key and value rows in the first layer;
# - "repeated": one token throughout: equal value rows at every position;
# - "rows alike": every batch row the same tokens: rows equal across the batch.
TOKEN_KINDS = ("random", "padding", "repeated", "rows alike")


def tokens_of_kind(
    kind: str, config: ModelConfig, batch: int, length: int, seed: int
) -> torch.Tensor:
    """``random_tokens`` shaped as ``kind`` (one of ``TOKEN_KINDS``) says."""
    tokens = random_tokens(config, batch, length, seed)
    if kind == "padding":
        tokens[:, ::2] = ZERO_TOKEN
    elif kind == "repeated":
        tokens[:] = tokens[:1, :1]
    elif kind == "rows alike":
        tokens[:] = tokens[:1]
    elif kind != "random":
        raise ValueError(f"tokens must be one of {TOKEN_KINDS}, got {kind!r}")
    return tokens


# --- rows, straight into a cache -------------------------------------------------------------


def random_rows(spec: CacheSpec, rows: int, seed: int, *, values: bool = False) -> torch.Tensor:
    """Keys (or with ``values``, values: ``spec.value_width`` wide) for ``rows`` new tokens:
    normal noise, so every row is distinct."""
    return _noise(spec, rows, seed, values).to(device=spec.device, dtype=spec.dtype)


def _noise(spec: CacheSpec, rows: int, seed: int, values: bool) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    shape = (spec.batch, spec.kv_heads, rows, spec.value_width if values else spec.head_dim)
    return torch.randn(shape, generator=generator, dtype=torch.float64)


# What the rows a cache-level plan appends look like (``CachePlan.rows``), beside noise:
# - "zeros": every other row all zeros (a padding token's, in a first layer);
# - "repeated": one row throughout, in every append;
# - "alike": every batch row and every kv head the same rows;
# - "extremes": every number the dtype's largest finite magnitude or its smallest normal
#   one, of either sign: a sum or a digest of a row overflows, a sentinel value is hit, a
#   cast to a narrower dtype turns them to inf or zero. Only a cache that holds its rows as
#   given is written these (``extremes_allowed``).
ROW_KINDS = ("random", "zeros", "repeated", "alike", "extremes")


def rows_of_kind(
    kind: str, spec: CacheSpec, rows: int, seed: int, *, values: bool = False
) -> torch.Tensor:
    """``random_rows`` shaped as ``kind`` (one of ``ROW_KINDS``) says."""
    if kind == "repeated":
        seed = int(values)  # the same row in every append, the keys' not the values'
    noise = _noise(spec, rows, seed, values)
    if kind == "zeros":
        noise[:, :, ::2] = 0
    elif kind == "repeated":
        noise[:] = noise[:, :, :1]
    elif kind == "alike":
        noise[:] = noise[:1, :1]
    elif kind == "extremes":
        finfo = torch.finfo(spec.dtype)
        # About half of the numbers the largest, half the smallest normal, signs as drawn.
        largest, smallest = (torch.full_like(noise, value) for value in (finfo.max, finfo.tiny))
        noise = torch.where(noise.abs() > 0.67, largest, smallest) * noise.sign()
    elif kind != "random":
        raise ValueError(f"rows must be one of {ROW_KINDS}, got {kind!r}")
    return noise.to(device=spec.device, dtype=spec.dtype)


def extremes_allowed(lossy: object, sinks: int) -> bool:
    """Whether a cache is written rows at the dtype's extremes: not one that holds rows in
    codes (``lossy``: its declared bound is over a finite range, and a range of the
    largest magnitude of either sign is not one), nor one that keeps sinks (it re-rotates
    keys, which multiplies them)."""
    return lossy is None and not sinks


def as_values(spec: CacheSpec, keys: torch.Tensor, factor: float = 1.0) -> torch.Tensor:
    """Values for the rows ``keys``: ``factor`` x ``keys``, their channels repeated or cut
    to ``spec.value_width`` where values are of another width (a latent cache's), so that a
    row of values stays as distinct from the others as its key."""
    width = spec.value_width
    if keys.shape[-1] != width:
        keys = keys.repeat(1, 1, 1, -(-width // keys.shape[-1]))[..., :width]
    return keys * factor


# --- poison: what a reset must shed -----------------------------------------------------------


def poison_value(kind: str, dtype: torch.dtype) -> float:
    """The value rows of ``kind`` are full of: "huge" is 1e30, or the largest finite value
    of a dtype that cannot hold it (float16)."""
    return (
        min(POISON_VALUES[kind], torch.finfo(dtype).max) if kind == "huge" else POISON_VALUES[kind]
    )


def poison_rows(spec: CacheSpec, rows: int, kind: str, *, values: bool = False) -> torch.Tensor:
    """Keys (or values) for ``rows`` tokens, every one ``kind`` (nan, inf, -inf or huge):
    what a reset must shed."""
    shape = (spec.batch, spec.kv_heads, rows, spec.value_width if values else spec.head_dim)
    return torch.full(shape, poison_value(kind, spec.dtype), dtype=spec.dtype, device=spec.device)
