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

- ``attention sinks``: where the cache declares a sink count other than 0.
"""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import strategies as st

from kvcheck import failures
from kvcheck import sizes as kvsizes
from kvcheck import strategies as kvst
from kvcheck.kit import KitTests, Property, on_both_paths, path_for, property_test
from kvcheck.session import Engine
from kvref import CacheFactory, ModelConfig

# Windows around the chunk sizes drawn, from one row (the sinks and the query alone) up.
SINK_WINDOWS = st.one_of(
    st.integers(1, 4), st.sampled_from(kvst.BOUNDARY_SIZES), st.integers(5, 2 * kvst.EDGE + 1)
)


@dataclasses.dataclass(frozen=True)
class SinkPlan:
    """A scenario whose model has a window with sinks, and the path it takes."""

    scenario: kvst.Scenario
    path: str = "append"

    def describe(self) -> str:
        sessions = "; ".join(session.describe() for session in self.scenario.sessions)
        return f"sinks plan: {sessions}, {self.path} path\n  model: {self.scenario.describe()}"

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
    return SinkPlan(dataclasses.replace(scenario, config=config), path)


def check_sinks(factory: CacheFactory, plan: SinkPlan) -> None:
    """Every step's logits equal the uncached sink model's, and every append returns the
    sinks and a recent run of the rows given, bit for bit."""
    scenario = plan.scenario
    if scenario.config.sinks not in kvsizes.domain().sink_counts:
        raise kvsizes.OutsideDomain(f"{scenario.config.sinks} sinks")
    path = path_for(plan.path, factory)
    engine = Engine(
        factory, scenario.model(), max_length=scenario.max_length, path=path, describe=plan.describe
    )
    request = None
    for index, session in enumerate(scenario.sessions):
        if session.start == "fresh" or request is None:
            if request is not None:
                engine.drop(request)
            request = engine.start(f"session #{index}", scenario.batch)
        else:
            engine.reset(request)
            request = engine.start(f"session #{index}", scenario.batch, reuse=request)
        tokens = scenario.tokens(session)
        start = 0
        for step, size in enumerate(session.chunks):
            engine.feed(request, tokens[:, start : start + size], at=f" (chunk #{step})")
            engine.check(f"session #{index}, chunk #{step}")
            start += size
    engine.finish()


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

ATTENTION_SINKS = Property(
    "attention sinks",
    "a window cache keeping the first tokens as sinks computes what the uncached model "
    "computes under the sink-and-window mask, however often its ring wraps",
    check_sinks,
    sink_plans(),
    failures.WRONG_RESULTS,
    requires=("sinks",),
    pinned=on_both_paths((SinkPlan(WRAPS),)),
    since="1.2",
)


class SinksTests(KitTests):
    """Attention sinks beside a window: run where the cache declares sink counts."""

    test_a_window_with_sinks_equals_the_uncached_sink_model = property_test(ATTENTION_SINKS)
