"""Context shift (docs/contract.md, section 8.4): when its context fills, a session discards
a span of its history and moves what follows down, the cache re-rotating the keys it moves,
as llama.cpp does; the session then runs on past ``max_length``.

A ``ShiftPlan`` is a batch, a first position (set with ``reset_at`` where offered, so that
positions recounted from 0 show) and its events: tokens fed (prompt, decode steps, chunks)
and shifts ``(start, count)``, one before any feed that would overflow the cache, drawn
from index 0 (the oldest tokens) or after a few kept ones (llama.cpp's ``n_keep``), across
the 16-row block edges and the window's, of 1 token to most of the history. The oracle is
the uncached pass's rows with each span removed and the keys after it rotated in float64,
held in a trusted cache (``kvref.model.HeldRows``); every later step's logits are the
model's over those rows (``Engine.shift``).

- ``context shift``: where ``shift`` is offered.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from kvcheck import devices as kvdevices
from kvcheck import failures
from kvcheck import sizes as kvsizes
from kvcheck import strategies as kvst
from kvcheck.devices import dtype_name
from kvcheck.harness import PATHS
from kvcheck.kit import KitTests, Property, on_both_paths, path_for, property_test
from kvcheck.properties.rows import FIRST_POSITIONS
from kvcheck.session import Engine
from kvref import CacheFactory, ModelConfig

EDGE = kvst.EDGE
CAPACITIES = (EDGE, EDGE + 1, 2 * EDGE - 1, 2 * EDGE, 2 * EDGE + 1, 48)


@dataclass(frozen=True)
class ShiftPlan:
    """One batch and its events: ``("feed", (tokens,))`` or ``("shift", (start, count))``."""

    config: ModelConfig
    dtype: torch.dtype
    batch: int
    max_length: int
    events: tuple[tuple[str, tuple[int, ...]], ...]
    token_seed: int
    first: int = 0  # the position of the first token (reset_at), where offered
    path: str = "append"  # the model's path through the caches (attend where offered)

    def describe(self) -> str:
        said = {"feed": "feed {}", "shift": "shift({}, {})"}
        events = "; ".join(said[kind].format(*arg) for kind, arg in self.events)
        first = f", first position {self.first}" if self.first else ""
        return (
            f"shift plan: batch {self.batch}, {dtype_name(self.dtype)}, max_length "
            f"{self.max_length}{first}, {self.path} path, events: {events}\n  model: "
            f"{kvst.describe_config(self.config)}"
        )

    def summary(self) -> tuple[str, str, str]:
        fed = sum(arg[0] for kind, arg in self.events if kind == "feed")
        shifts = sum(kind == "shift" for kind, _ in self.events)
        return f"{fed} ({shifts} shifts)", str(self.config.num_layers), str(self.batch)


@st.composite
def spans(draw, held: int, window: int | None) -> tuple[int, int]:
    """A span of ``held`` tokens to discard: from 0, after a few kept, at the window's edge
    (what the next query sees changes), or anywhere; 1 token, a block's worth around its
    edge, half the rest (llama.cpp's choice), or any."""
    keep = draw(st.sampled_from((0, 0, 1, 4, "window", "any")), label="tokens kept before it")
    if keep == "window" and window is not None:
        edge = held - window + draw(st.integers(-1, 1), label="around the window's edge")
        start = min(max(0, edge), held - 1)
    elif keep == "any" or keep == "window":
        start = draw(st.integers(0, held - 1), label="start")
    else:
        start = min(keep, held - 1)
    room = held - start
    count = draw(
        st.one_of(
            st.just(1),
            st.sampled_from((EDGE - 1, EDGE, EDGE + 1)),
            st.just(max(1, room // 2)),
            st.integers(1, room),
        ),
        label="count",
    )
    return start, min(count, room)


@st.composite
def shift_plans(draw) -> ShiftPlan:
    """A prompt, then decode steps and chunks, a shift before any feed that would overflow
    and shifts drawn anywhere, ending with a decode step after the last shift."""
    max_length = draw(st.sampled_from(CAPACITIES), label="max_length")
    config = draw(kvst.model_configs(max_layers=2, tokens=max_length + 8), label="config")
    held = draw(st.integers(1, max_length), label="prompt")
    events: list[tuple[str, tuple[int, ...]]] = [("feed", (held,))]
    for _ in range(draw(st.integers(1, 8), label="events")):
        kind = draw(st.sampled_from(("decode", "chunk", "shift")), label="event")
        if kind == "shift" and held:
            span = draw(spans(held, config.window), label="span")
            events.append(("shift", span))
            held -= span[1]
            continue
        size = 1 if kind == "decode" else draw(kvst.chunk_sizes, label="chunk")
        size = min(size, max_length)
        if held + size > max_length:  # full: make room as an engine would (held >= 1 here)
            start = min(draw(st.sampled_from((0, 4)), label="tokens kept"), held - 1)
            count = max(held + size - max_length, (held - start) // 2)
            start = min(start, held - count)  # keeping fewer where the overflow needs it
            events.append(("shift", (start, count)))
            held -= count
        events.append(("feed", (size,)))
        held += size
    if not any(kind == "shift" for kind, _ in events):
        span = draw(spans(held, config.window), label="span")
        events.append(("shift", span))
        held -= span[1]
    if events[-1][0] == "shift":
        if held == max_length:
            events.append(("shift", (0, 1)))
            held -= 1
        events.append(("feed", (1,)))
    first = draw(st.sampled_from((0, *FIRST_POSITIONS)), label="first position")
    return ShiftPlan(
        config=config,
        dtype=draw(kvst.dtypes_on_device(kvst.WITH_HALF), label="dtype"),
        batch=draw(kvsizes.batches(small_max=3), label="batch"),
        max_length=max_length,
        events=tuple(events),
        token_seed=draw(st.integers(0, 2**16), label="token seed"),
        first=first,
        path=draw(st.sampled_from(PATHS), label="path"),
    )


def check_context_shift(factory: CacheFactory, plan: ShiftPlan) -> None:
    """Every step's logits, before and after each shift, equal the model's over the rows the
    caches should hold, and every append returns them (re-rotated keys within rounding)."""
    model = kvst.build_model(plan.config, plan.dtype)
    path = path_for(plan.path, factory)
    engine = Engine(factory, model, max_length=plan.max_length, path=path, describe=plan.describe)
    generator = torch.Generator().manual_seed(plan.token_seed)
    request = engine.start("the session", plan.batch)
    if plan.first and callable(getattr(request.caches[0].cache, "reset_at", None)):
        engine.reset_at(request, [plan.first] * plan.batch)
    for index, (kind, arg) in enumerate(plan.events):
        at = f" (event #{index})"
        if kind == "feed":
            drawn = torch.randint(
                0, plan.config.vocab_size, (plan.batch, *arg), generator=generator
            )
            engine.feed(request, drawn.to(kvdevices.current()), at=at)
        elif not engine.shift(request, *arg, at=at):
            break  # a window refused as it may: the rest was drawn for the shifted history
        engine.check(f"event #{index}")
    engine.finish()


# Tried first on every run: a session started at 255, shifted from index 0 across a block
# edge, then past n_keep 4 by one token, with decode steps and a chunk after each, on a model
# whose even layers have a window of 5 (a shift that moves what the window sees).
PINNED = (
    ShiftPlan(
        config=ModelConfig(
            vocab_size=23, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, window=5,
            window_layers="alternate",
        ),
        dtype=torch.float64,
        batch=2,
        max_length=2 * EDGE,
        events=(
            ("feed", (EDGE + 3,)),
            ("shift", (0, EDGE + 1)),
            ("feed", (1,)),
            ("feed", (9,)),
            ("shift", (4, 1)),
            ("feed", (1,)),
            ("shift", (1, 6)),
            ("feed", (2,)),
        ),
        token_seed=5,
        first=255,
    ),
)  # fmt: skip

CONTEXT_SHIFT = Property(
    "context shift",
    "after a context shift discards a span and re-rotates what follows, every step equals "
    "the model over the rows left at their new positions",
    check_context_shift,
    shift_plans(),
    failures.WRONG_RESULTS,
    requires=("shift",),
    pinned=on_both_paths(PINNED),
    since="1.2",
)


class ShiftTests(KitTests):
    """Context shift (``shift``): run when offered."""

    test_after_a_context_shift_each_step_equals_the_model_over_the_rows_left = property_test(
        CONTEXT_SHIFT
    )
