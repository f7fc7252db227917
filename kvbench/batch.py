"""The batch table (batch.csv): the next token of requests of different lengths in one step,
on one batched cache whose rows hold lengths of their own (``append_rows``, contract section
8.1), one call for every request, against the requests on caches of their own, one call
each."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvbench.bench import PREFILL_CHUNK, Bench, formula_bytes
from kvbench.timing import spread_ms, take_turns
from kvref import CacheFactory, LayerCache
from kvref.rows import row_slots


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


def batch_rows(bench: Bench, factories: dict[str, CacheFactory]) -> list[BatchRow]:
    """The requests' next token in one step: on one batched cache of each factory that
    offers rows of their own (``append_rows``), and on caches of their own from the same
    factory (each built, as the batch is, for the longest request)."""
    longest = bench.tokens.shape[1]
    lengths = [min(length, longest) for length in bench.workload.requests]
    offering = {
        label: factory
        for label, factory in factories.items()
        if callable(getattr(factory(bench.model.cache_spec(1, 1)), "append_rows", None))
    }
    rows = []
    for label, factory in offering.items():
        batched, alone = (
            _batched(bench, factory, lengths),
            [
                bench.request(factory, length - 1, max(lengths), number, decode=False)
                for number, length in enumerate(lengths)
            ],
        )
        rows.append(_batch_step(bench, label, lengths, batched, alone))
    return [row for pair in rows for row in pair]


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


def _batched(bench: Bench, factory: CacheFactory, lengths: list[int]) -> list[LayerCache]:
    """One cache per layer for every request side by side, row r holding the first
    ``lengths[r] - 1`` tokens of batch row r (appended a chunk per call, each row its
    own count)."""
    caches = bench.model.new_caches(factory, batch=len(lengths), max_length=max(lengths))
    rows = [number % bench.workload.batch for number in range(len(lengths))]
    held = [length - 1 for length in lengths]
    for (key, value), cache in zip(bench.kept(caches[0]), caches, strict=True):
        for start in range(0, max(held), PREFILL_CHUNK):
            counts = [max(0, min(PREFILL_CHUNK, n - start)) for n in held]
            chunk = slice(start, start + PREFILL_CHUNK)
            keys, values = (torch.stack([t[row, :, chunk] for row in rows]) for t in (key, value))
            cache.append_rows(*_padded(keys, values, counts, cache), counts)
    return caches


def _batch_step(
    bench: Bench,
    label: str,
    lengths: list[int],
    batched: list[LayerCache],
    alone: list[list[LayerCache]],
) -> tuple[BatchRow, BatchRow]:
    """Time every request's next token: one ``forward_rows`` call on ``batched``, or one
    model call per request on ``alone``; each put back off the clock (``truncate_rows``,
    ``truncate``), after an untimed step of each that must agree."""
    rows = [number % bench.workload.batch for number in range(len(lengths))]
    last = zip(rows, lengths, strict=True)
    new = torch.stack([bench.tokens[row, length - 1] for row, length in last])
    held = tuple(length - 1 for length in lengths)
    counts = (1,) * len(lengths)

    def in_one_batch() -> Tensor:
        return bench.model.forward_rows(new[:, None], counts, batched)

    def each_alone() -> list[Tensor]:
        return [bench.model(new[r : r + 1, None], caches) for r, caches in enumerate(alone)]

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
        "one batch, rows of their own": (bench.timer(in_one_batch, put_back_batch), batched),
        "separate caches": (bench.timer(each_alone, put_back_alone), alone),
    }
    measured = take_turns(
        {scenario: timer for scenario, (timer, _) in timers.items()}, bench.workload
    )
    formula = sum(formula_bytes(bench.model, 1, length) for length in lengths)
    tokens = "+".join(map(str, lengths))
    out = []
    for scenario, (_, caches) in timers.items():
        layers = caches if scenario.startswith("one") else [c for r in caches for c in r]
        out.append(
            BatchRow(
                scenario,
                label,
                tokens,
                measured[scenario].median * 1000,
                spread_ms(measured[scenario]),
                len(measured[scenario].times),
                sum(cache.nbytes for cache in layers),
                formula,
            )
        )
    return out[0], out[1]
