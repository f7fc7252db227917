"""The scope of a bounded-exhaustive run, and the vocabulary its enumerations are written in.

A random search says "no counterexample in 2,000 examples". Within a small scope the kit can
say more: every plan of a property up to ``Scope.tokens`` tokens, on a few of the smallest
models that still have every feature a cache can get wrong (``LAYOUTS``), holds. Each
property enumerates its own plans (``Property.every_plan(scope)``, beside its strategy in
its area module), smallest first, with the helpers below; ``kvcheck.exhaustive`` runs them.
What "proved" means and does not mean is in docs/exhaustive.md.

The helpers count what they yield in closed form (tests/test_exhaustive.py holds them to it):

- ``compositions(n)``: every split of ``n`` tokens into a prefill and decode chunks, 2^(n-1):
  the walks of the grammar's feeds (``kvcheck.interplay.every_walk``), which every
  enumeration that feeds tokens splits them by;
- ``splits(most)``: every composition of 1 to ``most`` tokens, 2^most - 1;
- ``orders(counts)``: every interleaving of requests' steps, the multinomial coefficient;
- ``first_use_order(labels)``: the symmetry collapse of labels (requests, sequences) that a
  correct cache cannot tell apart but by the order they first appear in.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from kvcheck import interplay
from kvcheck import sizes as kvsizes
from kvcheck import strategies as kvst
from kvref import ModelConfig


@dataclass(frozen=True)
class Layout:
    """A model and batch of the scope: the smallest with the features named in its ``why``."""

    layers: int
    heads: int
    kv_heads: int
    batch: int
    head_dim: int = 2
    window: int | None = None  # a sliding window on even layers (odd ones global)
    why: str = ""

    def config(self, **fields) -> ModelConfig:
        """The reference model of this layout: fixed weights (seed 0), a small vocabulary;
        ``fields`` for what a property's plan needs beside it (sinks, shared layers)."""
        window = {"window": self.window, "window_layers": "alternate"} if self.window else {}
        return ModelConfig(
            vocab_size=16,
            num_layers=self.layers,
            num_heads=self.heads,
            num_kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            ffn_dim=8,
            seed=0,
            **{**window, **fields},
        )

    def describe(self) -> str:
        window = f", window {self.window} on even layers" if self.window else ""
        return (
            f"{self.layers} layer{'s' * (self.layers > 1)}, {self.heads} heads over "
            f"{self.kv_heads} kv heads of width {self.head_dim}{window}, batch {self.batch}"
        )


# The models a scope enumerates, smallest first. Each is there for a class of bug the
# others cannot show: one layer and one row (positions and lengths alone); two kv heads in
# two rows over two layers (a transpose of heads and tokens, rows mixed, a layer's cache
# read for another); two query heads per kv head (a GQA expansion in the wrong order,
# repeat for repeat_interleave, which needs two kv heads to show); a window on one of two
# layers (a ring buffer's wrap, a window applied to the wrong layer).
LAYOUTS = (
    Layout(1, 1, 1, 1, why="positions and lengths alone"),
    Layout(2, 2, 2, 2, why="heads, rows and layers kept apart"),
    Layout(2, 4, 2, 2, why="query heads grouped over kv heads"),
    Layout(2, 2, 2, 1, window=2, why="a window on one layer of two"),
)


@dataclass(frozen=True)
class Scope:
    """What a bounded-exhaustive run enumerates: every plan of up to ``tokens`` tokens (every
    token it feeds, over all its sessions and requests), with up to ``requests`` requests at
    once, on each of ``layouts``, in ``dtype``; weights and tokens fixed (seed 0)."""

    tokens: int
    layouts: tuple[Layout, ...] = LAYOUTS
    dtype: torch.dtype = torch.float64
    requests: int = 2

    def __post_init__(self) -> None:
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens < 1:
            raise ValueError(f"an exhaustive scope needs 1 or more tokens, got {self.tokens!r}")
        if not self.layouts:
            raise ValueError("an exhaustive scope needs at least one layout")

    @classmethod
    def within_domain(cls, tokens: int, dtypes: tuple[torch.dtype, ...] = kvst.WITH_HALF) -> Scope:
        """The scope for the cache under test (``kvcheck.sizes.domain``): its layouts moved
        inside what it supports (its head widths, kv heads, groups, batch, windows) and
        float64 where it computes in it, else the first of ``dtypes`` it does."""
        domain = kvsizes.domain()
        judged = kvst.supported_dtypes(dtypes, dtypes)
        dtype = torch.float64 if torch.float64 in judged else (judged or (torch.float64,))[0]
        layouts = tuple(dict.fromkeys(moved for lay in LAYOUTS if (moved := inside(lay, domain))))
        return cls(tokens, layouts=layouts or (LAYOUTS[0],), dtype=dtype)

    def describe(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{len(self.layouts)} models, {dtype}, weights and tokens of seed 0"

    def as_json(self) -> dict:
        return {
            "tokens": self.tokens,
            "requests": self.requests,
            "dtype": str(self.dtype).removeprefix("torch."),
            "models": [layout.describe() for layout in self.layouts],
            "weights and tokens": "fixed (seed 0)",
        }


def inside(layout: Layout, domain: kvsizes.Domain) -> Layout | None:
    """``layout`` with its sizes moved to the nearest the domain supports, or None where it
    cannot show what it is there for (a window the cache does not take)."""
    if layout.window is not None and domain.windows is False:
        return None
    head_dim = nearest(layout.head_dim, domain.head_dims)
    kv_heads = nearest(layout.kv_heads, domain.kv_heads)
    group = nearest(layout.heads // layout.kv_heads, domain.groups)
    batch = min(layout.batch, domain.max_batch or layout.batch)
    return dataclasses.replace(
        layout, head_dim=head_dim, kv_heads=kv_heads, heads=kv_heads * group, batch=batch
    )


def nearest(value: int, supported: tuple[int, ...] | None) -> int:
    """``value`` where supported (or nothing is declared), else the smallest supported above
    it, else the largest below."""
    if not supported or value in supported:
        return value
    above = [size for size in supported if size > value]
    return min(above) if above else max(supported)


def every_indices(batch: int) -> Iterator[tuple[int, ...]]:
    """Every index tuple of a reorder of ``batch`` rows, repeats and the identity too:
    batch^batch."""
    return itertools.product(range(batch), repeat=batch)


def compositions(n: int) -> tuple[tuple[int, ...], ...]:
    """Every way to feed ``n`` tokens in order as chunks (a prefill, then decode chunks):
    the walks of the grammar's feeds (``kvcheck.interplay.FEEDS``: a prefill of any length,
    then decodes and chunks) of exactly ``n`` tokens, the tokens each brings, fewest chunks
    first. 2^(n-1) of them, one per subset of the n-1 places between tokens where a chunk
    ends."""
    walks = interplay.every_walk(frozenset(), n, 1, kinds=interplay.FEEDS)
    fed = [interplay.tokens_fed(walk) for walk in walks]
    return tuple(sorted((chunks for chunks in fed if sum(chunks) == n), key=len))


def splits(most: int, least: int = 1) -> Iterator[tuple[int, ...]]:
    """Every composition of ``least`` to ``most`` tokens, fewest tokens first: 2^most -
    2^(least-1) of them."""
    for n in range(least, most + 1):
        yield from compositions(n)


def orders(counts: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """Every interleaving of the steps of requests ``0..K-1``, request ``i`` taking
    ``counts[i]`` steps in its own order: (sum counts)! / prod(counts[i]!) of them."""
    total = sum(counts)
    if total == 0:
        yield ()
        return
    left = list(counts)

    def extend(prefix: list[int]) -> Iterator[tuple[int, ...]]:
        if len(prefix) == total:
            yield tuple(prefix)
            return
        for request, remaining in enumerate(left):
            if remaining:
                left[request] -= 1
                prefix.append(request)
                yield from extend(prefix)
                prefix.pop()
                left[request] += 1

    yield from extend([])


def first_use_order(labels: Sequence[int]) -> bool:
    """Whether ``labels`` (the request or sequence each step is on) first use 0, then 1, and
    so on: one representative per class of sequences equal up to renaming the labels.

    The collapse is sound where the labels are names alone: requests built alike whose
    caches the kit makes in the order they are first used, sequences an engine keeps apart
    by id. A cache that treats one name unlike another is outside it (docs/exhaustive.md)."""
    seen = -1
    for label in labels:
        if label > seen + 1:
            return False
        seen = max(seen, label)
    return True


def scenario(layout: Layout, scope: Scope, sessions: Sequence[kvst.Session], **config):
    """The ``kvcheck.strategies.Scenario`` of ``sessions`` on ``layout``, in the scope's
    dtype, its buffers ending where its longest session does (``slack`` 0: the exact end)."""
    return kvst.Scenario(
        config=layout.config(**config),
        batch=layout.batch,
        dtype=scope.dtype,
        sessions=tuple(sessions),
    )
