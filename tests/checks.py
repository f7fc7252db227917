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

from kvref import CacheFactory, LayerCache
from tests.scenarios import Scenario, Session

TOLERANCES = {
    torch.float64: {"rtol": 1e-9, "atol": 1e-9},
    torch.float32: {"rtol": 1e-4, "atol": 1e-4},
}
POISON_VALUES = {"nan": float("nan"), "inf": float("inf"), "huge": 1e30}


class RecordingCache:
    """A cache passed through unchanged, keeping copies of what append was given and returned."""

    def __init__(self, cache: LayerCache) -> None:
        self.cache = cache
        self.lent: tuple[Tensor, Tensor] | None = None
        self.forget()

    def forget(self) -> None:
        self.given: tuple[Tensor, Tensor] | None = None
        self.returned: tuple[Tensor, Tensor] | None = None

    def __getattr__(self, name: str):
        return getattr(self.cache, name)  # e.g. the optional `spec` the model looks for

    @property
    def length(self) -> int:
        return self.cache.length

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        self.given = (key.clone(), value.clone())
        # The cache gets copies that are scribbled over at the next call, as by an engine that
        # reuses its input buffers: a cache that keeps the caller's tensors instead of copying
        # them then shows nan rows where earlier keys and values should be.
        if self.lent is not None:
            for tensor in self.lent:
                tensor.fill_(float("nan"))
        self.lent = (key.clone(), value.clone())
        all_keys, all_values = self.cache.append(*self.lent)
        self.returned = (all_keys.clone(), all_values.clone())  # views die at the next call
        return all_keys, all_values

    def reset(self) -> None:
        self.cache.reset()


@dataclass
class Step:
    """One model call on the caches, with the uncached model's answer for the same positions."""

    scenario: Scenario
    session_index: int
    step_index: int
    start: int  # absolute position of the first new token
    end: int  # one past the last
    logits: Tensor
    expected_logits: Tensor
    caches: list[RecordingCache]
    lengths_before: list[int]
    returned_before: list[tuple[Tensor, Tensor] | None]  # None at a session's first step
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
            f"session {self.session_index} of {len(self.scenario.sessions)}, step "
            f"{self.step_index} of {len(s.chunks)} ({kind} of {self.new_tokens} tokens at "
            f"absolute positions {self.start}..{self.end - 1}); session plan: {s.describe()}"
        )


def run(factory: CacheFactory, scenario: Scenario) -> Iterator[Step]:
    """Run every session of ``scenario`` on caches from ``factory``, yielding each step."""
    model = scenario.model()
    caches: list[RecordingCache] = []
    for session_index, session in enumerate(scenario.sessions):
        if session.start == "fresh":
            built = model.new_caches(factory, batch=scenario.batch, max_length=scenario.max_length)
            # One recorder per distinct cache: a factory that hands one object to several
            # layers must still look like that to the model, whose guard rejects it.
            recorders: dict[int, RecordingCache] = {}
            caches = [recorders.setdefault(id(cache), RecordingCache(cache)) for cache in built]
        else:
            for cache in caches:
                cache.reset()
        for layer, cache in enumerate(caches):
            cache.forget()
            assert cache.length == 0, (
                f"session {session_index}: layer {layer} holds {cache.length} tokens at the start "
                f"of a session on {session.start} caches; it must hold 0"
            )
        tokens = scenario.tokens(session)
        expected_logits = model(tokens)
        oracle_kv = model.rotated_kv(tokens)
        start = 0
        for step_index, size in enumerate(session.chunks):
            lengths_before = [cache.length for cache in caches]
            returned_before = [cache.returned for cache in caches]
            logits = model(tokens[:, start : start + size], caches=caches)
            yield Step(
                scenario,
                session_index,
                step_index,
                start,
                start + size,
                logits,
                expected_logits[:, start : start + size],
                caches,
                lengths_before,
                returned_before,
                oracle_kv,
            )
            start += size
        if session.poison:
            poison(caches, session, scenario)


def poison(caches: list[RecordingCache], session: Session, scenario: Scenario) -> None:
    """Leave rows of nan, inf or huge values behind for the next session to shed."""
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

    def message(default: str) -> str:
        located = first_divergence(actual, expected, position_axis, first_position)
        return f"{what} differ at {where}\n{located}\n{default}"

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
        f"first diverging absolute position: {first_position + first} "
        f"({len(positions)} of {by_position.shape[0]} positions diverge); max |diff| there "
        f"{gap:.3g} against atol={tolerance['atol']}, rtol={tolerance['rtol']}"
    )


def check_logits_match_uncached(factory: CacheFactory, scenario: Scenario) -> None:
    """Property 1: every new position's cached logits equal the uncached model's."""
    for step in run(factory, scenario):
        assert_close_at(
            step.logits,
            step.expected_logits,
            what="cached and uncached logits",
            where=step.where(),
            position_axis=1,
            first_position=step.start,
        )


def check_lengths(factory: CacheFactory, scenario: Scenario) -> None:
    """Property 2: lengths grow by the chunk, layers agree, append returns exactly what is
    held (no stale or unwritten rows), the new rows last and the earlier rows unchanged."""
    c = scenario.config
    for step in run(factory, scenario):
        where, size = step.where(), step.new_tokens
        lengths = [cache.length for cache in step.caches]
        assert len(set(lengths)) == 1, f"at {where}: layers disagree on length: {lengths}"
        for layer, cache in enumerate(step.caches):
            before, length = step.lengths_before[layer], lengths[layer]
            assert length == before + size, (
                f"at {where}, layer {layer}: length went from {before} to {length} after "
                f"appending {size} tokens; expected {before + size}"
            )
            held = (scenario.batch, c.num_kv_heads, length, c.head_dim)
            earlier_rows = step.returned_before[layer] or (None, None)
            for name, got, given, earlier in zip(
                ("keys", "values"), cache.returned, cache.given, earlier_rows, strict=True
            ):
                assert got.shape == held, (
                    f"at {where}, layer {layer}: append returned {name} shaped "
                    f"{tuple(got.shape)}; a cache holding {length} tokens must return {held}"
                )
                assert torch.equal(got[:, :, -size:], given), (
                    f"at {where}, layer {layer}: the last {size} {name} returned are not the "
                    f"{size} just appended"
                )
                if earlier is None:
                    continue
                kept = earlier.shape[2]
                changed = (got[:, :, :kept] != earlier).movedim(2, 0).flatten(1).any(1)
                assert not changed.any(), (
                    f"at {where}, layer {layer}: stored {name} changed since the previous step, "
                    f"first at row {changed.nonzero()[0].item()} of the {kept} held before"
                )


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
