"""Core: cached decoding computes what the uncached model computes, step by step.

A ``Scenario`` (``kvcheck.strategies``) is a model, a batch, a dtype and sessions, each a
prompt and decode chunks on fresh or reset caches. ``run`` plays each session's events
(``session_events``: the plans' one vocabulary) through the session engine and yields each
feed beside the uncached model's answer over the whole session:

- ``logits``: every new position's cached logits equal the uncached model's (on both paths
  of the model through a cache: append, and attend where the cache offers it);
- ``lengths``: lengths grow by the chunk and append returns exactly the rows given;
- ``contents``: each layer holds the uncached pass's rotated keys and its values.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from torch import Tensor

from kvcheck import asserts as kvassert
from kvcheck import failures, grammar, reach
from kvcheck import scope as kvscope
from kvcheck import strategies as kvst
from kvcheck import tensors as kvtensors
from kvcheck.kit import KitTests, Property, edge_test, property_test
from kvcheck.plan_events import Feed, Poison, Reset, Start
from kvcheck.reach import Edge
from kvcheck.session import Engine, Request, assert_logits, diagnose
from kvcheck.session.checks import check_returned
from kvref import CacheFactory
from kvref.protocol import keys_stored

Event = Start | Reset | Feed | Poison  # a core session's plan events


@dataclass(frozen=True, kw_only=True)
class Step:
    """One model call on the caches, with the uncached model's answer for the same positions.

    ``request`` holds the live recorders: a Step describes them as they are right after its
    call, and only until the generator that yielded it moves on.
    """

    scenario: kvst.Scenario
    session_index: int
    step_index: int
    start: int  # absolute position of the first new token
    end: int  # one past the last
    logits: Tensor
    expected_logits: Tensor
    request: Request
    lengths_before: list[int]
    # Each layer's K (rotated, or as the cache keeps them: section 8.4) and V over the session.
    oracle_kv: list[tuple[Tensor, Tensor]]
    # In half precision, the float64 model's uncached pass over the session (logits, K and V),
    # which the error budget measures both runs against, made when first asked for; else None.
    reference: Callable[[], tuple[Tensor, list[tuple[Tensor, Tensor]]]] | None = None

    @property
    def caches(self):
        return self.request.caches

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
        scenario, session = self.scenario, self.scenario.sessions[self.session_index]
        size = session.chunks[self.step_index]
        kind = "prefill" if self.step_index == 0 else "decode"
        return (
            f"session #{self.session_index} (of {len(scenario.sessions)}), step "
            f"#{self.step_index} (of {len(session.chunks)}): {kind} of {size} tokens at absolute "
            f"positions {self.start}..{self.start + size - 1}, {self.request.caches[0].path} "
            f"path\n  session plan: {session.describe()}\n  model: {scenario.describe()}"
        )


# What a scenario's steps must reach (kvcheck.reach): each noted as its step runs.
SCENARIO_EDGES = tuple(
    Edge(name)
    for name in (
        "a prefill of 1 token",
        "a decode of 1 token",
        "a chunk of several tokens after the prefill",
        f"a length 1 below a {kvst.EDGE}-row edge",
        f"a length at a {kvst.EDGE}-row edge",
        f"a length 1 past a {kvst.EDGE}-row edge",
        f"a session past {kvst.LONG_SESSION} tokens",
        "a later session on reset caches",
        "a later session on fresh caches",
        "a batch of 2 or more",
        "fewer kv heads than heads",
        "2 or more layers",
        "a window layer",
        "half precision",
        "every row max_length allows",
    )
)
POISONED_EDGES = tuple(
    Edge(f"a reset after {kind} rows") for kind in sorted(kvtensors.POISON_VALUES)
)
POISON_KINDS = tuple(sorted(kvtensors.POISON_VALUES))
MOST_POISON_ROWS = 4  # what a session leaves at most (kvcheck.strategies.finish_session)
# A row in codes judged under section 10.1's newer declarations (noted by
# kvcheck.asserts.rows_not_held), reachable only on a cache that declares each.
LOSSY_EDGES = (
    Edge("a coded row judged by its group along tokens", needs=("codes along tokens",)),
    Edge("a coded number saturated at a fixed scale", needs=("a fixed scale",)),
    Edge("a coded row under a floor on the step", needs=("a floor on the step",)),
)


def note_session(scenario: kvst.Scenario, index: int) -> None:
    """Note the edges that session ``index`` of ``scenario`` reaches as a whole."""
    session, config = scenario.sessions[index], scenario.config
    if index:
        reach.note(f"a later session on {session.start} caches")
        if (poison := scenario.sessions[index - 1].poison) is not None:
            reach.note(f"a reset after {poison} rows")
    if session.length > kvst.LONG_SESSION:
        reach.note(f"a session past {kvst.LONG_SESSION} tokens")
    if session.length + session.poison_rows == scenario.max_length:
        reach.note("every row max_length allows")
    for said, reached in (
        ("a batch of 2 or more", scenario.batch >= 2),
        ("fewer kv heads than heads", config.num_kv_heads < config.num_heads),
        ("2 or more layers", config.num_layers >= 2),
        ("a window layer", config.window is not None),
        ("half precision", scenario.dtype in kvst.HALF_DTYPES),
    ):
        if reached:
            reach.note(said)


def note_step(step_index: int, size: int, end: int) -> None:
    """Note the edges a step of ``size`` tokens ending at length ``end`` reaches."""
    if step_index == 0 and size == 1:
        reach.note("a prefill of 1 token")
    elif step_index and size == 1:
        reach.note("a decode of 1 token")
    elif step_index:
        reach.note("a chunk of several tokens after the prefill")
    offset = {kvst.EDGE - 1: "1 below", 0: "at", 1: "1 past"}.get(end % kvst.EDGE)
    if offset is not None and end >= kvst.EDGE - 1:
        reach.note(f"a length {offset} a {kvst.EDGE}-row edge")


def session_events(session: kvst.Session, index: int, batch: int) -> tuple[Event, ...]:
    """Session ``index`` as plan events of its request, ``r<index>``: its start, on fresh
    caches or, where it starts on them, on the caches of the session before, reset; a feed
    per chunk; then the poisoned rows it leaves the next session."""
    reset = index > 0 and session.start == "reset"
    events: list[Event] = [Reset(index - 1)] if reset else []
    events.append(Start(index, batch, reuse=index - 1 if reset else None))
    events += [Feed(index, size) for size in session.chunks]
    if session.poison:
        events.append(Poison(index, session.poison, session.poison_rows))
    return tuple(events)


def sessions_of(events: tuple) -> list[kvst.Session]:
    """The sessions ``events`` are, ``session_events`` undone: each from its ``Start``, its
    feeds its chunks, its token seed its number (sessions of the same tokens would let old
    rows pass for new ones)."""
    sessions: list[dict] = []
    for event in events:
        if isinstance(event, Start):
            start = "fresh" if event.reuse is None else "reset"
            sessions.append({"chunks": [], "start": start, "poison": None, "poison_rows": 0})
        elif isinstance(event, Feed):
            sessions[-1]["chunks"].append(event.size)
        elif isinstance(event, Poison):
            sessions[-1].update(poison=event.kind, poison_rows=event.rows)
    return [
        kvst.Session(tuple(fields.pop("chunks")), token_seed=index, **fields)
        for index, fields in enumerate(sessions)
    ]


def run(factory: CacheFactory, scenario: kvst.Scenario, path: str = "append") -> Iterator[Step]:
    """Run every session of ``scenario`` on caches from ``factory``, yielding each step: one
    request at a time, each session's (``session_events``)."""
    model = scenario.model()
    plan = f"plan: {scenario.in_words()}"
    engine = Engine(
        factory, model, max_length=scenario.max_length, path=path, describe=lambda: plan
    )
    request: Request | None = None
    for session_index, session in enumerate(scenario.sessions):
        name = f"session #{session_index}"
        note_session(scenario, session_index)
        start = step_index = 0
        oracle = None  # the uncached pass over the session, once its caches are known
        for event in session_events(session, session_index, scenario.batch):
            if isinstance(event, Start):
                if event.reuse is None and request is not None:
                    engine.drop(request)  # the session before's caches: fresh ones now
                reuse = None if event.reuse is None else request
                request = engine.start(name, event.batch, reuse=reuse)
                continue
            if not isinstance(event, Feed):  # the reset before a start, or poison after
                engine.play(request, event)
                continue
            if oracle is None:
                oracle = uncached_pass(scenario, session, request)
            tokens, expected_logits, oracle_kv, reference = oracle
            end = start + event.size
            lengths_before = [cache.length for cache in request.caches]
            # Its logits are compared by the caller, at the step's positions.
            logits = engine.feed(request, tokens[:, start:end], compare=False)
            note_step(step_index, event.size, end)
            yield Step(
                scenario=scenario,
                session_index=session_index,
                step_index=step_index,
                start=start,
                end=end,
                logits=logits,
                expected_logits=expected_logits[:, start:end],
                request=request,
                lengths_before=lengths_before,
                oracle_kv=oracle_kv,
                reference=reference,
            )
            engine.check(f"step #{step_index} of {name}")
            start, step_index = end, step_index + 1
    engine.finish(blocks_back=False)  # the caller's loop may still hold the last step


def uncached_pass(scenario: kvst.Scenario, session: kvst.Session, request: Request):
    """The session's tokens, the uncached model's logits and each layer's K and V over them
    (keys as ``request``'s caches keep them, rotated or not), and in half precision the
    float64 model's, made when first asked for (else None)."""
    tokens = scenario.tokens(session)
    stored = keys_stored(request.caches[0])
    expected_logits, oracle_kv = scenario.model().forward_with_kv(tokens, keys=stored)
    truth = scenario.reference().forward_with_kv
    reference = (
        functools.cache(functools.partial(truth, tokens, keys=stored))
        if kvassert.needs_reference(scenario.dtype)
        else None
    )
    return tokens, expected_logits, oracle_kv, reference


def check_logits_match_uncached(
    factory: CacheFactory, scenario: kvst.Scenario, *, path: str = "append"
) -> None:
    """Every new position's cached logits equal the uncached model's."""
    truth = functools.cache(lambda session: scenario.reference()(scenario.tokens(session)))
    for step in run(factory, scenario, path):
        session = scenario.sessions[step.session_index]
        try:
            assert_logits(
                step.logits,
                step.expected_logits,
                lambda: truth(session)[:, step.start : step.end],  # noqa: B023
                where=step.where(),
                start=step.start,
                path=step.request.path,
                lossy=kvassert.coarsest(step.request.caches),
                budgets=kvassert.budgets_for(step.request.caches),
                rows_held=lambda: check_returned(step.request, step.end, step.where()),  # noqa: B023
            )
        except failures.WrongResults as error:
            diagnose(error, step.scenario.model(), step.request)
            raise


def check_lengths(factory: CacheFactory, scenario: kvst.Scenario) -> None:
    """Lengths grow by the chunk, layers agree, and append returns exactly the rows given
    since the reset: no stale or unwritten rows, none moved, none changed."""
    for step in run(factory, scenario):
        where = step.where()
        for layer, cache in enumerate(step.caches):
            expected = step.lengths_before[layer] + step.new_tokens
            kvassert.assert_length(cache, expected, who=f"layer {layer}", where=where)
            kvassert.assert_returned_rows(cache, who=f"layer {layer}", where=where)


def check_contents(factory: CacheFactory, scenario: kvst.Scenario) -> None:
    """What each layer holds equals the uncached pass's rotated keys and its values."""
    for step in run(factory, scenario):
        for layer, cache in enumerate(step.caches):
            for which, (name, got) in enumerate(
                zip(("keys", "values"), cache.returned, strict=True)
            ):
                first = step.end - got.shape[2]  # with a window, a recent run of the rows
                want, reference = step.uncached_rows(layer, which, first)
                kvassert.assert_close_at(
                    got,
                    want,
                    what=f"layer {layer}'s cached {name} and the uncached pass's "
                    f"({keys_stored(cache)}) {name}",
                    where=step.where(),
                    position_axis=2,
                    first_position=first,
                    failure=failures.DataLoss,
                    reference=reference,
                    lossy=kvassert.coarsest(step.caches),
                )


def every_session(scope: kvscope.Scope) -> Iterator[kvst.Scenario]:
    """Every session of up to ``scope.tokens`` tokens in every split into a prefill and
    decode chunks, on fresh caches, on each model of the scope: (2^N - 1) per model."""
    for tokens in range(1, scope.tokens + 1):
        for layout in scope.layouts:
            yield from sentences_of_sessions(layout, scope, tokens, 1)


def sentences_of_sessions(
    layout: kvscope.Layout, scope: kvscope.Scope, total: int, count: int, **config
) -> Iterator[kvst.Scenario]:
    """Every scenario of ``count`` sessions of exactly ``total`` tokens (poison rows too) on
    ``layout``: the sentences of the sessions' plan events (``session_events``, through
    ``kvcheck.grammar``): each session fed in every split into chunks, each later one on the
    reset caches of the one before or on fresh ones, every one but the last leaving 1 to
    ``MOST_POISON_ROWS`` rows of each kind of poison; ``config`` for the model beside the
    layout's (``kvscope.scenario``: a window, sinks)."""
    batch = layout.batch

    def moves(state: tuple[int, int, bool], left: int):
        index, fed, over = state  # the session, its tokens so far, its poison left
        if over:  # the next session starts, on the reset caches or on fresh ones
            yield (Reset(index), Start(index + 1, batch, reuse=index)), (index + 1, 0, False), 0
            yield (Start(index + 1, batch),), (index + 1, 0, False), 0
            return
        for size in range(1, left + 1):
            yield (Feed(index, size),), (index, fed + size, False), size
        if fed and index < count - 1:  # every session but the last leaves poison
            for kind in POISON_KINDS:
                for rows in range(1, min(MOST_POISON_ROWS, left) + 1):
                    yield (Poison(index, kind, rows),), (index, fed, True), rows

    def ends(state: tuple[int, int, bool]) -> bool:
        index, fed, over = state
        return index == count - 1 and fed > 0 and not over

    # Fewest events first within the tokens: a failure's first plan is its fewest calls.
    for events in sorted(grammar.sentences(total, (0, 0, False), moves, ends), key=len):
        sessions = sessions_of((Start(0, batch), *events))
        yield kvscope.scenario(layout, scope, sessions, **config)


SCENARIOS = kvst.scenarios()
LOGITS = Property(
    "logits",
    "cached logits equal uncached logits at every new position of every step",
    check_logits_match_uncached,
    SCENARIOS,
    failures.WRONG_RESULTS,
    paths=True,
    pinned=kvst.PINNED,
    edges=kvst.EDGES,
    reaches=SCENARIO_EDGES,
    every_plan=every_session,
    exhaustive_tokens=8,
    since="1.0",
    holds=(
        "cached logits equal uncached logits at every new position, every step (`assert_close`: "
        "float64 at 1e-9, float32 at 1e-4; bfloat16 and float16 within an [error "
        "budget](half-precision.md) against the float64 model), also at hand-picked edges"
    ),
)
LENGTHS = Property(
    "lengths",
    "lengths grow by each chunk; append returns exactly the rows given, bit for bit",
    check_lengths,
    SCENARIOS,
    failures.DATA_LOSS,
    pinned=kvst.PINNED,
    edges=kvst.EDGES,
    reaches=SCENARIO_EDGES + LOSSY_EDGES,
    every_plan=every_session,
    exhaustive_tokens=8,
    since="1.0",
    holds=(
        "lengths grow by each chunk in every layer; `append` returns exactly the rows given since "
        "the reset, bit for bit"
    ),
)
CONTENTS = Property(
    "contents",
    "each layer holds the uncached pass's rotated keys and its values",
    check_contents,
    SCENARIOS,
    failures.DATA_LOSS,
    pinned=kvst.PINNED,
    edges=kvst.EDGES,
    reaches=SCENARIO_EDGES,
    every_plan=every_session,
    exhaustive_tokens=8,
    since="1.0",
)


class CoreTests(KitTests):
    """Cached decoding computes what the uncached model computes, step by step."""

    test_logits_match_uncached = property_test(LOGITS)
    test_logits_at_edges = edge_test(LOGITS)
    test_length_invariants = property_test(LENGTHS)
    test_lengths_at_edges = edge_test(LENGTHS)
    test_contents_equal_uncached_keys_and_values = property_test(CONTENTS)
    test_contents_at_edges = edge_test(CONTENTS)
