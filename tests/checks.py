"""Reusable checks: run a scenario on a cache factory and raise AssertionError where it breaks.

``run`` drives the reference model through every session and step of a scenario and yields
what each step produced, next to what the uncached model says it should be. Each check looks
at one aspect of those steps. Messages say where it diverged (session, step, absolute
positions, layer), by how much, and against which tolerance.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from kvref import CacheFactory, LayerCache, min_nbytes
from tests.scenarios import POISON_VALUES, CachePlan, Scenario, Session, random_rows

TOLERANCES = {
    torch.float64: {"rtol": 1e-9, "atol": 1e-9},
    torch.float32: {"rtol": 1e-4, "atol": 1e-4},
}


class WatchedCache:
    """A cache passed through unchanged and watched: the watcher keeps its own copy of every
    row appended since the last reset (what the cache must hold) and of what the last
    append returned (views die at the next call, so it copies)."""

    def __init__(self, cache: LayerCache) -> None:
        self.cache = cache
        self.held: tuple[Tensor, Tensor] | None = None  # None while nothing is held
        self.returned: tuple[Tensor, Tensor] | None = None
        self.lent: tuple[Tensor, ...] = ()

    def __getattr__(self, name: str):
        return getattr(self.cache, name)  # e.g. the optional `spec` the model looks for

    @property
    def length(self) -> int:
        return self.cache.length

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes

    @property
    def held_length(self) -> int:
        return 0 if self.held is None else self.held[0].shape[2]

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        # The cache gets copies that are scribbled over at the next call, as by an engine
        # that reuses its input buffers: a cache that keeps the caller's tensors instead of
        # copying them then shows nan where earlier keys and values should be.
        for tensor in self.lent:
            tensor.fill_(float("nan"))
        self.lent = (key.clone(), value.clone())
        all_keys, all_values = self.cache.append(*self.lent)  # a refusal records nothing
        new = (key.clone(), value.clone())
        if self.held is not None:
            new = tuple(
                torch.cat((old, rows), dim=2) for old, rows in zip(self.held, new, strict=True)
            )
        self.held = new
        self.returned = (all_keys.clone(), all_values.clone())
        return all_keys, all_values

    def reset(self) -> None:
        self.cache.reset()
        self.held = self.returned = None


def assert_returned_what_is_held(cache: WatchedCache, *, layer: int, at: str) -> None:
    """What the last append returned is, bit for bit, every row appended since the reset."""
    for name, got, held in zip(("keys", "values"), cache.returned, cache.held, strict=True):
        assert got.shape == held.shape, (
            f"layer {layer}: append returned {name} shaped {tuple(got.shape)}; a cache that "
            f"was given {held.shape[2]} rows since its reset must return {tuple(held.shape)}{at}"
        )
        differs = (got != held).movedim(2, 0).flatten(1).any(1).nonzero().flatten().tolist()
        assert not differs, (
            f"layer {layer}: {name} row {differs[0]} returned by append is not the row "
            f"appended there ({len(differs)} of {held.shape[2]} rows differ: {differs[:8]}){at}"
        )


@dataclass
class Step:
    """One model call on the caches, with the uncached model's answer for the same positions."""

    scenario: Scenario
    session_index: int
    step_index: int
    start: int  # absolute position of the first new token
    end: int  # one past the last
    logits: Tensor | None  # None until the model has run the step
    expected_logits: Tensor
    caches: list[WatchedCache]
    lengths_before: list[int]
    oracle_kv: list[tuple[Tensor, Tensor]]  # each layer's rotated K, V over the whole session

    @property
    def session(self) -> Session:
        return self.scenario.sessions[self.session_index]

    @property
    def new_tokens(self) -> int:
        return self.end - self.start

    def where(self) -> str:
        s = self.session
        kind = "prefill" if self.step_index == 0 else "decode"
        return (
            f"session #{self.session_index} (of {len(self.scenario.sessions)}), step "
            f"#{self.step_index} (of {len(s.chunks)}): {kind} of {self.new_tokens} tokens at "
            f"absolute positions {self.start}..{self.end - 1}\n"
            f"  session plan: {s.describe()}\n  model: {self.scenario.describe()}"
        )


def run(factory: CacheFactory, scenario: Scenario) -> Iterator[Step]:
    """Run every session of ``scenario`` on caches from ``factory``, yielding each step."""
    model = scenario.model()
    caches: list[WatchedCache] = []
    for session_index, session in enumerate(scenario.sessions):
        if session.start == "fresh":
            built = model.new_caches(factory, batch=scenario.batch, max_length=scenario.max_length)
            # One watcher per distinct cache, so that a factory handing one object to every
            # layer still meets the model's guard against that.
            watchers: dict[int, WatchedCache] = {}
            caches = [watchers.setdefault(id(cache), WatchedCache(cache)) for cache in built]
        else:
            for cache in caches:
                cache.reset()
        for layer, cache in enumerate(caches):
            assert cache.length == 0, (
                f"layer {layer} holds {cache.length} tokens at the start of a session on "
                f"{session.start} caches; it must hold 0\n  at session #{session_index}: "
                f"{session.describe()}"
            )
        tokens = scenario.tokens(session)
        expected_logits, oracle_kv = model.forward_with_kv(tokens)
        start = 0
        for step_index, size in enumerate(session.chunks):
            lengths_before = [cache.length for cache in caches]
            step = Step(
                scenario,
                session_index,
                step_index,
                start,
                start + size,
                None,
                expected_logits[:, start : start + size],
                caches,
                lengths_before,
                oracle_kv,
            )
            try:
                step.logits = model(tokens[:, start : start + size], caches=caches)
            except (ValueError, RuntimeError) as error:  # the model's guards refused the caches
                error.add_note(f"  at {step.where()}")
                raise
            yield step
            start += size
        if session.poison:
            poison(caches, session, scenario)


def poison(caches: list[WatchedCache], session: Session, scenario: Scenario) -> None:
    """Leave rows of nan, inf, -inf or huge values behind for the next session to shed."""
    c = scenario.config
    shape = (scenario.batch, c.num_kv_heads, session.poison_rows, c.head_dim)
    bad = torch.full(shape, POISON_VALUES[session.poison], dtype=scenario.dtype)
    for cache in caches:
        cache.append(bad, bad.clone())


def assert_close_at(
    actual: Tensor,
    expected: Tensor,
    *,
    what: str,
    where: str,
    position_axis: int,
    first_position: int = 0,
) -> None:
    """``torch.testing.assert_close`` at the dtype's tolerance, naming the first bad position."""
    tolerance = TOLERANCES[expected.dtype]
    if (
        actual.shape == expected.shape
        and actual.dtype == expected.dtype
        and torch.isclose(actual, expected, **tolerance).all()
    ):
        return  # the same test assert_close makes, without building its report (10x faster)

    def message(default: str) -> str:
        located = first_divergence(actual, expected, position_axis, first_position)
        return f"{what} differ\n  at {where}\n  {located}\n{default}"

    torch.testing.assert_close(actual, expected, **tolerance, msg=message)


def first_divergence(
    actual: Tensor, expected: Tensor, position_axis: int, first_position: int
) -> str:
    if actual.shape != expected.shape:
        return f"shapes differ: got {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    tolerance = TOLERANCES[expected.dtype]
    bad = ~torch.isclose(actual, expected, **tolerance)
    by_position = bad.movedim(position_axis, 0).flatten(1)
    positions = by_position.any(dim=1).nonzero().flatten().tolist()
    if not positions:
        return "dtype or layout differs"
    first = positions[0]
    gap = (actual - expected).abs().movedim(position_axis, 0)[first].max().item()
    return (
        f"first diverging absolute position: {first_position + first} (index {first} "
        f"below; {len(positions)} of {by_position.shape[0]} positions diverge); max |diff| there "
        f"{gap:.3g} against atol={tolerance['atol']}, rtol={tolerance['rtol']}"
    )


def check_logits_match_uncached(factory: CacheFactory, scenario: Scenario) -> None:
    """Property 1: every new position's cached logits equal the uncached model's."""
    for step in run(factory, scenario):
        try:
            assert_close_at(
                step.logits,
                step.expected_logits,
                what="cached and uncached logits",
                where=step.where(),
                position_axis=1,
                first_position=step.start,
            )
        except AssertionError as error:
            error.add_note(first_wrong_layer(step))
            raise


def first_wrong_layer(step: Step) -> str:
    """Which layer's cache first hands back keys or values the uncached pass did not make:
    the first place to look when logits diverge (later layers inherit its error)."""
    for layer, cache in enumerate(step.caches):
        pairs = zip(("keys", "values"), cache.returned, step.oracle_kv[layer], strict=True)
        for name, got, want in pairs:
            want = want[:, :, : step.end]
            if got.shape != want.shape:
                return (
                    f"  diagnosis: layer {layer}'s cache returned {name} shaped "
                    f"{tuple(got.shape)}, not {tuple(want.shape)}"
                )
            bad = ~torch.isclose(got, want, **TOLERANCES[want.dtype])
            rows = bad.movedim(2, 0).flatten(1).any(1).nonzero().flatten().tolist()
            if rows:
                return (
                    f"  diagnosis: layer {layer} is the first whose cache returned {name} unlike "
                    f"the uncached pass's, at rows {rows[:8]}{' ...' if len(rows) > 8 else ''}"
                )
    return (
        "  diagnosis: every layer's cache returned the uncached pass's keys and values, so the "
        "model used them wrongly (mask, positions) or the cache changed them after returning"
    )


def check_lengths(factory: CacheFactory, scenario: Scenario) -> None:
    """Property 2: lengths grow by the chunk, layers agree, and append returns exactly the
    rows given since the reset: no stale or unwritten rows, none moved, none changed."""
    for step in run(factory, scenario):
        at, size = f"\n  at {step.where()}", step.new_tokens
        lengths = [cache.length for cache in step.caches]
        assert len(set(lengths)) == 1, f"layers disagree on length: {lengths}{at}"
        for layer, cache in enumerate(step.caches):
            before, length = step.lengths_before[layer], lengths[layer]
            assert length == before + size, (
                f"layer {layer}: length went from {before} to {length} after appending {size} "
                f"tokens; expected {before + size}{at}"
            )
            assert_returned_what_is_held(cache, layer=layer, at=at)


def check_contents(factory: CacheFactory, scenario: Scenario) -> None:
    """Property 3: what each layer holds equals the uncached pass's rotated keys and values."""
    for step in run(factory, scenario):
        for layer, cache in enumerate(step.caches):
            oracle = step.oracle_kv[layer]
            for name, got, want in zip(("keys", "values"), cache.returned, oracle, strict=True):
                assert_close_at(
                    got,
                    want[:, :, : step.end],
                    what=f"layer {layer}'s cached {name} and the uncached pass's (rotated) {name}",
                    where=step.where(),
                    position_axis=2,
                )


def warm(factory: CacheFactory, plan: CachePlan) -> WatchedCache:
    """A watched cache from ``factory`` after the plan's appends of random rows."""
    cache = WatchedCache(factory(plan.spec))
    for step, rows in enumerate(plan.chunks):
        keys = random_rows(plan.spec, rows, seed=step)
        cache.append(keys, random_rows(plan.spec, rows, seed=100 + step))
    return cache


def check_nbytes(factory: CacheFactory, plan: CachePlan) -> None:
    """Property 6: nbytes is an int, never below 2 x B x H_kv x L x D x itemsize, at every
    step of the plan and after a reset."""
    spec, cache = plan.spec, WatchedCache(factory(plan.spec))
    for step, rows in enumerate([*plan.chunks, "reset"]):
        if rows == "reset":
            cache.reset()
        else:
            new = random_rows(spec, rows, seed=step)
            cache.append(new, new)
        nbytes, needed = cache.nbytes, min_nbytes(spec, cache.length)
        assert type(nbytes) is int, f"nbytes must be an int, got {type(nbytes).__name__}"
        assert nbytes >= needed, (
            f"nbytes is {nbytes} while holding {cache.length} tokens, which take at least "
            f"{needed} bytes (2 x {spec.batch} x {spec.kv_heads} x {cache.length} x "
            f"{spec.head_dim} x itemsize)\n  at step {step} of {plan.describe()}"
        )
