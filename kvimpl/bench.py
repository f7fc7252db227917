"""Decode cost, memory and scaling of every cache, side by side, on one reference model.

    python -m kvimpl.bench                        # every built-in cache at 256, 1024, 4096 tokens
    python -m kvimpl.bench --quick --out /tmp/b   # a small model, in seconds
    python -m kvimpl.bench --kv-impl preallocated --kv-impl mypkg.caches:MyCache

How one decode step at context L is timed: each layer's cache is given the rotated keys and
values of the first L - 1 tokens in appends of 64 (a chunked prefill), then one model call
with token L is timed: it appends one row (or, for a cache with ``attend``, hands it the row
and the query) and attends to L keys. Each call grows the cache, so before every timed call
the cache is put back at L - 1 tokens while the clock is paused: by ``truncate(L - 1)`` when
the cache has it, else by a reset and the same appends. Before timing, each cache decodes
token L twice (after its prefill and after being put back) and must match the ideal.
torch.utils.benchmark still warms up, picks a block size and repeats, but only decode steps
at exactly context L are on the clock. The rows of one length take turns, a share of the time
each per round, so a change in the machine's load falls on all of them alike. The chunked and
paged built-ins are timed with blocks of ``--block-size`` tokens (default 256): their
``attend`` pays a fixed cost per block.

Besides the caches there are two rows: `ideal`, the same step with the keys and values of all
L tokens already in place and no bookkeeping at all (the floor a cache can approach), and
`uncached`, the model recomputing all L tokens to decode the last one.

Beside every built-in (no ``--kv-impl``), the compressed arm: ``quantized`` (int8 codes) on
the same model, and ``latent`` on an MLA model of the same sizes (``latent_config``) with an
ideal of its own, ``ideal (MLA)``. Each is held to the formula of what it declares
(``kvref.min_nbytes`` with its storage, or the MLA model's spec: "x formula"), and before
timing its logits must be within the budget the kit holds its storage to (the lossy one of
``kvcheck.asserts`` for codes, 1e-4 for a latent kept as given).

Then requests of batch 1 and different lengths are held side by side (requests.csv): on one
paged pool, whose blocks in use are compared with the sum of the requests' own formulas, and
on every other cache (``preallocated`` reserving the longest request's length for each); and
samples forked from one prompt on one pool, sharing the prompt's blocks.

Then the same requests' next token in one step (batch.csv): on one batched cache whose rows
hold lengths of their own (``append_rows``, contract section 8.1), one call for every
request, against the requests on caches of their own, one call each.

Last, many requests opening with one long system prompt (shared_prefix.csv), served in turn
and held side by side: on one paged pool with prefix caching (contract section 9.1: each
request looks its prompt up and prefills only the rest), on the same kind of pool without
lookups, and on separate preallocated caches. The prefills of all the requests are timed
as one statement, each time on fresh caches (and a fresh pool, so the first request misses)
whose storage was allocated off the clock; the ways must first give the same logits, for
every prompt's last token and every decoded one.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import resource
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from functools import partial
from pathlib import Path

import torch
from torch import Tensor
from torch.utils import benchmark

import kvimpl
from kvcheck import asserts as kvassert
from kvcheck import selection
from kvcheck.harness import coarser
from kvimpl.latent import LatentCache
from kvimpl.quantized import QuantizedCache
from kvref import CacheFactory, LayerCache, ModelConfig, ReferenceTransformer, min_nbytes
from kvref.protocol import keys_stored
from kvref.quantized import storage
from kvref.rows import row_slots


@dataclass(frozen=True)
class SharedPrefix:
    """Requests that open with one system prompt, each then its own prompt and a few
    decoded tokens: the shared-prefix workload (shared_prefix.csv)."""

    requests: int
    system: int  # tokens of the system prompt every request starts with
    own: int  # tokens of each request's own prompt after it
    decode: int  # tokens each request then decodes, one model call each


@dataclass(frozen=True)
class Workload:
    """The model every cache is timed on, and how long to time each row."""

    config: ModelConfig
    batch: int
    lengths: tuple[int, ...]
    min_run_time: float  # seconds of timed decode steps per row
    rounds: int  # the rows of one length take turns this many times
    # Context lengths of requests of batch 1 decoding side by side on one paged pool (cut to
    # the longest of ``lengths``); the second is also the prompt that samples fork from.
    requests: tuple[int, ...]
    shared_prefix: SharedPrefix  # requests opening with one system prompt
    dtype: torch.dtype = torch.float32


# Big enough that attention over the cache, not the fixed per-token work, dominates at 4096.
FULL = Workload(
    ModelConfig(1024, num_layers=4, num_heads=8, num_kv_heads=8, head_dim=64, ffn_dim=2048),
    batch=4,
    lengths=(256, 1024, 4096),
    min_run_time=2.0,
    rounds=5,
    requests=(4096, 1536, 512, 64),
    shared_prefix=SharedPrefix(requests=16, system=512, own=32, decode=4),
)
QUICK = Workload(
    ModelConfig(64, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=16, ffn_dim=64),
    batch=2,
    lengths=(16, 64, 256),
    min_run_time=0.05,
    rounds=2,
    requests=(256, 100, 33, 5),
    shared_prefix=SharedPrefix(requests=4, system=40, own=6, decode=3),
)


# The compressed arm (docs/compressed.md): caches that hold less than the full-precision
# formula, each held to the formula of what it declares. Lossy storage on the grouped-query
# model; a latent cache on an MLA model of the same sizes (``latent_config``).
LOSSY: dict[str, CacheFactory] = {"quantized": QuantizedCache}
LATENT: dict[str, CacheFactory] = {"latent": LatentCache}
FULL_PRECISION, COMPRESSED = "full precision", "compressed"
GQA, MLA = "grouped-query", "MLA"

MIB = 2**20
PREFILL_CHUNK = 64  # tokens per append when a cache is filled before a timed step
BLOCK_SIZE = 256  # tokens per block (chunk) of the paged (chunked) built-in while timed
QUICK_BLOCK_SIZE = 16
SAMPLES = 4  # samples forked from one prompt, each then decoding SAMPLE_TOKENS of its own
SAMPLE_TOKENS = 64


@dataclass
class Row:
    """One line of results.csv: a cache (or `ideal`, `uncached`) at one context length."""

    cache: str
    length: int
    ms_per_token: float | None  # median over samples; None when not timed
    ms_spread: float | None  # interquartile range of the same samples
    samples: int  # timed blocks; blocked_autorange picks how many steps make one
    nbytes: int  # summed over layers, after the timed step (the cache holds L tokens)
    # 2 x layers x batch x kv_heads x rows x head_dim x itemsize; rows: L, or W - 1 with a
    # window (kvref.min_nbytes): the least any cache can hold
    formula_bytes: int
    peak_rss_bytes: int  # the whole process's high-water mark (ru_maxrss) when the row was done
    note: str = ""
    # The compressed arm's formula is its own: kvref.min_nbytes with the cache's declared
    # storage (rows in codes but the recent run), or the MLA model's spec for a latent cache.
    arm: str = FULL_PRECISION
    model: str = GQA  # the model it decodes on; "x ideal" is against that model's ideal


@dataclass
class Timed:
    """A row of the decode table, ready: its timer and caches, and what its row reports."""

    timer: benchmark.Timer
    caches: list[LayerCache]
    formula_bytes: int
    arm: str
    model: str


@dataclass
class RequestRow:
    """One line of requests.csv: requests of batch 1 held side by side, and their memory."""

    scenario: str
    cache: str
    requests: str  # the tokens each request holds, e.g. 4096+1536+512+64
    # Memory the requests hold: a paged pool's nbytes_in_use (a shared block once), else
    # the sum of the caches' nbytes.
    in_use_bytes: int
    formula_bytes: int  # the sum of every request's own formula (kvref.min_nbytes)
    reserved_bytes: int  # a pool's nbytes_reserved (free blocks included), else as in use
    note: str = ""


@dataclass
class BatchRow:
    """One line of batch.csv: the next token of every request, in one step."""

    scenario: str  # one batch of rows of their own, or separate caches
    cache: str
    requests: str  # the tokens each request holds, e.g. 4096+1536+512+64
    ms_per_step: float  # median over samples of the step (every request's next token)
    ms_spread: float | None  # interquartile range of the same samples
    samples: int
    nbytes: int  # summed over layers (and requests), after the step
    formula_bytes: int  # the sum of every request's own formula (kvref.min_nbytes)


@dataclass
class PrefixRow:
    """One line of shared_prefix.csv: the requests of the shared-prefix workload, one way."""

    scenario: str  # prefix caching, one pool without lookups, or separate caches
    cache: str
    requests: str  # requests x system prompt + own prompt + decoded tokens, e.g. 16 x 512+32+4
    prompt_tokens: int  # summed over requests
    hit_tokens: int | None  # of those, found by prefix lookups; None without lookups
    prefill_ms: float  # median over samples of every request's prefill (and lookup), in turn
    ms_spread: float | None  # interquartile range of the same samples
    samples: int
    # Keys and values at the busiest moment (every request held, after its decode): a pool's
    # nbytes_in_use (a shared block once), else the sum of the caches' nbytes.
    peak_bytes: int
    formula_bytes: int  # the sum of every request's own formula (kvref.min_nbytes)
    note: str = ""


@dataclass
class Served:
    """The shared-prefix workload served one way, untimed: what is checked and reported."""

    logits: Tensor  # (requests, 1 + decode, vocab): each prompt's last token, each decoded
    hits: list[int]  # per request, the tokens its lookup found (0 without lookups)
    peak_bytes: int  # as PrefixRow's
    peak_blocks: int  # a pool's blocks in use at the same moment; 0 for other caches


class IdealCache:
    """The floor: keys and values of the whole context already in place, no bookkeeping.

    It claims to hold all but the last of ``length + 1`` tokens, so the model decodes the
    last position, and its append hands back its tensors without reading or storing what it
    is given: all the rows, or with a window only the last W, all that the query can see.
    A timing fixture, not a cache to move (no ``export_rows``: contract, section 11.2).
    """

    def __init__(self, key: Tensor, value: Tensor, length: int) -> None:
        self.key, self.value, self._length = key, value, length

    @property
    def length(self) -> int:
        return self._length

    @property
    def nbytes(self) -> int:
        return self.key.nbytes + self.value.nbytes

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        return self.key, self.value

    def reset(self) -> None:
        pass


class DecodeClock:
    """A perf_counter that stops while caches are put back, so only decode steps count."""

    def __init__(self, device: torch.device) -> None:
        self._paused = 0.0
        self._sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None

    def now(self) -> float:
        self._sync()  # queued GPU work belongs to the step that queued it
        return time.perf_counter() - self._paused

    def off_the_clock(self, action: Callable[[], object]) -> None:
        start = self.now()
        action()
        self._paused += self.now() - start


def peak_rss_bytes() -> int:
    """The process's peak resident set size so far: ru_maxrss, in KiB on Linux, bytes on macOS."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


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


def latent_config(config: ModelConfig) -> ModelConfig:
    """An MLA model of the benchmark's sizes (contract, 10.2) in DeepSeek-V3's proportions:
    each head's no-rope key channels as wide as its value, a rope key half that, a latent 4
    heads wide; cached calls on the absorbed path, the one decode kernels take."""
    width = config.head_dim
    return replace(
        config,
        attention="mla",
        num_kv_heads=1,
        latent_dim=4 * width,
        rope_dim=width // 2,
        nope_dim=width,
        mla_path="absorbed",
    )


def fill(cache: LayerCache, key: Tensor, value: Tensor) -> None:
    """Append ``key`` and ``value`` to ``cache`` in chunks, as an engine's chunked prefill: a
    window cache then holds the window and one chunk, not the whole prefill."""
    for start in range(0, key.shape[2], PREFILL_CHUNK):
        end = min(start + PREFILL_CHUNK, key.shape[2])
        cache.append(key[:, :, start:end], value[:, :, start:end])


def _padded(keys: Tensor, values: Tensor, counts: list[int], cache: LayerCache):
    """``keys`` and ``values``, whose row b has its new rows in its first ``counts[b]`` slots,
    laid out as ``cache`` takes them: as they are, or with left padding in its last slots
    (contract, section 8.1)."""
    padding = getattr(cache, "padding", "right")
    if padding == "right":
        return keys, values
    laid = (torch.zeros_like(keys), torch.zeros_like(values))
    for b, count in enumerate(counts):
        slots = row_slots(padding, keys.shape[2], count)
        for out, given in zip(laid, (keys, values), strict=True):
            out[b, :, slots] = given[b, :, :count]
    return laid


def take_back(cache: LayerCache, length: int) -> bool:
    """Put ``cache`` back at ``length`` tokens with its ``truncate``, if it has one that
    accepts; the untimed check step has compared a decode after this with the ideal's.
    Refilling instead costs seconds per timed step at 4096 tokens for a cache whose
    ``append`` joins its history."""
    if not callable(getattr(cache, "truncate", None)):
        return False
    try:
        cache.truncate(length)
    except ValueError:  # e.g. a window cache that has dropped what the next query needs
        return False
    return True


class Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total: int) -> None:
        self.total, self.done = total, 0

    def show(self, doing: str) -> None:
        filled = 30 * self.done // self.total
        bar = "#" * filled + "." * (30 - filled)
        sys.stderr.write(f"\r[{bar}] {self.done}/{self.total} {doing:<36}")
        sys.stderr.flush()

    def advance(self, doing: str) -> None:
        self.done += 1
        self.show(doing)
        if self.done == self.total:
            sys.stderr.write("\n")


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

    def decode_setup(
        self, factories: dict[str, CacheFactory], length: int, ideal: str = "ideal"
    ) -> dict[str, Timed]:
        """The ideal (labelled ``ideal``) and every cache of ``factories``, filled with the
        first ``length - 1`` tokens and checked (``_check_against_ideal``), each with a timer
        of decoding token ``length``."""
        caches = {
            label: self.model.new_caches(factory, batch=self.workload.batch, max_length=length)
            for label, factory in factories.items()
        }
        caches = {ideal: self._ideal_caches(length), **caches}
        restores = {label: self._restore(layers, length) for label, layers in caches.items()}
        self._check_against_ideal(caches, restores, length, ideal)
        model = MLA if self.model.config.attention == "mla" else GQA
        step = partial(self.model, self.tokens[:, length - 1 : length])
        setups = {}
        for label, layers in caches.items():
            lossy = storage(layers[0]) != (None, None)
            setups[label] = Timed(
                self._timer(partial(step, layers), restores[label]),
                layers,
                formula_bytes(self.model, self.workload.batch, length, layers[0]),
                COMPRESSED if lossy or model == MLA else FULL_PRECISION,
                model,
            )
        return setups

    def decode_rows(self, setups: dict[str, Timed], length: int, progress: Progress) -> list[Row]:
        """Time decoding token ``length`` on every row of ``setups`` (of this bench and of
        others), taking turns."""
        rounds = self.workload.rounds
        parts: dict[str, list[benchmark.Measurement]] = {label: [] for label in setups}
        for round_number in range(1, rounds + 1):
            for label, setup in setups.items():
                share = self.workload.min_run_time / rounds
                parts[label].append(setup.timer.blocked_autorange(min_run_time=share))
            progress.advance(f"{length} tokens, round {round_number} of {rounds}")
        return [
            self._row(
                label,
                length,
                benchmark.Measurement.merge(parts[label])[0],
                nbytes=sum(cache.nbytes for cache in setup.caches),
                formula=setup.formula_bytes,
                arm=setup.arm,
                model=setup.model,
            )
            for label, setup in setups.items()
        ]

    def _check_against_ideal(
        self,
        caches: dict[str, list[LayerCache]],
        restores: dict[str, Callable[[], None]],
        length: int,
        ideal: str = "ideal",
    ) -> None:
        """A fast wrong cache is no result: each must decode token ``length`` as the ideal does,
        from its first fill and again after being put back as before every timed call; at
        1e-4, or for a cache that declares lossy storage within its budget as the kit holds
        it (``kvcheck.asserts``, contract 10.1)."""
        new_token = self.tokens[:, length - 1 : length]
        expected = self.model(new_token, caches[ideal])
        for label, layers in caches.items():
            declared = coarser(*storage(layers[0]))
            for when in ("after its prefill", "after being put back"):
                what = (
                    f"{label} decodes token {length} unlike the ideal row ({when}), so its "
                    f"timing would mean nothing; run the test suite on it."
                )
                decoded = self.model(new_token, layers)
                if declared is None:
                    torch.testing.assert_close(
                        decoded,
                        expected,
                        rtol=1e-4,
                        atol=1e-4,
                        msg=lambda report, what=what: f"{what}\n{report}",
                    )
                else:
                    kvassert.assert_within_budget(
                        decoded,
                        expected,
                        None,
                        what=what,
                        where=f"the logits of token {length}",
                        position_axis=1,
                        lossy=declared,
                    )
                restores[label]()

    def request_rows(self, factories: dict[str, CacheFactory], block_size: int) -> list[RequestRow]:
        """Memory of requests of different lengths held side by side, and of samples forked
        from one prompt: on one fresh paged pool, and on each of ``factories`` (the other
        caches reserve per request, ``preallocated`` the longest request's length)."""
        longest = self.tokens.shape[1]
        lengths = [min(length, longest) for length in self.workload.requests]
        mixed = "+".join(map(str, lengths))
        rows = []
        others = {label: factory for label, factory in factories.items() if label != "paged"}
        for label, factory in {"paged": kvimpl.PagedPool(block_size), **others}.items():
            requests = [
                self._request(factory, length, max(lengths), r) for r, length in enumerate(lengths)
            ]
            rows.append(self._request_row("mixed lengths", label, mixed, factory, requests))
        own = min(SAMPLE_TOKENS, longest // 2)  # tokens each sample adds to the prompt
        prompt = min(lengths[1 % len(lengths)], longest - own)
        pool = kvimpl.PagedPool(block_size)
        shared = self._request(pool, prompt, prompt, 0)
        samples = [[cache.fork() for cache in shared] for _ in range(SAMPLES)]
        del shared  # the samples hold the prompt's blocks now
        for number, caches in enumerate(samples):
            row = number % self.workload.batch  # another row's keys: a continuation of its own
            for (key, value), cache in zip(self.kept(caches[0]), caches, strict=True):
                own_rows = (slice(row, row + 1), slice(None), slice(prompt, prompt + own))
                fill(cache, key[own_rows], value[own_rows])
        scenario = f"{SAMPLES} samples forked from one prompt"
        tokens = "+".join([str(prompt + own)] * SAMPLES)
        rows.append(self._request_row(scenario, "paged", tokens, pool, samples))
        return rows

    def _request(
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

    def _request_row(
        self,
        scenario: str,
        label: str,
        tokens: str,
        factory: CacheFactory,
        requests: list[list[LayerCache]],
    ) -> RequestRow:
        formula = sum(formula_bytes(self.model, 1, caches[0].length) for caches in requests)
        held = sum(cache.nbytes for caches in requests for cache in caches)
        if isinstance(factory, kvimpl.PagedPool):
            in_use, reserved = factory.nbytes_in_use, factory.nbytes_reserved
            note = "" if held == in_use else f"the caches' nbytes: {held / 2**20:.1f} MiB"
            return RequestRow(scenario, label, tokens, in_use, formula, reserved, note)
        return RequestRow(scenario, label, tokens, held, formula, held)

    def batch_rows(self, factories: dict[str, CacheFactory]) -> list[BatchRow]:
        """The requests' next token in one step: on one batched cache of each factory that
        offers rows of their own (``append_rows``), and on caches of their own from the same
        factory (each built, as the batch is, for the longest request)."""
        longest = self.tokens.shape[1]
        lengths = [min(length, longest) for length in self.workload.requests]
        offering = {
            label: factory
            for label, factory in factories.items()
            if callable(getattr(factory(self.model.cache_spec(1, 1)), "append_rows", None))
        }
        rows = []
        for label, factory in offering.items():
            batched, alone = (
                self._batched(factory, lengths),
                [
                    self._request(factory, length - 1, max(lengths), number, decode=False)
                    for number, length in enumerate(lengths)
                ],
            )
            rows.append(self._batch_step(label, lengths, batched, alone))
        return [row for pair in rows for row in pair]

    def _batched(self, factory: CacheFactory, lengths: list[int]) -> list[LayerCache]:
        """One cache per layer for every request side by side, row r holding the first
        ``lengths[r] - 1`` tokens of batch row r (appended a chunk per call, each row its
        own count)."""
        caches = self.model.new_caches(factory, batch=len(lengths), max_length=max(lengths))
        rows = [number % self.workload.batch for number in range(len(lengths))]
        held = [length - 1 for length in lengths]
        for (key, value), cache in zip(self.kept(caches[0]), caches, strict=True):
            for start in range(0, max(held), PREFILL_CHUNK):
                counts = [max(0, min(PREFILL_CHUNK, n - start)) for n in held]
                chunk = slice(start, start + PREFILL_CHUNK)
                keys, values = (
                    torch.stack([t[row, :, chunk] for row in rows]) for t in (key, value)
                )
                cache.append_rows(*_padded(keys, values, counts, cache), counts)
        return caches

    def _batch_step(
        self,
        label: str,
        lengths: list[int],
        batched: list[LayerCache],
        alone: list[list[LayerCache]],
    ) -> tuple[BatchRow, BatchRow]:
        """Time every request's next token: one ``forward_rows`` call on ``batched``, or one
        model call per request on ``alone``; each put back off the clock (``truncate_rows``,
        ``truncate``), after an untimed step of each that must agree."""
        rows = [number % self.workload.batch for number in range(len(lengths))]
        last = zip(rows, lengths, strict=True)
        new = torch.stack([self.tokens[row, length - 1] for row, length in last])
        held = tuple(length - 1 for length in lengths)
        counts = (1,) * len(lengths)

        def in_one_batch() -> Tensor:
            return self.model.forward_rows(new[:, None], counts, batched)

        def each_alone() -> list[Tensor]:
            return [self.model(new[r : r + 1, None], caches) for r, caches in enumerate(alone)]

        def put_back_batch() -> None:
            for cache in batched:
                cache.truncate_rows(held)

        def put_back_alone() -> None:
            for caches, length in zip(alone, held, strict=True):
                for cache in caches:
                    cache.truncate(length)

        torch.testing.assert_close(
            in_one_batch()[:, 0], torch.cat(each_alone())[:, 0], rtol=1e-4, atol=1e-4
        )
        put_back_batch()
        put_back_alone()
        timers = {
            "one batch, rows of their own": (self._timer(in_one_batch, put_back_batch), batched),
            "separate caches": (self._timer(each_alone, put_back_alone), alone),
        }
        parts: dict[str, list[benchmark.Measurement]] = {scenario: [] for scenario in timers}
        for _ in range(self.workload.rounds):
            for scenario, (timer, _) in timers.items():
                share = self.workload.min_run_time / self.workload.rounds
                parts[scenario].append(timer.blocked_autorange(min_run_time=share))
        formula = sum(formula_bytes(self.model, 1, length) for length in lengths)
        tokens = "+".join(map(str, lengths))
        out = []
        for scenario, (_, caches) in timers.items():
            measured = benchmark.Measurement.merge(parts[scenario])[0]
            layers = caches if scenario.startswith("one") else [c for r in caches for c in r]
            spread = measured.iqr * 1000 if len(measured.times) > 1 else None
            out.append(
                BatchRow(
                    scenario,
                    label,
                    tokens,
                    measured.median * 1000,
                    spread,
                    len(measured.times),
                    sum(cache.nbytes for cache in layers),
                    formula,
                )
            )
        return out[0], out[1]

    def shared_prefix_rows(self, pool: Callable[[], kvimpl.PagedPool]) -> list[PrefixRow]:
        """The shared-prefix workload, three ways: on a fresh ``pool()`` with prefix caching
        (each request looks its prompt up, then prefills the rest), on another without
        lookups, and on separate preallocated caches (each built for its request's length).
        Each way first serves every request, prefill and decode, held side by side: its
        logits must agree with separate caches', and its busiest moment's memory is
        reported. Then the prefills alone are timed, the ways taking turns."""
        prompts, decoded = self._shared_prefix_tokens()
        ways = {  # scenario: cache, a fresh factory, whether each request looks its prompt up
            "prefix caching": ("paged", pool, True),
            "one pool, no lookups": ("paged", pool, False),
            "separate caches": ("preallocated", lambda: kvimpl.PreallocatedCache, False),
        }
        served = {
            scenario: self._serve(make(), lookups, prompts, decoded)
            for scenario, (_, make, lookups) in ways.items()
        }
        expected = served["separate caches"].logits
        for scenario, way in served.items():
            torch.testing.assert_close(
                way.logits,
                expected,
                rtol=1e-4,
                atol=1e-4,
                msg=lambda report, scenario=scenario, hits=way.hits: (
                    f"shared prefix: {scenario} computes the requests' logits unlike separate "
                    f"caches (hits per request {hits}), so its timing would mean nothing; run "
                    f"the test suite on it.\n{report}"
                ),
            )
        timers = {
            scenario: self._prefill_timer(make, lookups, prompts, served[scenario].peak_blocks)
            for scenario, (_, make, lookups) in ways.items()
        }
        parts: dict[str, list[benchmark.Measurement]] = {scenario: [] for scenario in timers}
        for _ in range(self.workload.rounds):
            for scenario, timer in timers.items():
                share = self.workload.min_run_time / self.workload.rounds
                parts[scenario].append(timer.blocked_autorange(min_run_time=share))
        shared = self.workload.shared_prefix
        tokens = f"{shared.requests} x {shared.system}+{shared.own}+{shared.decode}"
        length = shared.system + shared.own + shared.decode
        formula = shared.requests * formula_bytes(self.model, 1, length)
        rows = []
        for scenario, (cache, _, lookups) in ways.items():
            hits = served[scenario].hits
            note = ""
            if lookups:  # on a fresh pool the first request misses, and the others find alike
                first, *later = hits
                if len(set(later)) == 1:
                    note = f"hits: {first} for the first request, then {later[0]} each"
                else:
                    note = "hits: " + "+".join(map(str, hits))
            measured = benchmark.Measurement.merge(parts[scenario])[0]
            spread = measured.iqr * 1000 if len(measured.times) > 1 else None
            rows.append(
                PrefixRow(
                    scenario,
                    cache,
                    tokens,
                    prompts.numel(),
                    sum(hits) if lookups else None,
                    measured.median * 1000,
                    spread,
                    len(measured.times),
                    served[scenario].peak_bytes,
                    formula,
                    note,
                )
            )
        return rows

    def _shared_prefix_tokens(self) -> tuple[Tensor, Tensor]:
        """Every request's prompt, (requests, system + own): one system prompt, then tokens
        of its own; and the tokens each then decodes, (requests, decode)."""
        shared = self.workload.shared_prefix
        vocab = self.workload.config.vocab_size
        generator = torch.Generator().manual_seed(1)
        system = torch.randint(vocab, (1, shared.system), generator=generator)
        own = torch.randint(
            vocab, (shared.requests, shared.own + shared.decode), generator=generator
        )
        prompts = torch.cat([system.expand(shared.requests, -1), own[:, : shared.own]], dim=1)
        return prompts.to(self.device), own[:, shared.own :].to(self.device)

    def _request_caches(self, factory: CacheFactory) -> list[list[LayerCache]]:
        """Every request's caches, one per layer, each built for the request's length."""
        shared = self.workload.shared_prefix
        length = shared.system + shared.own + shared.decode
        return [
            self.model.new_caches(factory, batch=1, max_length=length)
            for _ in range(shared.requests)
        ]

    def _prefill_requests(
        self,
        factory: CacheFactory,
        lookups: bool,
        prompts: Tensor,
        requests: list[list[LayerCache]],
    ) -> tuple[list[int], list[Tensor]]:
        """Each request's prompt into its empty caches, in turn: looked up in the pool (with
        ``lookups``), the rest prefilled. Returns each request's hit and its prompt's last
        logits, (1, vocab)."""
        hits, logits = [], []
        for prompt, caches in zip(prompts, requests, strict=True):
            hit = 0
            if lookups:
                # All but the last token, as engines look up: the model must compute the last
                # token's logits, so a hit never covers it. It is declared after the hit.
                hit = factory.lookup_prefix(caches, prompt[None, :-1])
                for cache in caches:
                    cache.declare_tokens(prompt[None, -1:])
            hits.append(hit)
            logits.append(self.model(prompt[None, hit:], caches)[:, -1])
        return hits, logits

    def _serve(
        self, factory: CacheFactory, lookups: bool, prompts: Tensor, decoded: Tensor
    ) -> Served:
        """Every request in turn, held side by side: its prompt (``_prefill_requests``), then
        its decoded tokens, one call each."""
        requests = self._request_caches(factory)
        hits, first = self._prefill_requests(factory, lookups, prompts, requests)
        pooled = isinstance(factory, kvimpl.PagedPool)
        logits, peak_bytes, peak_blocks = [], 0, 0
        for number, (caches, last, tokens) in enumerate(zip(requests, first, decoded, strict=True)):
            steps = [last]
            for token in tokens:
                if lookups:  # declared before their rows are appended (contract, 9.1)
                    for cache in caches:
                        cache.declare_tokens(token.view(1, 1))
                steps.append(self.model(token.view(1, 1), caches)[:, -1])
            logits.append(torch.stack(steps, dim=1))
            held = (cache.nbytes for done in requests[: number + 1] for cache in done)
            peak_bytes = max(peak_bytes, factory.nbytes_in_use if pooled else sum(held))
            peak_blocks = max(peak_blocks, factory.blocks_in_use if pooled else 0)
        return Served(torch.cat(logits), hits, peak_bytes, peak_blocks)

    def _prefill_timer(
        self, make: Callable[[], CacheFactory], lookups: bool, prompts: Tensor, blocks: int
    ) -> benchmark.Timer:
        """A timer of every request's prefill (``_prefill_requests``) on fresh caches of a
        fresh ``make()``, built off the clock: storage is allocated before serving, as the
        decode rows' caches are built before timing and an engine allocates its pool at
        startup. A pool is grown to ``blocks`` (what its way takes) and given them back."""
        state: dict[str, object] = {}

        def fresh() -> None:
            state.clear()  # the last call's caches (and pool) go
            factory = make()
            if blocks:
                self._grow(factory, blocks)
            state.update(factory=factory, requests=self._request_caches(factory))

        def prefill_all() -> None:
            self._prefill_requests(state["factory"], lookups, prompts, state["requests"])

        return self._timer(prefill_all, fresh)

    def _grow(self, pool: kvimpl.PagedPool, blocks: int) -> None:
        """Make ``pool`` allocate storage for ``blocks`` blocks, then free them: a cache of it
        appends that many blocks of zeros and is reset (a pool keeps the storage it has
        grown; nothing is published, no tokens being declared)."""
        rows = blocks * pool.block_size
        spec = self.model.cache_spec(1, rows)
        shape = (1, spec.kv_heads, rows, spec.head_dim)
        zeros = torch.zeros(shape, dtype=spec.dtype, device=spec.device)
        cache = pool(spec)
        cache.append(zeros, zeros)
        cache.reset()

    def uncached_row(self, length: int) -> Row:
        """Time the model recomputing all ``length`` tokens, which is how it decodes the last."""
        timer = self._timer(partial(self.model, self.tokens[:, :length]), restore=lambda: None)
        measurement = timer.blocked_autorange(min_run_time=self.workload.min_run_time)
        return self._row("uncached", length, measurement, nbytes=0)

    def skipped_row(self, label: str, length: int, note: str) -> Row:
        return self._row(label, length, None, nbytes=0, note=note)

    def _ideal_caches(self, length: int) -> list[LayerCache]:
        window = self.workload.config.window or length
        first = max(length - window, 0)
        return [
            IdealCache(
                key[:, :, first:length].clone(), value[:, :, first:length].clone(), length - 1
            )
            for key, value in self.keys_values
        ]

    def _restore(self, caches: Sequence[LayerCache], length: int) -> Callable[[], None]:
        """Fill ``caches`` with the first ``length - 1`` tokens; return what puts them back
        there after a decode step (by ``truncate`` where it works, else by refilling)."""
        prefix = [
            (key[:, :, : length - 1], value[:, :, : length - 1])
            for key, value in self.kept(caches[0])
        ]

        def restore() -> None:
            for cache, (key, value) in zip(caches, prefix, strict=True):
                if cache.length == length and take_back(cache, length - 1):
                    continue
                cache.reset()
                fill(cache, key, value)

        restore()
        return restore

    def _timer(self, step: Callable[[], object], restore: Callable[[], object]) -> benchmark.Timer:
        """A timer of ``step`` that runs ``restore`` off the clock before each call."""
        clock = DecodeClock(self.device)
        return benchmark.Timer(
            stmt="clock.off_the_clock(restore); step()",
            globals={"clock": clock, "restore": restore, "step": step},
            timer=clock.now,
            num_threads=self.threads,
        )

    def _row(
        self,
        label: str,
        length: int,
        measurement: benchmark.Measurement | None,
        nbytes: int,
        note: str = "",
        formula: int | None = None,
        arm: str = FULL_PRECISION,
        model: str = GQA,
    ) -> Row:
        """A row of the decode table; ``formula`` by default the full-precision one."""
        samples = 0 if measurement is None else len(measurement.times)
        if samples == 1:
            note = "one sample: no spread"
        return Row(
            cache=label,
            length=length,
            ms_per_token=measurement.median * 1e3 if samples else None,
            ms_spread=measurement.iqr * 1e3 if samples > 1 else None,
            samples=samples,
            nbytes=nbytes,
            formula_bytes=formula or formula_bytes(self.model, self.workload.batch, length),
            peak_rss_bytes=peak_rss_bytes(),
            note=note,
            arm=arm,
            model=model,
        )


def run(
    workload: Workload, caches: dict[str, CacheFactory], args: argparse.Namespace
) -> tuple[list[Row], list[RequestRow], list[BatchRow], list[PrefixRow]]:
    progress = Progress(total=len(workload.lengths) * (workload.rounds + 1) + 2)
    progress.show(f"prefill of {max(workload.lengths)} tokens")
    device = torch.device(args.device)
    bench = Bench(workload, device, args.threads)
    latent = None
    if args.compressed:  # an MLA model of the same sizes, its own prefill
        latent = Bench(
            replace(workload, config=latent_config(workload.config)), device, args.threads
        )
    rows = []
    for length in workload.lengths:
        setups = bench.decode_setup({**caches, **(LOSSY if args.compressed else {})}, length)
        if latent is not None:
            setups |= latent.decode_setup(LATENT, length, ideal="ideal (MLA)")
        rows += bench.decode_rows(setups, length, progress)
    progress.show("requests side by side")
    request_rows = bench.request_rows(caches, args.block_size)
    batch_rows = bench.batch_rows(caches)
    progress.advance("requests side by side")
    prefix_rows = bench.shared_prefix_rows(partial(kvimpl.PagedPool, args.block_size))
    progress.advance("requests sharing a system prompt")
    # Last, so that its (batch, heads, L, L) scores do not set the peak RSS of the rows above.
    for length in workload.lengths:
        progress.show(f"uncached at {length} tokens")
        if length <= args.uncached_max_length:
            rows.append(bench.uncached_row(length))
        else:
            note = f"not timed: above --uncached-max-length {args.uncached_max_length}"
            rows.append(bench.skipped_row("uncached", length, note))
        progress.advance(f"uncached at {length} tokens")
    return rows, request_rows, batch_rows, prefix_rows


def write_csv(rows: Sequence[object], path: Path) -> None:
    with path.open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=[field.name for field in fields(type(rows[0]))])
        writer.writeheader()
        writer.writerows(asdict(row) for row in rows)


def markdown_table(rows: list[Row]) -> str:
    """The results as a Markdown table: readable on a terminal, pasteable into the README.
    Each row's "x ideal" is against the ideal of the model it decodes on, its "x formula"
    against its own formula (the compressed arm's: what it declares)."""
    ideal = ideals(rows)
    header = "cache,arm,length,ms/token,IQR ms,x ideal,samples,nbytes MiB,formula MiB,x formula"
    header += ",peak RSS MiB,note"
    lines = []
    for row in sorted(rows, key=lambda row: row.length):
        ms, spread = row.ms_per_token, row.ms_spread
        lines.append(
            [
                row.cache,
                row.arm if row.model == GQA else f"{row.arm} ({row.model} model)",
                str(row.length),
                "-" if ms is None else f"{ms:.3f}",
                "-" if spread is None else f"{spread:.3f}",
                "-" if ms is None else f"{ms / ideal[row.model, row.length]:.2f}",
                str(row.samples),
                f"{row.nbytes / MIB:.1f}",
                f"{row.formula_bytes / MIB:.1f}",
                "-" if not row.nbytes else f"{row.nbytes / row.formula_bytes:.2f}",
                f"{row.peak_rss_bytes / MIB:.0f}",
                row.note,
            ]
        )
    return markdown(header.split(","), lines, text_columns=(0, 1, 11))


def ideals(rows: list[Row]) -> dict[tuple[str, int], float | None]:
    """Each model's ideal ms per token, by (model, length)."""
    return {
        (row.model, row.length): row.ms_per_token for row in rows if row.cache.startswith("ideal")
    }


def requests_table(rows: list[RequestRow]) -> str:
    """The requests held side by side, as a Markdown table."""
    header = "scenario,cache,tokens per request,in use MiB,formula MiB,x formula,reserved MiB,note"
    lines = [
        [
            row.scenario,
            row.cache,
            row.requests,
            f"{row.in_use_bytes / MIB:.1f}",
            f"{row.formula_bytes / MIB:.1f}",
            f"{row.in_use_bytes / row.formula_bytes:.2f}",
            f"{row.reserved_bytes / MIB:.1f}",
            row.note,
        ]
        for row in rows
    ]
    return markdown(header.split(","), lines, text_columns=(0, 1, 2, 7))


def batch_table(rows: list[BatchRow]) -> str:
    """Every request's next token in one step, as a Markdown table: each batch against its
    requests on separate caches of the same factory."""
    alone = {row.cache: row.ms_per_step for row in rows if row.scenario == "separate caches"}
    header = "scenario,cache,tokens per request,ms per step,IQR ms,x separate,samples,nbytes MiB"
    header += ",formula MiB"
    lines = [
        [
            row.scenario,
            row.cache,
            row.requests,
            f"{row.ms_per_step:.3f}",
            "-" if row.ms_spread is None else f"{row.ms_spread:.3f}",
            f"{row.ms_per_step / alone[row.cache]:.2f}",
            str(row.samples),
            f"{row.nbytes / MIB:.1f}",
            f"{row.formula_bytes / MIB:.1f}",
        ]
        for row in rows
    ]
    return markdown(header.split(","), lines, text_columns=(0, 1, 2))


def shared_prefix_table(rows: list[PrefixRow]) -> str:
    """The shared-prefix workload, as a Markdown table: each way against separate caches."""
    alone = next(row.prefill_ms for row in rows if row.scenario == "separate caches")
    header = "scenario,cache,requests,prompt tokens,hit tokens,hit rate,prefill ms,IQR ms"
    header += ",x separate,samples,peak MiB,formula MiB,x formula,note"
    lines = [
        [
            row.scenario,
            row.cache,
            row.requests,
            str(row.prompt_tokens),
            "-" if row.hit_tokens is None else str(row.hit_tokens),
            "-" if row.hit_tokens is None else f"{row.hit_tokens / row.prompt_tokens:.2f}",
            f"{row.prefill_ms:.1f}",
            "-" if row.ms_spread is None else f"{row.ms_spread:.1f}",
            f"{row.prefill_ms / alone:.2f}",
            str(row.samples),
            f"{row.peak_bytes / MIB:.1f}",
            f"{row.formula_bytes / MIB:.1f}",
            f"{row.peak_bytes / row.formula_bytes:.2f}",
            row.note,
        ]
        for row in rows
    ]
    return markdown(header.split(","), lines, text_columns=(0, 1, 2, 13))


def markdown(header: list[str], lines: list[list[str]], text_columns: tuple[int, ...]) -> str:
    """A Markdown table, numbers right-aligned."""
    align = ["---" if column in text_columns else "---:" for column in range(len(header))]
    rows = ["| " + " | ".join(cells) + " |" for cells in [header, *lines]]
    return "\n".join([rows[0], "|" + "|".join(align) + "|", *rows[1:]])


def plot(rows: list[Row], title: str, path: Path) -> None:
    """ms per token against context length (log-log), and each cache relative to the ideal."""
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 4.5))
    FigureCanvasAgg(figure)  # draw with Agg: no display, no global pyplot state
    absolute, relative = figure.subplots(1, 2)
    for axes in (absolute, relative):  # more rows than the default cycle has colours
        axes.set_prop_cycle(color=colormaps["tab20"].colors)
    ideal = ideals(rows)
    for label in dict.fromkeys(row.cache for row in rows):
        timed = [row for row in rows if row.cache == label and row.ms_per_token is not None]
        lengths = [row.length for row in timed]
        # The floor, dashed and on top: a cache that reaches it would otherwise hide it.
        style = {"color": "black", "linestyle": "--", "zorder": 3} if label == "ideal" else {}
        if label == "ideal (MLA)":
            style = {"color": "grey", "linestyle": "--", "zorder": 3}
        ms = [row.ms_per_token for row in timed]
        absolute.plot(lengths, ms, marker="o", label=label, **style)
        if label != "uncached":  # hundreds of times the floor: it would flatten the rest
            ratios = [row.ms_per_token / ideal[row.model, row.length] for row in timed]
            relative.plot(lengths, ratios, marker="o", label=label, **style)
    lengths = sorted({row.length for row in rows})
    for axes in (absolute, relative):
        axes.set_xscale("log", base=2)
        axes.set_xticks(lengths, [str(length) for length in lengths])
        axes.set_xlabel("context length (tokens attended by the decoded token)")
        axes.grid(True, which="both", alpha=0.3)
        axes.legend()
    absolute.set_yscale("log")
    absolute.set_ylabel("ms per decoded token (median)")
    relative.set_ylabel("ms per token / ideal's ms per token")
    figure.suptitle(title, fontsize=10)
    figure.savefig(path, dpi=110, bbox_inches="tight")


def describe(workload: Workload, args: argparse.Namespace) -> str:
    c = workload.config
    threads = f"{args.threads} thread" + ("s" if args.threads > 1 else "")
    window = "" if c.window is None else f", window {c.window} on every layer"
    return (
        f"{c.num_layers} layers, {c.num_heads} heads ({c.num_kv_heads} kv) of {c.head_dim}"
        f"{window}, batch {workload.batch}, {str(workload.dtype).removeprefix('torch.')}, "
        f"{args.device}, {threads}, torch {torch.__version__}"
    )


def _positive(kind: type, text: str):
    try:
        number = kind(text)
    except ValueError:
        number = 0
    if not 0 < number < math.inf:  # also refuses nan
        raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}")
    return number


def _lengths(text: str) -> tuple[int, ...]:
    try:
        lengths = [int(part) for part in text.split(",")]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 2:
        # Length 1 would leave nothing to prefill: the decoded token would be the first.
        raise argparse.ArgumentTypeError(
            f"expected comma-separated context lengths, each >= 2 (e.g. 256,1024), got {text!r}"
        )
    return tuple(sorted(set(lengths)))


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, dict[str, CacheFactory]]:
    """The options, and the caches to time by label (every built-in unless --kv-impl)."""
    parser = argparse.ArgumentParser(
        prog="python -m kvimpl.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--kv-impl",
        action="append",
        default=[],
        metavar="NAME",
        help="cache to time: a built-in name or MODULE:ATTR (repeatable; default: KV_IMPL, "
        "comma-separated, else every built-in)",
    )
    parser.add_argument(
        "--lengths",
        type=_lengths,
        help="comma-separated context lengths (default 256,1024,4096; with --quick 16,64,256)",
    )
    parser.add_argument("--quick", action="store_true", help="a small model, done in seconds")
    parser.add_argument(
        "--block-size",
        type=partial(_positive, int),
        metavar="N",
        help=f"tokens per block of the paged built-in and per chunk of the chunked one (default "
        f"{BLOCK_SIZE}, their attend paying a fixed cost per block; with --quick "
        f"{QUICK_BLOCK_SIZE}, as the suite tests them)",
    )
    parser.add_argument(
        "--window",
        type=partial(_positive, int),
        default=None,
        metavar="W",
        help="sliding-window attention of W tokens on every layer (default: none); the "
        "window cache then holds W - 1 + one prefill chunk rows at any context",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("bench-out"), metavar="DIR", help="default ./bench-out"
    )
    parser.add_argument(
        "--threads",
        type=partial(_positive, int),
        default=1,
        help="torch threads while timing (default 1, for repeatable numbers; the setup before "
        "timing uses torch's default)",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--min-run-time",
        type=partial(_positive, float),
        metavar="SECONDS",
        help="timed decode steps per row (default 2; with --quick 0.05)",
    )
    parser.add_argument(
        "--uncached-max-length",
        type=partial(_positive, int),
        default=4096,
        metavar="N",
        help="time the uncached model only up to this context (default 4096; it is quadratic)",
    )
    args = parser.parse_args(argv)
    args.block_size = args.block_size or (QUICK_BLOCK_SIZE if args.quick else BLOCK_SIZE)
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out}: exists and is not a directory")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False on this machine")
    # Named as for the kit (kvcheck.selection): --kv-impl, else KV_IMPL, else every built-in.
    names = selection.names_given(args.kv_impl, os.environ.get("KV_IMPL"), list(kvimpl.CACHES))
    # The compressed arm beside every built-in; a cache named is timed alone.
    args.compressed = not args.kv_impl and not os.environ.get("KV_IMPL")
    try:
        selected = selection.select(names)
    except ValueError as error:
        parser.error(f"--kv-impl / KV_IMPL: {error}")
    for label, (name, _) in selected.items():
        if label in ("ideal", "uncached"):
            parser.error(f"--kv-impl: {name!r} would be a second row labelled {label!r}")
    return args, {
        label: at_block_size(factory, args.block_size) for label, (_, factory) in selected.items()
    }


def at_block_size(factory: CacheFactory, block_size: int) -> CacheFactory:
    """The chunked and paged built-ins with ``block_size`` tokens per chunk or block; any
    other factory as given."""
    if factory is kvimpl.ChunkedCache:
        return partial(kvimpl.ChunkedCache, chunk_size=block_size)
    if factory is kvimpl.CACHES["paged"]:
        return kvimpl.PagedPool(block_size)
    return factory


def main(argv: Sequence[str] | None = None) -> None:
    args, caches = parse_args(argv)
    workload = QUICK if args.quick else FULL
    workload = replace(
        workload,
        config=replace(workload.config, window=args.window),
        lengths=args.lengths or workload.lengths,
        min_run_time=args.min_run_time or workload.min_run_time,
    )
    args.out.mkdir(parents=True, exist_ok=True)  # before the run, so it fails fast
    try:
        rows, request_rows, batch_rows, prefix_rows = run(workload, caches, args)
    except AssertionError as wrong:  # a cache that decodes unlike the ideal: no timing
        sys.exit(f"\nkvimpl.bench: error: {wrong}")
    write_csv(rows, args.out / "results.csv")
    write_csv(request_rows, args.out / "requests.csv")
    if batch_rows:  # where some cache offers rows of their own
        write_csv(batch_rows, args.out / "batch.csv")
    write_csv(prefix_rows, args.out / "shared_prefix.csv")
    print(describe(workload, args))
    print(markdown_table(rows))
    print()
    print(requests_table(request_rows))
    if batch_rows:
        print()
        print(batch_table(batch_rows))
    print()
    print(shared_prefix_table(prefix_rows))
    try:
        plot(rows, describe(workload, args), args.out / "decode.png")
    except ImportError:  # the plot is the one part that needs the bench extra
        print(
            f"wrote {args.out / 'results.csv'}; for the plot, pip install 'kvcache-verify[bench]'"
        )
        return
    print(f"wrote {args.out / 'results.csv'} and {args.out / 'decode.png'}")


if __name__ == "__main__":
    main()
