"""Running caches under watch: the recorder between model and cache, and the step loop.

``Recorder`` wraps a cache without changing what it does and keeps its own copy of every
row given since the last reset, so any check can compare what the cache returns with what
it was given. ``run`` drives the reference model through a scenario on recorded caches and
yields each step next to the uncached model's answer for it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from kvcheck.asserts import fail_if_not_empty, needs_reference
from kvcheck.strategies import CachePlan, Scenario, Session, poison_value, random_rows
from kvref import CacheFactory, CacheSpec, LayerCache, ModelConfig
from kvref.protocol import rows_needed


class Recorder:
    """A cache passed through unchanged and watched.

    ``given`` is the rows appended since the last reset (None while there are none),
    ``returned`` what the last append returned (copied, because a cache's views are valid
    only until its next call) and ``new_tokens`` how many rows that append brought. A cache
    built with a ``window`` may return only a recent run of ``given``.
    """

    def __init__(self, cache: LayerCache, window: int | None = None) -> None:
        self.cache = cache
        self.window = window
        self.given: tuple[Tensor, Tensor] | None = None
        self.returned: tuple[Tensor, Tensor] | None = None
        self.new_tokens = 0
        self.lent: tuple[Tensor, ...] = ()

    def __getattr__(self, name: str):
        if name == "attend":
            # Hidden, so that the model appends through the recorder and every append is
            # recorded and checked; attend is held to kvref.attention by its own property.
            raise AttributeError(name)
        return getattr(self.cache, name)  # e.g. the optional `spec` the model looks for

    @property
    def length(self) -> int:
        return self.cache.length

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes

    @property
    def given_length(self) -> int:
        return 0 if self.given is None else self.given[0].shape[2]

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        # The cache gets copies that are scribbled over at the next call, as by an engine
        # that reuses its input buffers: a cache that keeps the caller's tensors instead of
        # copying them then shows nan where earlier keys and values should be.
        for tensor in self.lent:
            tensor.fill_(float("nan"))
        self.lent = (key.clone(), value.clone())
        all_keys, all_values = self.cache.append(*self.lent)  # a refusal records nothing
        new = (key.clone(), value.clone())
        if self.given is not None:
            new = tuple(
                torch.cat((old, rows), dim=2) for old, rows in zip(self.given, new, strict=True)
            )
        self.given = new
        self.returned = (all_keys.clone(), all_values.clone())
        self.new_tokens = key.shape[2]
        return all_keys, all_values

    def fewest_rows(self) -> int:
        """The fewest rows the last append may return: all without a window, else the last
        W - 1 before the new ones and the new ones."""
        return rows_needed(self.window, self.given_length, self.new_tokens)

    def reset(self) -> None:
        self.cache.reset()
        self.given = self.returned = None

    # The optional capabilities, passed through; the record follows only a call that returns.
    def truncate(self, length: int) -> None:
        self.cache.truncate(length)
        if self.given is not None:
            self.given = tuple(rows[:, :, :length] for rows in self.given)

    def reorder(self, indices: Tensor) -> None:
        self.cache.reorder(indices)
        if self.given is not None:
            self.given = tuple(rows[indices.to(rows.device)] for rows in self.given)


def record(caches: Iterable[LayerCache], config: ModelConfig) -> list[Recorder]:
    """One recorder per distinct cache object (each knowing its layer's window), so that a
    factory that hands the same object to every layer still meets the model's guard."""
    recorders: dict[int, Recorder] = {}
    return [
        recorders.setdefault(id(cache), Recorder(cache, config.layer_window(layer)))
        for layer, cache in enumerate(caches)
    ]


def build(factory: CacheFactory, spec: CacheSpec) -> Recorder:
    """A recorded cache from ``factory`` for ``spec``."""
    return Recorder(factory(spec), spec.window)


def warm(factory: CacheFactory, plan: CachePlan) -> Recorder:
    """A recorded cache from ``factory`` after the plan's appends of random rows."""
    cache = build(factory, plan.spec)
    for step, rows in enumerate(plan.chunks):
        keys = random_rows(plan.spec, rows, seed=step)
        cache.append(keys, random_rows(plan.spec, rows, seed=100 + step))
    return cache


def may_refuse(config: ModelConfig, held: int, target: int) -> bool:
    """Whether a window layer holding ``held`` tokens may refuse to truncate to ``target``:
    the next query needs the positions from target - W + 1, and a cache must keep only the
    last W - 1."""
    windows = {config.layer_window(layer) for layer in range(config.num_layers)} - {None}
    # Some position the next query needs (target - W + 1 .. target - 1) lies before the
    # first one every cache must keep (held - W + 1).
    return any(max(0, target - w + 1) < min(target, max(0, held - w + 1)) for w in windows)


@dataclass(frozen=True, kw_only=True)
class Step:
    """One model call on the caches, with the uncached model's answer for the same positions.

    ``caches`` are the live recorders: a Step describes them as they are right after its
    call, and only until the generator that yielded it moves on.
    """

    scenario: Scenario
    session_index: int
    step_index: int
    start: int  # absolute position of the first new token
    end: int  # one past the last
    logits: Tensor
    expected_logits: Tensor
    caches: list[Recorder]
    lengths_before: list[int]
    oracle_kv: list[tuple[Tensor, Tensor]]  # each layer's rotated K, V over the whole session
    # In half precision, the float64 model's uncached pass over the session (logits, K and V),
    # which the error budget measures both runs against, made when first asked for; else None.
    reference: Callable[[], tuple[Tensor, list[tuple[Tensor, Tensor]]]] | None = None

    @property
    def session(self) -> Session:
        return self.scenario.sessions[self.session_index]

    @property
    def new_tokens(self) -> int:
        return self.end - self.start

    @property
    def reference_logits(self) -> Tensor | None:
        """The float64 model's logits at this step's positions (half precision only)."""
        return None if self.reference is None else self.reference()[0][:, self.start : self.end]

    def uncached_rows(self, layer: int, which: int, first: int) -> tuple[Tensor, Tensor | None]:
        """Layer ``layer``'s rotated keys (``which`` 0) or values (1) from the uncached pass,
        at positions ``first`` to the step's last; and the float64 model's in half precision
        (else None), for the error budget."""
        rows = slice(first, self.end)
        if self.reference is None:
            return self.oracle_kv[layer][which][:, :, rows], None
        reference = self.reference()[1][layer][which]
        return self.oracle_kv[layer][which][:, :, rows], reference[:, :, rows]

    def where(self) -> str:
        return where_in_session(self.scenario, self.session_index, self.step_index, self.start)


def where_in_session(scenario: Scenario, session_index: int, step_index: int, start: int) -> str:
    session = scenario.sessions[session_index]
    size = session.chunks[step_index]
    kind = "prefill" if step_index == 0 else "decode"
    return (
        f"session #{session_index} (of {len(scenario.sessions)}), step #{step_index} (of "
        f"{len(session.chunks)}): {kind} of {size} tokens at absolute positions "
        f"{start}..{start + size - 1}\n"
        f"  session plan: {session.describe()}\n  model: {scenario.describe()}"
    )


def run(factory: CacheFactory, scenario: Scenario) -> Iterator[Step]:
    """Run every session of ``scenario`` on caches from ``factory``, yielding each step."""
    model = scenario.model()
    caches: list[Recorder] = []
    for session_index, session in enumerate(scenario.sessions):
        if session.start == "fresh":
            built = model.new_caches(factory, batch=scenario.batch, max_length=scenario.max_length)
            caches = record(built, scenario.config)
        else:
            for cache in caches:
                cache.reset()
        fail_if_not_empty(
            caches,
            f"the start of session #{session_index} on {session.start} "
            f"caches: {session.describe()}",
        )
        tokens = scenario.tokens(session)
        expected_logits, oracle_kv = model.forward_with_kv(tokens)
        reference = (
            functools.cache(functools.partial(scenario.reference().forward_with_kv, tokens))
            if needs_reference(scenario.dtype)
            else None
        )
        start = 0
        for step_index, size in enumerate(session.chunks):
            lengths_before = [cache.length for cache in caches]
            try:
                logits = model(tokens[:, start : start + size], caches=caches)
            except Exception as error:
                where = where_in_session(scenario, session_index, step_index, start)
                error.add_note(f"  at {where}")
                raise
            yield Step(
                scenario=scenario,
                session_index=session_index,
                step_index=step_index,
                start=start,
                end=start + size,
                logits=logits,
                expected_logits=expected_logits[:, start : start + size],
                caches=caches,
                lengths_before=lengths_before,
                oracle_kv=oracle_kv,
                reference=reference,
            )
            start += size
        if session.poison:
            poison(caches, session, scenario)


def poison(caches: list[Recorder], session: Session, scenario: Scenario) -> None:
    """Leave rows of nan, inf, -inf or huge values behind for the next session to shed."""
    c = scenario.config
    shape = (scenario.batch, c.num_kv_heads, session.poison_rows, c.head_dim)
    bad = torch.full(
        shape,
        poison_value(session.poison, scenario.dtype),
        dtype=scenario.dtype,
        device=scenario.model().device,
    )
    for cache in caches:
        cache.append(bad, bad.clone())
