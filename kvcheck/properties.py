"""Every property of the kit, defined once: a check, the strategy that draws its input, and
what its failure means.

A check is a plain function ``check(factory, drawn)`` (or ``check(factory, drawn, case)``
for a property with a table of cases) that raises a ``kvcheck.failures.PropertyFailure``
when the property does not hold for the drawn input. ``ALL`` is the registry: the base test
classes bind each property to one test (``kvcheck.base``), the verdict has a row for each,
and this repository's mutant hunt searches them in this order, so cheap properties that
catch most come first.

To add a property: write its check here, add a ``Property`` to ``ALL``, and bind it in the
right class of ``kvcheck.base`` (this repository's
``tests/test_plugin.py::test_every_property_is_bound_by_the_kit_and_reported`` fails until
every property is bound).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from kvcheck import asserts as kvassert
from kvcheck import badinput as kvbad
from kvcheck import failures
from kvcheck import requests as kvreq
from kvcheck import strategies as kvst
from kvcheck.attend import attend_plans, check_attend
from kvcheck.exhaustion import check_exhausted_pool, exhaustion_plans
from kvcheck.harness import Step, build, may_refuse, record, run, warm
from kvcheck.stateful import probe_spec, run_machine
from kvref import BlockPool, CacheFactory, capabilities, min_nbytes


def check_logits_match_uncached(factory: CacheFactory, scenario: kvst.Scenario) -> None:
    """Every new position's cached logits equal the uncached model's."""
    for step in run(factory, scenario):
        try:
            kvassert.assert_close_at(
                step.logits,
                step.expected_logits,
                what="cached and uncached logits",
                where=step.where(),
                position_axis=1,
                first_position=step.start,
                reference=step.reference_logits,
            )
        except failures.WrongResults as error:
            error.add_note(first_wrong_layer(step))
            raise


def first_wrong_layer(step: Step) -> str:
    """Which layer's cache first hands back keys or values the uncached pass did not make:
    the first place to look when logits diverge (later layers inherit its error)."""
    for layer, cache in enumerate(step.caches):
        for which, (name, got) in enumerate(zip(("keys", "values"), cache.returned, strict=True)):
            # A window returns the last rows.
            want, reference = step.uncached_rows(layer, which, step.end - got.shape[2])
            if got.shape != want.shape:
                return (
                    f"  diagnosis: layer {layer}'s cache returned {name} shaped "
                    f"{tuple(got.shape)}, not {tuple(want.shape)}"
                )
            rows = kvassert.diverging_positions(got, want, 2, reference)
            if rows:
                return (
                    f"  diagnosis: layer {layer} is the first whose cache returned {name} unlike "
                    f"the uncached pass's, at rows {rows[:8]}{' ...' if len(rows) > 8 else ''}"
                )
    return (
        "  diagnosis: every layer's cache returned the uncached pass's keys and values, so the "
        "model used them wrongly (mask, positions) or the cache changed them after returning"
    )


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
                    what=f"layer {layer}'s cached {name} and the uncached pass's (rotated) {name}",
                    where=step.where(),
                    position_axis=2,
                    first_position=first,
                    failure=failures.DataLoss,
                    reference=reference,
                )


def check_isolation(factory: CacheFactory, plan: kvst.IsolationPlan) -> None:
    """Two caches from one factory, given distinct rows in turns, each return only their own."""
    caches = {"A": build(factory, plan.spec), "B": build(factory, plan.spec)}
    # Each plan's appends in turns, then one more row for each cache, once both plans are
    # done, to read both back after every append of the other.
    steps = max(map(len, plan.chunks))
    turns = [[*chunks, *[0] * (steps - len(chunks)), 1] for chunks in plan.chunks]
    for step in range(steps + 1):
        for which, ((name, cache), sizes) in enumerate(zip(caches.items(), turns, strict=True)):
            if not sizes[step]:
                continue
            new = kvst.random_rows(plan.spec, sizes[step], seed=1000 * which + step)
            cache.append(new, new * 3)
            where = f"append #{step} of cache {name}: {plan.describe()}"
            kvassert.assert_length(cache, cache.given_length, who=f"cache {name}", where=where)
            kvassert.assert_returned_rows(cache, who=f"cache {name}", where=where)


def check_stale_rows(factory: CacheFactory, plan: kvst.StaleRowsPlan) -> None:
    """Rows given before a reset (or to another cache), even nan, inf or huge ones, never
    come back."""
    cache = build(factory, plan.spec)
    for round_ in range(plan.rounds):
        if round_:  # room for the poison: the last round's clean rows go the same way
            cache = clear(factory, cache, plan, f"the start of round #{round_}")
        for rows in plan.poisoned:
            bad = kvst.random_rows(plan.spec, rows, seed=rows).fill_(
                kvst.poison_value(plan.poison, plan.spec.dtype)
            )
            cache.append(bad, bad.clone())
        cache = clear(factory, cache, plan, f"round #{round_}")
        for step, rows in enumerate(plan.clean):
            clean = kvst.random_rows(plan.spec, rows, seed=step + round_)
            cache.append(clean, clean * 2)
            where = f"clean append #{step} of round #{round_} of {plan.describe()}"
            kvassert.assert_returned_rows(cache, who="the cache", where=where)


def clear(factory: CacheFactory, cache, plan: kvst.StaleRowsPlan, when: str):
    """The cache reset, or a fresh one from the factory, as the plan says: empty."""
    if plan.how == "reset":
        cache.reset()
    else:
        cache = build(factory, plan.spec)
    kvassert.fail_if_not_empty([cache], f"{when} of {plan.describe()}")
    return cache


def check_bad_append(factory: CacheFactory, plan: kvst.CachePlan, case: kvbad.BadInput) -> None:
    """``case`` applied to a warm cache is refused as the contract says and changes nothing."""
    good = kvst.random_rows(plan.spec, plan.new_tokens, seed=7)
    check_refused(factory, plan, case, "append", lambda cache: case.make(good, good.clone()))


def check_refused(factory: CacheFactory, plan: kvst.CachePlan, case, method: str, make) -> None:
    """``method`` of a cache warmed by ``plan``, called with ``make(cache)``'s bad arguments,
    refuses them as the contract says (unless ``case`` may be accepted) and changes nothing."""
    cache = warm(factory, plan)
    bad = make(cache)
    where = plan.describe()
    # Straight to the cache, past the recorder: the recorder copies tensors and records
    # rows, and a bad call must record nothing.
    error = kvassert.raised_by(lambda: getattr(cache.cache, method)(*bad))
    refused = kvassert.assert_refused(error, case, where=where)
    # Whatever the error, a refusal must change nothing: that comes before its wording.
    kvassert.assert_unchanged(cache, plan.spec, who="the cache", where=where)
    if refused:
        kvassert.assert_clear_error(error, case, bad, where=where)


def check_overflow(factory: CacheFactory, plan: kvst.CachePlan) -> None:
    """Past max_length a cache may refuse or grow, but never drop, wrap or overwrite."""
    cache = warm(factory, plan)
    rows = plan.spec.max_length - cache.given_length + plan.new_tokens
    new = kvst.random_rows(plan.spec, rows, seed=rows)
    where = f"{rows} tokens appended to {plan.describe()}, {plan.new_tokens} past max_length"
    bad = (new, new * 2)
    error = kvassert.raised_by(lambda: cache.append(*bad))
    case = kvbad.overflow(plan.spec.max_length, rows)
    if kvassert.assert_refused(error, case, where=where):
        kvassert.assert_unchanged(cache, plan.spec, who="the cache", where=where)
        kvassert.assert_clear_error(error, case, bad, where=where)
    else:  # it grew: it must hold everything, exactly
        kvassert.assert_length(cache, cache.given_length, who="the cache", where=where)
        kvassert.assert_returned_rows(cache, who="the cache", where=where)


def check_bad_model_call(factory: CacheFactory, plan: kvst.ModelPlan, case: kvbad.BadInput):
    """``case`` is refused before any cache changes."""
    state = kvbad.build_model_state(factory, plan)
    tokens, caches = bad = case.make(state)
    where = state.describe()
    error = kvassert.raised_by(lambda: state.model(tokens, caches=caches))
    kvassert.assert_refused(error, case, where=where)
    for layer, cache in enumerate([*state.caches, state.spare]):
        who = "the spare cache" if cache is state.spare else f"layer {layer}"
        kvassert.assert_unchanged(cache, state.spec, who=who, where=where)
    kvassert.assert_clear_error(error, case, bad, where=where)


def check_nbytes(factory: CacheFactory, plan: kvst.CachePlan) -> None:
    """nbytes is an int, never below 2 x B x H_kv x L x D x itemsize, at every step of the
    plan and after a reset."""
    spec, cache = plan.spec, build(factory, plan.spec)
    for step, rows in enumerate([*plan.chunks, "reset"]):
        if rows == "reset":
            cache.reset()
        else:
            new = kvst.random_rows(spec, rows, seed=step)
            cache.append(new, new)
        nbytes, needed = cache.nbytes, min_nbytes(spec, cache.length)
        where = f"step {step} of {plan.describe()}"
        if isinstance(nbytes, bool) or not isinstance(nbytes, int):
            raise failures.WrongResults(
                f"the cache: nbytes must be an int, got {type(nbytes).__name__}\n  at {where}"
            )
        if nbytes < needed:
            raise failures.WrongResults(
                f"the cache: nbytes is {nbytes} while holding {cache.length} tokens, which take "
                f"at least {needed} bytes (2 x {spec.batch} x {spec.kv_heads} x {cache.length} "
                f"x {spec.head_dim} x itemsize)\n  at {where}"
            )


def check_edits(factory: CacheFactory, plan: kvst.EditPlan) -> None:
    """After every rollback, rewind or reorder, the caches behave exactly as if they had been
    given only the history that remains: logits, lengths and rows, step after step."""
    model = kvst.build_model(plan.config, plan.dtype)
    built = model.new_caches(factory, batch=plan.batch, max_length=plan.max_length)
    caches = record(built, plan.config)
    generator = torch.Generator().manual_seed(plan.token_seed)
    vocab = plan.config.vocab_size
    history = torch.empty(plan.batch, 0, dtype=torch.long, device=model.device)

    def feed(size: int, where: str) -> torch.Tensor:
        new = torch.randint(0, vocab, (plan.batch, size), generator=generator).to(model.device)
        start = history.shape[1]
        expected = model(torch.cat((history, new), dim=1))[:, start:]
        where = f"{size} tokens at absolute positions {start}..{start + size - 1} in {where}"
        kvassert.assert_close_at(
            model(new, caches=caches),
            expected,
            what="cached and uncached logits",
            where=where,
            position_axis=1,
            first_position=start,
        )
        for layer, cache in enumerate(caches):
            kvassert.assert_returned_rows(cache, who=f"layer {layer}", where=where)
        return new

    history = feed(plan.prompt, f"the prompt of {plan.describe()}")
    for index, step in enumerate(plan.steps):
        where = f"step #{index} ({kvst.describe_step(step)}) of {plan.describe()}"
        if isinstance(step, int):
            history = torch.cat((history, feed(step, where)), dim=1)
        elif isinstance(step, kvst.Rollback):
            drafted = torch.cat((history, feed(step.drafted, where)), dim=1)
            history = forget(model, caches, drafted, drafted.shape[1] - step.drafted + step.kept)
        elif isinstance(step, kvst.Rewind | kvst.RewindTo):
            history = forget(model, caches, history, step.target(history.shape[1]))
        else:
            if step.indices == tuple(range(plan.batch)):  # it would prove nothing
                raise InvalidArgument(f"{where}: a reorder plan must not be the identity")
            indices = torch.tensor(step.indices, device=model.device)
            model.reorder(caches, indices)
            history = history[indices]
        for layer, cache in enumerate(caches):
            kvassert.assert_length(cache, history.shape[1], who=f"layer {layer}", where=where)


def forget(model, caches, history: torch.Tensor, target: int) -> torch.Tensor:
    """Truncate every layer to ``target`` and return the history left: ``history[:target]``,
    or all of it when a window layer refused as it may (it dropped a position the next
    query needs). Any other refusal is a crash on valid input."""
    error = kvassert.raised_by(lambda: model.truncate(caches, target))
    if error is None:
        return history[:, :target]
    if isinstance(error, ValueError) and may_refuse(model.config, history.shape[1], target):
        return history
    raise failures.RefusesValidInput(
        f"truncate from {history.shape[1]} tokens to {target} refused with "
        f"{type(error).__name__}: {error}; no layer may refuse it: every position the next "
        f"query needs is among those a window cache must keep\n  model: "
        f"{kvst.describe_config(model.config)}"
    ) from error


def check_bad_truncate(factory: CacheFactory, plan: kvst.CachePlan, case: kvbad.BadInput):
    """``truncate`` with ``case``'s argument is refused and changes nothing."""
    check_refused(factory, plan, case, "truncate", lambda cache: case.make(cache.given_length))


def check_bad_reorder(factory: CacheFactory, plan: kvst.CachePlan, case: kvbad.BadInput):
    """``reorder`` with ``case``'s indices is refused and changes nothing."""
    check_refused(factory, plan, case, "reorder", lambda cache: case.make(plan.spec))


def check_requests(factory: CacheFactory, plan: kvreq.RequestPlan) -> None:
    """Requests served side by side from one factory (a tight pool of its kind when it is a
    BlockPool) each get the uncached model's logits for their own history."""
    kvreq.serve(kvreq.tight_pool(factory, plan), plan)


def check_fork(factory: CacheFactory, plan: kvreq.RequestPlan) -> None:
    """Forks and their parents diverge as independent histories, each matching the model."""
    kvreq.serve(factory, plan)


def check_pool(factory: CacheFactory, plan: kvreq.RequestPlan) -> None:
    """A tight pool's books hold after every event of the requests, and every block is back
    when they have all finished."""
    kvreq.serve(kvreq.tight_pool(factory, plan), plan, audit=True)


def check_stateful(factory: CacheFactory, _drawn: None = None) -> None:
    """Any interleaving of prefill, decode, reset, fresh caches and bad calls on sets of
    caches from one factory keeps lengths and logits right (a Hypothesis state machine)."""
    run_machine(factory)


@dataclass(frozen=True)
class Property:
    """One property of the contract, as the suite checks it."""

    name: str  # the verdict's row and the hunt's name: short, lower case
    title: str  # what holds, in one line
    check: Callable[..., None]  # check(factory, drawn) or check(factory, drawn, case)
    strategy: st.SearchStrategy | None  # None: the check draws for itself (a state machine)
    severity: str  # what a plain AssertionError escaping the check means
    cases: tuple = ()  # a table: one test per case
    # The optional capabilities it tests: a cache's ("truncate", ...) or the factory's
    # ("block pool").
    requires: tuple[str, ...] = ()
    # The share of the profile's examples each test searches: below 1 for a table of many
    # cases that mostly share one path (the model's own guards).
    budget: float = 1.0
    pinned: tuple = ()  # inputs tried first on every run (@example): past regressions
    # Inputs run as plain tests by name, not as @example, so that a search still shrinks.
    edges: dict[str, Any] = field(default_factory=dict)

    def not_offered(self, factory: CacheFactory) -> str | None:
        """Why ``factory`` cannot be tested for this property (the capabilities it lacks),
        or None when it offers them all."""
        missing = [
            name
            for name in self.requires
            if name in FACTORY_CAPABILITIES and not isinstance(factory, FACTORY_CAPABILITIES[name])
        ]
        cache_level = set(self.requires) - set(FACTORY_CAPABILITIES)
        if cache_level and (lacks := cache_level - capabilities(factory(probe_spec()))):
            methods = " or ".join(f"{name}()" for name in sorted(lacks))
            missing.insert(0, f"the cache has no {methods} method")
        if "block pool" in missing:
            missing[missing.index("block pool")] = (
                "the factory is not a kvref.BlockPool (block_size, blocks_in_use, "
                "blocks_free, with_blocks)"
            )
        return "; ".join(missing) or None

    def check_all_cases(self, factory: CacheFactory, drawn: Any) -> None:
        """The check on ``drawn`` for every case of the table (or once, without a table)."""
        if not self.cases:
            self.check(factory, drawn)
        for case in self.cases:
            self.check(factory, drawn, case)


# Capabilities of the factory itself, not of its caches.
FACTORY_CAPABILITIES = {"block pool": BlockPool}

SCENARIOS = kvst.scenarios()
LOGITS = Property(
    "logits",
    "cached logits equal uncached logits at every new position of every step",
    check_logits_match_uncached,
    SCENARIOS,
    failures.WRONG_RESULTS,
    pinned=kvst.PINNED,
    edges=kvst.EDGES,
)
MEMORY = Property(
    "memory",
    "nbytes is never below 2 x B x H_kv x L x D x itemsize",
    check_nbytes,
    kvst.cache_plans(room=0, min_chunks=1),
    failures.WRONG_RESULTS,
)
OVERFLOW = Property(
    "overflow",
    "past max_length an append is refused (changing nothing) or held exactly",
    check_overflow,
    kvst.cache_plans(room=1),  # after a refusal, room for one row to read the cache back
    failures.DATA_LOSS,
)
BAD_APPEND = Property(
    "bad append",
    "a bad append is refused with a ValueError naming the problem, changing nothing",
    check_bad_append,
    kvst.cache_plans(room=3),
    failures.ACCEPTS_BAD_INPUT,
    cases=tuple(kvbad.BAD_APPENDS),
    # Each of the many cases has its own search; what varies within one is only the warm
    # cache it is tried on, and the thorough profile still gives it hundreds.
    budget=0.4,
)
BAD_MODEL_CALL = Property(
    "bad model call",
    "a bad model call is refused before any cache changes",
    check_bad_model_call,
    kvst.model_plans(),
    failures.ACCEPTS_BAD_INPUT,
    cases=tuple(kvbad.BAD_CALLS),
    budget=0.25,
)
ISOLATION = Property(
    "isolation",
    "two caches from one factory never return each other's rows",
    check_isolation,
    kvst.isolation_plans(),
    failures.DATA_LOSS,
)
STALE_ROWS = Property(
    "stale rows",
    "rows from before a reset (even nan, inf, huge) never come back",
    check_stale_rows,
    kvst.stale_rows_plans(),
    failures.DATA_LOSS,
)
LENGTHS = Property(
    "lengths",
    "lengths grow by each chunk; append returns exactly the rows given, bit for bit",
    check_lengths,
    SCENARIOS,
    failures.DATA_LOSS,
    pinned=kvst.PINNED,
    edges=kvst.EDGES,
)
CONTENTS = Property(
    "contents",
    "each layer holds the uncached pass's rotated keys and its values",
    check_contents,
    SCENARIOS,
    failures.DATA_LOSS,
    pinned=kvst.PINNED,
    edges=kvst.EDGES,
)
RESET = Property(
    "reset",
    "after reset() or on fresh caches, a session after a poisoned one matches the model",
    check_logits_match_uncached,
    kvst.scenarios(min_sessions=2, poison=True),
    failures.WRONG_RESULTS,
    pinned=kvst.PINNED[:1],
)
TRUNCATE = Property(
    "truncate",
    "after a rollback (speculative decoding) or a rewind, caches act on the history left",
    check_edits,
    kvst.edit_plans(),
    failures.WRONG_RESULTS,
    requires=("truncate",),
    pinned=kvst.PINNED_EDITS,
)
BAD_TRUNCATE = Property(
    "bad truncate",
    "truncate to a negative, too large or non-int length is refused, changing nothing",
    check_bad_truncate,
    kvst.cache_plans(room=1),
    failures.ACCEPTS_BAD_INPUT,
    cases=tuple(kvbad.BAD_TRUNCATES),
    requires=("truncate",),
)
REORDER = Property(
    "reorder",
    "after a reorder (beam search, repeats allowed), caches act on the permuted histories",
    check_edits,
    kvst.edit_plans(rollbacks=False, reorder=True),
    failures.WRONG_RESULTS,
    requires=("reorder",),
)
BAD_REORDER = Property(
    "bad reorder",
    "reorder with indices of a wrong dtype, shape, range or device is refused, changing nothing",
    check_bad_reorder,
    kvst.cache_plans(room=1),
    failures.ACCEPTS_BAD_INPUT,
    cases=tuple(kvbad.BAD_REORDERS),
    requires=("reorder",),
)
EDITS = Property(
    "truncate and reorder",
    "rollbacks, rewinds and reorders mixed: a reorder after a truncate, a truncate after one",
    check_edits,
    kvst.edit_plans(rollbacks=True, reorder=True),
    failures.WRONG_RESULTS,
    requires=("truncate", "reorder"),
    pinned=kvst.PINNED_MIXED_EDITS,
    budget=0.5,  # truncate and reorder each have their own full search
)
ATTEND = Property(
    "attend",
    "attend returns the reference attention over the rows given: masks, grouped heads, "
    "chunks, large scores",
    check_attend,
    attend_plans(),
    failures.WRONG_RESULTS,
    requires=("attend",),
)
FORK = Property(
    "fork",
    "after fork(), parent and child are independent histories, each matching the model",
    check_fork,
    kvreq.request_plans(forks=3, truncates=True, poison=False),
    failures.WRONG_RESULTS,
    requires=("fork",),
    pinned=kvreq.PINNED_FORKS,
)
REQUESTS = Property(
    "requests",
    "requests interleaved on one factory (started, forked, finished, started again) each "
    "match the model on their own history",
    check_requests,
    kvreq.request_plans(),
    failures.WRONG_RESULTS,
    pinned=kvreq.PINNED,
    # It runs on every cache under test (a quarter of the profile's examples, after the
    # pinned plans); on a pool, "pool" searches the same plans in full.
    budget=0.25,
)
POOL = Property(
    "pool",
    "a pool's books: blocks in use are the live caches' distinct blocks, tables fit the "
    "rows, nbytes covers them, all back at the end",
    check_pool,
    kvreq.request_plans(),
    failures.DATA_LOSS,
    requires=("block pool",),
    pinned=kvreq.PINNED,
)
EXHAUSTED_POOL = Property(
    "exhausted pool",
    "an exhausted pool refuses append, attend and a fork's write with ValueError, changing nothing",
    check_exhausted_pool,
    exhaustion_plans(),
    failures.REFUSAL_CHANGED_STATE,
    requires=("block pool",),
)
STATEFUL = Property(
    "stateful",
    "any interleaving of prefill, decode, reset, fresh caches and bad calls stays right",
    check_stateful,
    None,
    failures.WRONG_RESULTS,
)

# Search order of the mutant hunt: logits first (it catches anything that changes what the
# model computes), then the cache-level properties (no model, cheap), then the rest.
ALL = (
    LOGITS,
    MEMORY,
    OVERFLOW,
    BAD_APPEND,
    BAD_MODEL_CALL,
    ISOLATION,
    STALE_ROWS,
    LENGTHS,
    CONTENTS,
    RESET,
    STATEFUL,
    REQUESTS,
    ATTEND,
    EXHAUSTED_POOL,
    FORK,
    POOL,
    TRUNCATE,
    BAD_TRUNCATE,
    REORDER,
    BAD_REORDER,
    EDITS,
)
BY_NAME = {prop.name: prop for prop in ALL}
