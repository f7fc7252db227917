"""The requests table (requests.csv): the memory requests of batch 1 and different lengths
hold side by side, on one paged pool, whose blocks in use are compared with the sum of the
requests' own formulas, and on every other cache (``preallocated`` reserving the longest
request's length for each); and that of samples forked from one prompt on one pool, sharing
the prompt's blocks. Nothing here is timed."""

from __future__ import annotations

from dataclasses import dataclass

import kvimpl
from kvbench.bench import Bench, fill, formula_bytes
from kvref import CacheFactory, LayerCache

SAMPLES = 4  # samples forked from one prompt, each then decoding SAMPLE_TOKENS of its own
SAMPLE_TOKENS = 64


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


def request_rows(
    bench: Bench, factories: dict[str, CacheFactory], block_size: int
) -> list[RequestRow]:
    """Memory of requests of different lengths held side by side, and of samples forked
    from one prompt: on one fresh paged pool, and on each of ``factories`` (the other
    caches reserve per request, ``preallocated`` the longest request's length)."""
    longest = bench.tokens.shape[1]
    lengths = [min(length, longest) for length in bench.workload.requests]
    mixed = "+".join(map(str, lengths))
    rows = []
    others = {label: factory for label, factory in factories.items() if label != "paged"}
    for label, factory in {"paged": kvimpl.PagedPool(block_size), **others}.items():
        requests = [
            bench.request(factory, length, max(lengths), r) for r, length in enumerate(lengths)
        ]
        rows.append(_request_row(bench, "mixed lengths", label, mixed, factory, requests))
    own = min(SAMPLE_TOKENS, longest // 2)  # tokens each sample adds to the prompt
    prompt = min(lengths[1 % len(lengths)], longest - own)
    pool = kvimpl.PagedPool(block_size)
    shared = bench.request(pool, prompt, prompt, 0)
    samples = [[cache.fork() for cache in shared] for _ in range(SAMPLES)]
    del shared  # the samples hold the prompt's blocks now
    for number, caches in enumerate(samples):
        row = number % bench.workload.batch  # another row's keys: a continuation of its own
        for (key, value), cache in zip(bench.kept(caches[0]), caches, strict=True):
            own_rows = (slice(row, row + 1), slice(None), slice(prompt, prompt + own))
            fill(cache, key[own_rows], value[own_rows])
    scenario = f"{SAMPLES} samples forked from one prompt"
    tokens = "+".join([str(prompt + own)] * SAMPLES)
    rows.append(_request_row(bench, scenario, "paged", tokens, pool, samples))
    return rows


def _request_row(
    bench: Bench,
    scenario: str,
    label: str,
    tokens: str,
    factory: CacheFactory,
    requests: list[list[LayerCache]],
) -> RequestRow:
    """What ``requests`` hold against their formulas: a pool's blocks in use and reserved
    (noting where its caches' own nbytes differ, as shared blocks make them), else the
    caches' nbytes."""
    formula = sum(formula_bytes(bench.model, 1, caches[0].length) for caches in requests)
    held = sum(cache.nbytes for caches in requests for cache in caches)
    if isinstance(factory, kvimpl.PagedPool):
        in_use, reserved = factory.nbytes_in_use, factory.nbytes_reserved
        note = "" if held == in_use else f"the caches' nbytes: {held / 2**20:.1f} MiB"
        return RequestRow(scenario, label, tokens, in_use, formula, reserved, note)
    return RequestRow(scenario, label, tokens, held, formula, held)
