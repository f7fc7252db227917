"""The public cache protocol: what a key/value cache for one decoder layer must do.

This module is a contract with users; ``docs/contract.md`` states every rule and how the
suite checks it. In short:

- ``append(key, value)`` takes tensors shaped (batch, kv_heads, T, head_dim), T >= 1, of the
  spec's dtype and device, copies them, and returns every row appended since the last reset,
  oldest first, each exactly as given (views are fine until the next call). With
  ``spec.window = W`` it may return only a recent run: at least the last W - 1 rows before
  the new ones and the new ones (``CacheSpec.rows_needed``).
- ``length`` grows by exactly T per append; ``reset()`` makes it 0, and nothing written
  before a reset may influence a later result. Caches from one factory share no rows.
- At least ``spec.max_length`` tokens fit; past that a cache may refuse, never drop, wrap or
  overwrite (a window cache drops only positions no later query can see).
- Bad input raises ``ValueError`` (or a subclass; ``TypeError`` is also fine for an argument
  that is not a tensor) whose message names the problem in the implementer's own words, and
  leaves the cache exactly as it was. T = 0 may be refused or accepted as a no-op.
- ``nbytes`` is what the cache really reserves: at least 2 x B x H_kv x rows x D x itemsize,
  rows being ``length``, or min(length, W - 1) with a window.
- Optional capabilities (``truncate``, ``reorder``, ``fork``, ``attend``) are offered by
  having the method.

This module holds the core every cache meets: ``CacheSpec``, ``LayerCache``,
``CacheFactory``, ``CacheContractError`` and the rules of which rows a cache keeps. Beside
it, one idea each: the optional capabilities' declarations (``kvref.capabilities``), the
argument checks offered to implementers (``kvref.checks``: ``check_append`` and, for the
optional capabilities, ``check_truncate``, ``check_reorder``, ``check_attend`` ..., so that a
cache can reject bad input with clear messages in one call; using them is optional, keeping
the rules is not), block pools (``kvref.pools``), tensor-parallel shards (``kvref.shards``),
moved rows (``kvref.moves``), lossy storage (``kvref.quantized``) and the bytes a cache
reserves (``kvref.memory``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from kvref.reprs import short_repr


@dataclass(frozen=True)
class Shard:
    """One tensor-parallel rank's share of an attention layer (contract, section 11.1): the
    global ids of the kv heads its caches hold and of the query heads it computes, in the
    order its output has them, of a layer of ``num_kv_heads`` kv heads."""

    rank: int
    world: int
    kv_heads: tuple[int, ...]
    query_heads: tuple[int, ...]
    num_kv_heads: int

    @property
    def replicated(self) -> bool:
        """Whether other ranks hold its kv heads too (kv heads fewer than ranks)."""
        return self.num_kv_heads < self.world


@short_repr
@dataclass(frozen=True)
class CacheSpec:
    """What a cache is built for: keys shaped (batch, kv_heads, length, head_dim) and values
    (batch, kv_heads, length, value_width): ``value_dim``, or ``head_dim`` where it is None."""

    batch: int
    kv_heads: int
    head_dim: int
    max_length: int  # the most tokens this cache will be asked to hold
    dtype: torch.dtype
    device: torch.device
    window: int | None = None  # sliding-window layer: a query at p sees keys p-window+1..p
    # Attention sinks beside the window (contract, section 8.5): every query also sees the
    # session's first ``sinks`` tokens. Only with a window; 0 for every spec the kit builds
    # for a cache that declares none.
    sinks: int = 0
    # The model's RoPE base, for a cache that rotates keys itself (context shift, section 8.4).
    rope_base: float = 10_000.0
    # A latent (MLA) layer's values are wider than its keys (contract, section 10.2): the
    # compressed latent beside the small rope key. None, the values are ``head_dim`` wide;
    # the kit sets it only for a cache that declares ``supports: {"latent": True}``.
    value_dim: int | None = None
    # The tensor-parallel rank this cache serves (contract, section 11.1): its share of the
    # layer's heads, ``kv_heads`` of them; None outside a sharded run. A cache may ignore it.
    shard: Shard | None = None

    @property
    def value_width(self) -> int:
        """The width of a value row: ``value_dim``, or ``head_dim`` where it is None."""
        return self.head_dim if self.value_dim is None else self.value_dim

    def __post_init__(self) -> None:
        if self.value_dim is not None and not (is_count(self.value_dim) and self.value_dim):
            raise ValueError(
                f"CacheSpec.value_dim must be None or an int >= 1, got {self.value_dim!r}"
            )
        if self.window is not None and (
            isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1
        ):
            raise ValueError(f"CacheSpec.window must be None or an int >= 1, got {self.window!r}")
        if not is_count(self.sinks):
            raise ValueError(f"CacheSpec.sinks must be an int >= 0, got {self.sinks!r}")
        if self.sinks and self.window is None:
            raise ValueError(f"CacheSpec.sinks is {self.sinks}: sinks need a window")

    def rows_needed(self, length: int, new_tokens: int = 0) -> int:
        """The fewest rows a cache holding ``length`` tokens may keep (0 new tokens) or return
        after an append of ``new_tokens`` of them (``rows_needed``)."""
        return rows_needed(self.window, length, new_tokens, self.sinks)


def rows_needed(window: int | None, length: int, new_tokens: int = 0, sinks: int = 0) -> int:
    """The fewest rows a layer with ``window`` holding ``length`` tokens may keep (0 new
    tokens) or return after an append of ``new_tokens`` of them: all of them without a
    window, else the last W - 1 before the new ones (every new query's whole window) and
    the new ones, and the first ``sinks`` (section 8.5) where they are not among those."""
    if window is None:
        return length
    return min(length, sinks + window - 1 + new_tokens)


def kept_rows(sinks: int, held: int, total: int) -> list[int]:
    """Which of ``total`` tokens a cache returning ``held`` rows returns, as indices since
    the reset, oldest first: the first ``sinks`` (section 8.5), then the most recent run
    (rule 7). Without sinks, the last ``held``."""
    first = min(sinks, held)
    return [*range(first), *range(total - (held - first), total)]


@runtime_checkable
class LayerCache(Protocol):
    """Keys and values of ONE decoder layer, each shaped (batch, kv_heads, length, head_dim)."""

    @property
    def length(self) -> int:
        """Tokens appended since the last reset (the next position); a plain int."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes of key+value storage currently reserved."""
        ...

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """Store T new rows; return the rows kept for attention, oldest first (views valid
        until the next call): every row since the reset, or with ``spec.window`` a recent
        contiguous run of at least ``spec.rows_needed(length, T)`` rows ending with the T new."""
        ...

    def reset(self) -> None:
        """Empty again, ready for an unrelated prompt."""
        ...


CacheFactory = Callable[[CacheSpec], LayerCache]  # a class taking a CacheSpec qualifies


class CacheContractError(ValueError):
    """Caches handed to the reference model that break the protocol or do not fit the call:
    the wrong number of them, one object for two layers, layers of different lengths, a
    spec for another batch, or an ``append`` that returned the wrong number of rows.

    Raised before any cache changes where it can be (all but the last, which is only known
    after ``append``). A subclass of ``ValueError``, so that callers who passed bad caches
    see the error they expect; the suite tells it apart from a caller's bad token ids.
    """


def is_count(value: object) -> bool:
    """An int >= 0 (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# How a cache keeps keys (section 8.4): rotated at their positions as the model hands them (the
# default), or as they were before RoPE, the model rotating what the cache returns.
KEYS_STORED = ("rotated", "unrotated")


def keys_stored(cache: object) -> str:
    """``cache.keys_stored``, "rotated" where it says nothing."""
    return getattr(cache, "keys_stored", "rotated")
