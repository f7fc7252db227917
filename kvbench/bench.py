"""The bench every table is measured on: one reference model, one batch of random tokens and
each layer's keys and values of them, prefilled once and shared by every row; how a cache is
filled from them, and the least memory the model's caches may hold (the "formula")."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils import benchmark

import kvimpl
from kvbench import timing
from kvbench.workload import Workload
from kvref import CacheFactory, LayerCache, ReferenceTransformer, min_nbytes
from kvref.protocol import keys_stored
from kvref.quantized import storage

PREFILL_CHUNK = 64  # tokens per append when a cache is filled before a timed step


def fill(cache: LayerCache, key: Tensor, value: Tensor) -> None:
    """Append ``key`` and ``value`` to ``cache`` in chunks, as an engine's chunked prefill: a
    window cache then holds the window and one chunk, not the whole prefill."""
    for start in range(0, key.shape[2], PREFILL_CHUNK):
        end = min(start + PREFILL_CHUNK, key.shape[2])
        cache.append(key[:, :, start:end], value[:, :, start:end])


def formula_bytes(
    model: ReferenceTransformer, batch: int, length: int, cache: LayerCache | None = None
) -> int:
    """2 x layers x B x H_kv x rows x D x itemsize, rows being L or, with a window, W - 1:
    what the model's caches must hold at least; under ``cache``'s declared lossy storage
    (contract, 10.1), with every row in codes but the declared recent run."""
    declared = storage(cache)
    in_codes = tuple(part.coded_rows(length) if part else 0 for part in declared)
    layers = range(model.config.num_layers)
    return sum(
        min_nbytes(model.cache_spec(batch, length, layer=layer), length, declared, in_codes)
        for layer in layers
    )


class Bench:
    """One model, one batch of tokens and their keys and values, shared by every row."""

    def __init__(self, workload: Workload, device: torch.device, threads: int) -> None:
        self.workload = workload
        self.device = device
        self.threads = threads
        self.model = ReferenceTransformer(workload.config, dtype=workload.dtype, device=device)
        generator = torch.Generator().manual_seed(0)
        shape = (workload.batch, max(workload.lengths))
        tokens = torch.randint(workload.config.vocab_size, shape, generator=generator)
        self.tokens = tokens.to(device)
        self.keys_values = self._prefill(kvimpl.ConcatCache)
        self._kept_unrotated: list[tuple[Tensor, Tensor]] | None = None

    def _prefill(self, factory: CacheFactory, chunk: int = PREFILL_CHUNK):
        """Each layer's keys (as ``factory``'s caches keep them) and values of all the tokens,
        a chunk of them at a time.

        In one pass the model would hold (batch, heads, L, L) scores, gigabytes at 4096 tokens,
        and that would be the peak RSS reported for every row.
        """
        caches = self.model.new_caches(
            factory, batch=self.workload.batch, max_length=self.tokens.shape[1]
        )
        for start in range(0, self.tokens.shape[1], chunk):
            self.model(self.tokens[:, start : start + chunk], caches)
        held = self.tokens.shape[1]  # all of a ConcatCache, and a preallocated one's buffer
        return [(cache.key[:, :, :held], cache.value[:, :, :held]) for cache in caches]

    def kept(self, cache: LayerCache) -> list[tuple[Tensor, Tensor]]:
        """The keys and values to fill ``cache`` with: rotated, or for a cache that keeps keys
        unrotated (contract, section 8.4) as they were before RoPE (prefilled when first
        asked for)."""
        if keys_stored(cache) == "rotated":
            return self.keys_values
        if self._kept_unrotated is None:
            self._kept_unrotated = self._prefill(kvimpl.UnrotatedCache)
        return self._kept_unrotated

    def request(
        self, factory: CacheFactory, length: int, max_length: int, number: int, decode=True
    ) -> list[LayerCache]:
        """One request's caches holding ``length`` tokens of batch row ``number``: a chunked
        prefill of all but the last, and the last decoded through the model (or, without
        ``decode``, a prefill of all of them)."""
        row = number % self.workload.batch
        caches = self.model.new_caches(factory, batch=1, max_length=max_length)
        filled = length - 1 if decode else length
        for (key, value), cache in zip(self.kept(caches[0]), caches, strict=True):
            fill(cache, key[row : row + 1, :, :filled], value[row : row + 1, :, :filled])
        if decode:
            self.model(self.tokens[row : row + 1, length - 1 : length], caches)
        return caches

    def timer(self, step: Callable[[], object], restore: Callable[[], object]) -> benchmark.Timer:
        """A timer of ``step`` on this bench's device and threads, ``restore`` off the clock."""
        return timing.timer(step, restore, self.device, self.threads)
