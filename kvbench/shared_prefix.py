"""The shared-prefix table (shared_prefix.csv): many requests opening with one long system
prompt, served in turn and held side by side, three ways: on one paged pool with prefix
caching (contract section 9.1: each request looks its prompt up and prefills only the rest),
on the same kind of pool without lookups, and on separate preallocated caches.

The prefills of all the requests are timed as one statement, each time on fresh caches (and
a fresh pool, so the first request misses) whose storage was allocated off the clock; the
ways must first give the same logits, for every prompt's last token and every decoded one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils import benchmark

import kvimpl
from kvbench.bench import Bench, formula_bytes
from kvbench.timing import spread_ms, take_turns
from kvref import CacheFactory, LayerCache


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


def shared_prefix_rows(bench: Bench, pool: Callable[[], kvimpl.PagedPool]) -> list[PrefixRow]:
    """The shared-prefix workload, three ways: on a fresh ``pool()`` with prefix caching
    (each request looks its prompt up, then prefills the rest), on another without
    lookups, and on separate preallocated caches (each built for its request's length).
    Each way first serves every request, prefill and decode, held side by side: its
    logits must agree with separate caches', and its busiest moment's memory is
    reported. Then the prefills alone are timed, the ways taking turns."""
    prompts, decoded = _shared_prefix_tokens(bench)
    ways = {  # scenario: cache, a fresh factory, whether each request looks its prompt up
        "prefix caching": ("paged", pool, True),
        "one pool, no lookups": ("paged", pool, False),
        "separate caches": ("preallocated", lambda: kvimpl.PreallocatedCache, False),
    }
    served = {
        scenario: _serve(bench, make(), lookups, prompts, decoded)
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
        scenario: _prefill_timer(bench, make, lookups, prompts, served[scenario].peak_blocks)
        for scenario, (_, make, lookups) in ways.items()
    }
    measured = take_turns(timers, bench.workload)
    shared = bench.workload.shared_prefix
    tokens = f"{shared.requests} x {shared.system}+{shared.own}+{shared.decode}"
    length = shared.system + shared.own + shared.decode
    formula = shared.requests * formula_bytes(bench.model, 1, length)
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
        rows.append(
            PrefixRow(
                scenario,
                cache,
                tokens,
                prompts.numel(),
                sum(hits) if lookups else None,
                measured[scenario].median * 1000,
                spread_ms(measured[scenario]),
                len(measured[scenario].times),
                served[scenario].peak_bytes,
                formula,
                note,
            )
        )
    return rows


def _shared_prefix_tokens(bench: Bench) -> tuple[Tensor, Tensor]:
    """Every request's prompt, (requests, system + own): one system prompt, then tokens
    of its own; and the tokens each then decodes, (requests, decode)."""
    shared = bench.workload.shared_prefix
    vocab = bench.workload.config.vocab_size
    generator = torch.Generator().manual_seed(1)
    system = torch.randint(vocab, (1, shared.system), generator=generator)
    own = torch.randint(vocab, (shared.requests, shared.own + shared.decode), generator=generator)
    prompts = torch.cat([system.expand(shared.requests, -1), own[:, : shared.own]], dim=1)
    return prompts.to(bench.device), own[:, shared.own :].to(bench.device)


def _request_caches(bench: Bench, factory: CacheFactory) -> list[list[LayerCache]]:
    """Every request's caches, one per layer, each built for the request's length."""
    shared = bench.workload.shared_prefix
    length = shared.system + shared.own + shared.decode
    return [
        bench.model.new_caches(factory, batch=1, max_length=length) for _ in range(shared.requests)
    ]


def _prefill_requests(
    bench: Bench,
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
        logits.append(bench.model(prompt[None, hit:], caches)[:, -1])
    return hits, logits


def _serve(
    bench: Bench, factory: CacheFactory, lookups: bool, prompts: Tensor, decoded: Tensor
) -> Served:
    """Every request in turn, held side by side: its prompt (``_prefill_requests``), then
    its decoded tokens, one call each."""
    requests = _request_caches(bench, factory)
    hits, first = _prefill_requests(bench, factory, lookups, prompts, requests)
    pooled = isinstance(factory, kvimpl.PagedPool)
    logits, peak_bytes, peak_blocks = [], 0, 0
    for number, (caches, last, tokens) in enumerate(zip(requests, first, decoded, strict=True)):
        steps = [last]
        for token in tokens:
            if lookups:  # declared before their rows are appended (contract, 9.1)
                for cache in caches:
                    cache.declare_tokens(token.view(1, 1))
            steps.append(bench.model(token.view(1, 1), caches)[:, -1])
        logits.append(torch.stack(steps, dim=1))
        held = (cache.nbytes for done in requests[: number + 1] for cache in done)
        peak_bytes = max(peak_bytes, factory.nbytes_in_use if pooled else sum(held))
        peak_blocks = max(peak_blocks, factory.blocks_in_use if pooled else 0)
    return Served(torch.cat(logits), hits, peak_bytes, peak_blocks)


def _prefill_timer(
    bench: Bench, make: Callable[[], CacheFactory], lookups: bool, prompts: Tensor, blocks: int
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
            _grow(bench, factory, blocks)
        state.update(factory=factory, requests=_request_caches(bench, factory))

    def prefill_all() -> None:
        _prefill_requests(bench, state["factory"], lookups, prompts, state["requests"])

    return bench.timer(prefill_all, fresh)


def _grow(bench: Bench, pool: kvimpl.PagedPool, blocks: int) -> None:
    """Make ``pool`` allocate storage for ``blocks`` blocks, then free them: a cache of it
    appends that many blocks of zeros and is reset (a pool keeps the storage it has
    grown; nothing is published, no tokens being declared)."""
    rows = blocks * pool.block_size
    spec = bench.model.cache_spec(1, rows)
    shape = (1, spec.kv_heads, rows, spec.head_dim)
    zeros = torch.zeros(shape, dtype=spec.dtype, device=spec.device)
    cache = pool(spec)
    cache.append(zeros, zeros)
    cache.reset()
