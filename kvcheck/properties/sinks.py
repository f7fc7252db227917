"""Attention sinks (docs/contract.md, section 8.5): a window cache that also keeps the first
S tokens of a session, as StreamingLLM does, so that a model can stream past its window.

A cache offers sinks by declaring the counts it takes (``kv_sizes = {"supports": {"sinks":
(0, 1, 4)}}``); the other properties draw plain windows (0 sinks) for it, and this one draws
every declared count beside windows around the chunk sizes, in sessions long enough that the
ring wraps many times, with the sinks at the positions they were given or, as StreamingLLM
numbers its cache, just before each query's window (``ModelConfig.sink_positions``: the
model's convention, under which a cache returns the same rows). The oracle is the one of
every property: the uncached model under the sink-and-window mask (``ModelConfig.sinks``),
each step's logits over the whole session, and what ``append`` returned bit for bit the
sinks, then a recent run of the rows given.

Between chunks a plan may truncate (back into the sinks, too) or reorder, where the cache
offers it: the other properties draw 0 sinks, so only here do the sinks meet an edit.

- ``attention sinks``: where the cache declares a sink count other than 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch
from hypothesis import strategies as st

from kvcheck import failures, reach
from kvcheck import scope as kvscope
from kvcheck import sizes as kvsizes
from kvcheck import strategies as kvst
from kvcheck.kit import KitTests, Property, on_both_paths, path_for, property_test
from kvcheck.plan_events import Reorder, Truncate, reorder_indices
from kvcheck.properties.core import sentences_of_sessions
from kvcheck.session import Engine
from kvref import CacheFactory, ModelConfig
from kvref.reprs import short_repr

# Windows around the chunk sizes drawn, from one row (the sinks and the query alone) up.
SINK_WINDOWS = st.one_of(
    st.integers(1, 4), st.sampled_from(kvst.BOUNDARY_SIZES), st.integers(5, 2 * kvst.EDGE + 1)
)


@dataclasses.dataclass(frozen=True)
class SinkEdit:
    """After chunk ``chunk`` of session ``session``, ``event`` on it (the session's request
    is ``r<session>``): a truncate (a rollback, into the sinks where it goes past them) or a
    reorder of the rows (beam search), where the cache offers it."""

    session: int
    chunk: int
    event: Truncate | Reorder

    def describe(self) -> str:
        return f"{self.event.describe()} after chunk #{self.chunk} of session #{self.session}"


@short_repr
@dataclasses.dataclass(frozen=True)
class SinkPlan:
    """A scenario whose model has a window with sinks, the path it takes, and the edits
    made between its chunks."""

    scenario: kvst.Scenario
    path: str = "append"
    edits: tuple[SinkEdit, ...] = ()

    def describe(self) -> str:
        sessions = "; ".join(session.describe() for session in self.scenario.sessions)
        edits = "".join(f", {edit.describe()}" for edit in self.edits)
        return (
            f"sinks plan: {sessions}{edits}, {self.path} path\n  model: {self.scenario.describe()}"
        )

    def summary(self) -> tuple[str, str, str]:
        return self.scenario.summary()


@st.composite
def sink_plans(draw) -> SinkPlan:
    """A scenario (sessions fresh or reset, prompts and chunks) on a model whose window
    layers keep one of the declared sink counts beside a window near the chunk sizes."""
    scenario = draw(kvst.scenarios(max_sessions=2), label="scenario")
    counts = kvsizes.domain().sink_counts
    config = dataclasses.replace(
        scenario.config,
        window=draw(SINK_WINDOWS, label="window"),
        sinks=draw(st.sampled_from(counts), label="sinks"),
        # Both conventions on every sink cache: what it returns is the same under each.
        sink_positions=draw(st.sampled_from(("original", "in cache")), label="sink positions"),
    )
    # Sinks at positions in the cache take the append path: the model attends over them.
    paths = ("append",) if config.sink_positions == "in cache" else ("append", "attend")
    path = draw(st.sampled_from(paths), label="path")
    edits = draw(st.lists(sink_edits(scenario, config.sinks), max_size=2), label="edits")
    return SinkPlan(dataclasses.replace(scenario, config=config), path, tuple(edits))


@st.composite
def sink_edits(draw, scenario: kvst.Scenario, sinks: int) -> SinkEdit:
    """A truncate or a reorder after some chunk: a truncate back into the sinks (every
    token, where it goes that far), or of a few tokens; a reorder of 2 rows or more."""
    session = draw(st.integers(0, len(scenario.sessions) - 1), label="edit in session")
    chunks = scenario.sessions[session].chunks
    chunk = draw(st.integers(0, len(chunks) - 1), label="edit after chunk")
    if scenario.batch > 1 and draw(st.booleans(), label="reorder"):
        indices = draw(reorder_indices(scenario.batch), label="indices")
        return SinkEdit(session, chunk, Reorder(session, indices))
    held = sum(chunks[: chunk + 1])
    few = st.integers(1, min(held, 4))
    into_the_sinks = st.integers(max(held - sinks + 1, 1), held) if sinks else few  # to < S
    back = draw(st.one_of(into_the_sinks, few), label="truncate by")
    return SinkEdit(session, chunk, Truncate(session, back))


ONE_SINK = "1 sink"
SEVERAL_SINKS = "several sinks"
WINDOW_OF_ONE = "a window of 1 beside the sinks"
IN_CACHE = "sinks at their positions in the cache"
ORIGINAL = "sinks at their original positions"
ON_ATTEND = "sinks on the attend path"
CROSSING = "a chunk crossing the last sink"
WRAPPED = "the ring wrapped past the sinks"
AFTER_RESET = "sinks of a session on reset caches"
TRUNCATE_INTO = "truncate into the sinks"
TRUNCATE_WRAPPED = "truncate after the ring wrapped past the sinks"
REORDER_BOTH = "reorder of the sinks and the window"
REORDER_WRAPPED = "reorder after the ring wrapped past the sinks"


def note_where(edges: dict[str, bool]) -> None:
    """Note each edge whose case holds."""
    reach.note(*(name for name, reached in edges.items() if reached))


def plan_edges(config: ModelConfig, path: str) -> dict[str, bool]:
    """The edges a plan's model and path reach from its start, each with whether it does."""
    return {
        ONE_SINK: config.sinks == 1,
        SEVERAL_SINKS: config.sinks > 1,
        WINDOW_OF_ONE: config.window == 1 and config.sinks > 0,
        IN_CACHE: config.sinks > 0 and config.sink_positions == "in cache",
        ORIGINAL: config.sinks > 0 and config.sink_positions == "original",
        ON_ATTEND: config.sinks > 0 and path == "attend",
    }


def check_sinks(factory: CacheFactory, plan: SinkPlan) -> None:
    """Every step's logits equal the uncached sink model's, and every append returns the
    sinks and a recent run of the rows given, bit for bit; so after each truncate (into the
    sinks too) and reorder."""
    scenario = plan.scenario
    config = scenario.config
    if config.sinks not in kvsizes.domain().sink_counts:
        raise kvsizes.OutsideDomain(f"{config.sinks} sinks")
    path = path_for(plan.path, factory)
    engine = Engine(
        factory, scenario.model(), max_length=scenario.max_length, path=path, describe=plan.describe
    )
    sinks, kept = config.sinks, config.sinks + config.window - 1  # the rows a ring holds
    note_where(plan_edges(config, path))
    request = None
    for index, session in enumerate(scenario.sessions):
        if session.start == "fresh" or request is None:
            if request is not None:
                engine.drop(request)
            request = engine.start(f"session #{index}", scenario.batch)
        else:
            engine.reset(request)
            request = engine.start(f"session #{index}", scenario.batch, reuse=request)
            note_where({AFTER_RESET: sinks > 0})
        tokens = scenario.tokens(session)
        start = 0
        for step, size in enumerate(session.chunks):
            held = request.held
            engine.feed(request, tokens[:, start : start + size], at=f" (chunk #{step})")
            engine.check(f"session #{index}, chunk #{step}")
            note_where(
                {CROSSING: held < sinks < held + size, WRAPPED: sinks > 0 and held + size > kept}
            )
            start += size
            for edit in plan.edits:
                if (edit.session, edit.chunk) == (index, step):
                    run_edit(engine, request, edit, sinks, kept, f"session #{index}")
    engine.finish()


def run_edit(engine: Engine, request, edit: SinkEdit, sinks: int, kept: int, where: str):
    """``edit`` on ``request`` where its caches offer it; the edges it reaches noted."""
    held, at = request.held, f" ({edit.describe()})"
    wrapped = sinks > 0 and held > kept
    event = edit.event
    if not engine.offers(request, event):
        return
    if engine.play(request, event, at=at):  # else a truncate refused as a window may
        if isinstance(event, Reorder):
            note_where({REORDER_BOTH: held > sinks > 0, REORDER_WRAPPED: wrapped})
        else:
            note_where({TRUNCATE_INTO: event.target(held) < sinks, TRUNCATE_WRAPPED: wrapped})
    engine.check(f"{where}, {edit.describe()}")


# --- Every plan within a scope (kvcheck.scope), for the bounded-exhaustive mode ---


def sink_shapes(tokens: int, counts: tuple[int, ...]) -> Iterator[tuple[int, int]]:
    """``(sinks, window)`` for a session of ``tokens`` tokens: each of ``counts`` from 1 to
    ``tokens - 1`` (a session of no more tokens than sinks is all sinks: no window to
    wrap), beside each window of 1 to ``tokens - sinks``: those under which some query of
    the session sees fewer than all the tokens (up to ``tokens - sinks - 1``) and the one
    that just holds them all (the ring full to its last slot, where a ring a slot too small
    shows)."""
    for sinks in counts:
        if 0 < sinks < tokens:
            for window in range(1, tokens - sinks + 1):
                yield sinks, window


def every_sink_plan(scope: kvscope.Scope) -> Iterator[SinkPlan]:
    """Every session of 1 to ``scope.tokens`` tokens, in every split into a prefill and
    decode chunks, on fresh caches, on each of the scope's layouts with each sink count the
    domain takes and each window (``sink_shapes``), on the append and the attend path:
    fewest tokens first, then the layouts. At n tokens 2 * 2^(n-1) * sum over the counts s
    below n of (n - s) plans a layout; for counts 1, 2, 4: 0, 4, 24, 80, 256, 704 at 1 to 6
    tokens.

    Fixed, and why: sinks at their original positions (a cache is handed the same calls
    under either convention on the append path and returns the same rows, which every step
    reads back bit for bit; the attend path takes the original ones alone); one session, no
    reset (a session on reset caches is the search's); no truncate or reorder between the
    chunks (the search's: each multiplies the plans by the lengths held or the rows)."""
    counts = tuple(count for count in kvsizes.domain().sink_counts if count)
    for tokens in range(1, scope.tokens + 1):
        for layout in scope.layouts:
            for sinks, window in sink_shapes(tokens, counts):
                shaped = dict(window=window, sinks=sinks)
                for scenario in sentences_of_sessions(layout, scope, tokens, 1, **shaped):
                    for path in ("append", "attend"):
                        yield SinkPlan(scenario, path)


# Tried first on every run: four sinks beside a window of 3, a prompt that fills the sinks
# and part of the window, then decode steps until the ring has wrapped three times, on a
# reset cache too (a sink evicted on the first wrap shows at the step after it).
WRAPS = kvst.Scenario(
    config=ModelConfig(
        vocab_size=19, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4, window=3, sinks=4
    ),
    batch=2,
    dtype=torch.float64,
    sessions=(
        kvst.Session(chunks=(5, *(1,) * 10, 3), token_seed=3, start="fresh"),
        kvst.Session(chunks=(2, 3, 1, 1, 1, 1, 5), token_seed=4, start="reset"),
    ),
)

# And the same with edits where the cache offers them: a reorder after the ring wrapped
# (the sinks must move with their rows), then a truncate back into the sinks and chunks that
# fill them again, one crossing the last sink (a truncate that shortens the ring alone).
EDITED_WRAPS = SinkPlan(
    WRAPS, edits=(SinkEdit(0, 8, Reorder(0, (1, 0))), SinkEdit(0, 9, Truncate(0, 12)))
)

SINK_EDGES = (
    reach.Edge(ONE_SINK, needs=("sinks",)),
    reach.Edge(SEVERAL_SINKS, needs=("sinks",)),
    reach.Edge(WINDOW_OF_ONE, needs=("sinks",)),
    reach.Edge(IN_CACHE, needs=("sinks",)),
    reach.Edge(ORIGINAL, needs=("sinks",)),
    reach.Edge(ON_ATTEND, needs=("sinks", "attend")),
    reach.Edge(CROSSING, needs=("sinks",)),
    reach.Edge(WRAPPED, needs=("sinks",)),
    reach.Edge(AFTER_RESET, needs=("sinks",)),
    reach.Edge(TRUNCATE_INTO, needs=("sinks", "truncate")),
    reach.Edge(TRUNCATE_WRAPPED, needs=("sinks", "truncate")),
    reach.Edge(REORDER_BOTH, needs=("sinks", "reorder")),
    reach.Edge(REORDER_WRAPPED, needs=("sinks", "reorder")),
)

ATTENTION_SINKS = Property(
    "attention sinks",
    "a window cache keeping the first tokens as sinks computes what the uncached model "
    "computes under the sink-and-window mask, however often its ring wraps",
    check_sinks,
    sink_plans(),
    failures.WRONG_RESULTS,
    requires=("sinks",),
    pinned=on_both_paths((SinkPlan(WRAPS), EDITED_WRAPS)),
    reaches=SINK_EDGES,
    since="1.2",
    every_plan=every_sink_plan,
    exhaustive_tokens=6,
    holds=(
        "a model whose window layers keep the session's first S tokens beside a window of W "
        "(`ModelConfig.sinks`), S each of the counts the cache declares (`supports: sinks`), W "
        "around the chunk sizes, in scenarios long enough that the ring wraps many times, fresh and"
        " reset, on both paths, the sinks at the positions they were given or at their positions in"
        " the cache as StreamingLLM numbers it (`ModelConfig.sink_positions`): every step's logits "
        "equal the uncached model's under the sink-and-window mask, and every `append` returns the "
        "sinks, then a recent run, bit for bit the rows given (contract, section 8.5; where the "
        "cache declares a sink count other than 0)"
    ),
)


class SinksTests(KitTests):
    """Attention sinks beside a window: run where the cache declares sink counts."""

    test_a_window_with_sinks_equals_the_uncached_sink_model = property_test(ATTENTION_SINKS)
