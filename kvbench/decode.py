"""The decode table (results.csv): one decode step at each context length on every cache,
beside the ideal and the uncached model.

How one decode step at context L is timed: each layer's cache is given the rotated keys and
values of the first L - 1 tokens in appends of 64 (a chunked prefill), then one model call
with token L is timed: it appends one row (or, for a cache with ``attend``, hands it the row
and the query) and attends to L keys. Each call grows the cache, so before every timed call
the cache is put back at L - 1 tokens while the clock is paused: by ``truncate(L - 1)`` when
the cache has it, else by a reset and the same appends. Before timing, each cache decodes
token L twice (after its prefill and after being put back) and must match the ideal.

Besides the caches there are two rows: `ideal`, the same step with the keys and values of all
L tokens already in place and no bookkeeping at all (the floor a cache can approach), and
`uncached`, the model recomputing all L tokens to decode the last one.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor
from torch.utils import benchmark

from kvbench.bench import Bench, fill, formula_bytes
from kvbench.timing import spread_ms, take_turns
from kvbench.workload import COMPRESSED, FULL_PRECISION, GQA, MLA
from kvcheck import asserts as kvassert
from kvcheck.asserts import coarser
from kvref import CacheFactory, LayerCache
from kvref.quantized import storage


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


def peak_rss_bytes() -> int:
    """The process's peak resident set size so far: ru_maxrss, in KiB on Linux, bytes on macOS."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


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


def decode_setup(
    bench: Bench, factories: dict[str, CacheFactory], length: int, ideal: str = "ideal"
) -> dict[str, Timed]:
    """The ideal (labelled ``ideal``) and every cache of ``factories``, filled with the
    first ``length - 1`` tokens and checked (``_check_against_ideal``), each with a timer
    of decoding token ``length``."""
    caches = {
        label: bench.model.new_caches(factory, batch=bench.workload.batch, max_length=length)
        for label, factory in factories.items()
    }
    caches = {ideal: _ideal_caches(bench, length), **caches}
    restores = {label: _restorer(bench, layers, length) for label, layers in caches.items()}
    _check_against_ideal(bench, caches, restores, length, ideal)
    model = MLA if bench.model.config.attention == "mla" else GQA
    step = partial(bench.model, bench.tokens[:, length - 1 : length])
    setups = {}
    for label, layers in caches.items():
        lossy = storage(layers[0]) != (None, None)
        setups[label] = Timed(
            bench.timer(partial(step, layers), restores[label]),
            layers,
            formula_bytes(bench.model, bench.workload.batch, length, layers[0]),
            COMPRESSED if lossy or model == MLA else FULL_PRECISION,
            model,
        )
    return setups


def decode_rows(
    bench: Bench,
    setups: dict[str, Timed],
    length: int,
    after_round: Callable[[int], object] = lambda round_number: None,
) -> list[Row]:
    """Time decoding token ``length`` on every row of ``setups`` (of this bench and of
    others, as the compressed arm's MLA model), taking turns."""
    timers = {label: setup.timer for label, setup in setups.items()}
    measured = take_turns(timers, bench.workload, after_round)
    return [
        _results_row(
            bench,
            label,
            length,
            measured[label],
            nbytes=sum(cache.nbytes for cache in setup.caches),
            formula=setup.formula_bytes,
            arm=setup.arm,
            model=setup.model,
        )
        for label, setup in setups.items()
    ]


def _check_against_ideal(
    bench: Bench,
    caches: dict[str, list[LayerCache]],
    restores: dict[str, Callable[[], None]],
    length: int,
    ideal: str = "ideal",
) -> None:
    """A fast wrong cache is no result: each must decode token ``length`` as the ideal does,
    from its first fill and again after being put back as before every timed call; at
    1e-4, or for a cache that declares lossy storage within its budget as the kit holds
    it (``kvcheck.asserts``, contract 10.1)."""
    new_token = bench.tokens[:, length - 1 : length]
    expected = bench.model(new_token, caches[ideal])
    for label, layers in caches.items():
        declared = coarser(*storage(layers[0]))
        for when in ("after its prefill", "after being put back"):
            what = (
                f"{label} decodes token {length} unlike the ideal row ({when}), so its "
                f"timing would mean nothing; run the test suite on it."
            )
            decoded = bench.model(new_token, layers)
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


def uncached_row(bench: Bench, length: int) -> Row:
    """Time the model recomputing all ``length`` tokens, which is how it decodes the last."""
    timer = bench.timer(partial(bench.model, bench.tokens[:, :length]), restore=lambda: None)
    measurement = timer.blocked_autorange(min_run_time=bench.workload.min_run_time)
    return _results_row(bench, "uncached", length, measurement, nbytes=0)


def skipped_row(bench: Bench, label: str, length: int, note: str) -> Row:
    """A row left untimed (as ``uncached`` above ``--uncached-max-length``), ``note`` saying why."""
    return _results_row(bench, label, length, None, nbytes=0, note=note)


def _ideal_caches(bench: Bench, length: int) -> list[LayerCache]:
    """The ideal's cache of every layer: the rows token ``length`` attends to, as given."""
    window = bench.workload.config.window or length
    first = max(length - window, 0)
    return [
        IdealCache(key[:, :, first:length].clone(), value[:, :, first:length].clone(), length - 1)
        for key, value in bench.keys_values
    ]


def _restorer(bench: Bench, caches: Sequence[LayerCache], length: int) -> Callable[[], None]:
    """Fill ``caches`` with the first ``length - 1`` tokens; return what puts them back
    there after a decode step (by ``truncate`` where it works, else by refilling)."""
    prefix = [
        (key[:, :, : length - 1], value[:, :, : length - 1]) for key, value in bench.kept(caches[0])
    ]

    def restore() -> None:
        for cache, (key, value) in zip(caches, prefix, strict=True):
            if cache.length == length and take_back(cache, length - 1):
                continue
            cache.reset()
            fill(cache, key, value)

    restore()
    return restore


def _results_row(
    bench: Bench,
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
        ms_spread=spread_ms(measurement) if samples else None,
        samples=samples,
        nbytes=nbytes,
        formula_bytes=formula or formula_bytes(bench.model, bench.workload.batch, length),
        peak_rss_bytes=peak_rss_bytes(),
        note=note,
        arm=arm,
        model=model,
    )
