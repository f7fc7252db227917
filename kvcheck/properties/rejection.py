"""Rejection: bad input is refused as the contract says, and changes nothing.

The tables of bad input are in ``kvcheck.badinput``; each case is tried on a cache warmed
by a drawn plan (``CachePlan``: from empty to nearly full). A refusal must come with a
``ValueError`` (or ``TypeError`` for a non-tensor) that names the problem, and leave the
cache as it was: same length, and a read-back append returns the rows held before.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterator

import torch
from hypothesis import strategies as st

from kvcheck import asserts as kvassert
from kvcheck import badinput as kvbad
from kvcheck import devices as kvdevices
from kvcheck import failures, reach
from kvcheck import scope as kvscope
from kvcheck import sizes as kvsizes
from kvcheck import strategies as kvst
from kvcheck import tensors as kvtensors
from kvcheck.harness import SPEC_EDGES, note_spec, warm
from kvcheck.kit import KitTests, Property, property_test
from kvcheck.reach import Edge
from kvref import CacheFactory, CacheSpec

# The states bad input is tried on (contract, section 3), noted as each is warmed.
STATE_EDGES = tuple(
    Edge(name) for name in ("an empty cache", "a cache warmed by 2 or more appends", *SPEC_EDGES)
)


def note_state(plan: kvst.CachePlan) -> None:
    """Note which of ``STATE_EDGES`` the warmed cache of ``plan`` is in."""
    if not plan.chunks:
        reach.note("an empty cache")
    if len(plan.chunks) >= 2:
        reach.note("a cache warmed by 2 or more appends")
    note_spec(plan.spec)


def check_refused(factory: CacheFactory, plan: kvst.CachePlan, case, method: str, make) -> None:
    """``method`` of a cache warmed by ``plan``, called with ``make(cache)``'s bad arguments,
    refuses them as the contract says (unless ``case`` may be accepted) and changes nothing."""
    cache = warm(factory, plan)
    note_state(plan)
    bad = make(cache)
    where = plan.describe()
    # Straight to the cache, past the recorder: the recorder copies tensors and records
    # rows, and a bad call must record nothing.
    error = kvassert.raised_by(lambda: getattr(cache.cache, method)(*bad))
    refused = kvassert.assert_refused(
        error, case, where=where, sent=bad, method=method, cache=cache, spec=plan.spec
    )
    # Whatever the error, a refusal must change nothing: that comes before its wording.
    try:
        kvassert.assert_unchanged(
            cache, plan.spec, who="the cache", where=where, case=case, refused=refused
        )
    except failures.RefusalChangedState as error:
        not_the_refusals_doing(factory, plan, error)
        raise
    if refused:
        kvassert.assert_clear_error(error, case, bad, where=where)


def not_the_refusals_doing(factory: CacheFactory, plan: kvst.CachePlan, error) -> None:
    """Raise, from ``error``, the failure of a twin cache that took the same warm-up and the
    same read-back with no bad call between them, where it fails too: the cache goes wrong
    there whatever it is sent (say, it drops a row at that length), and that is the root the
    verdict must name, not a refusal that changed state."""
    twin = warm(factory, plan)
    try:
        kvassert.assert_unchanged(twin, plan.spec, who="the cache", where=plan.describe())
    except failures.RefusalChangedState as own:
        root = failures.DataLoss(
            f"{str(own).replace('after a refused call', 'with no bad call at all')}\n  (a twin "
            f"cache given the same rows and no bad input fails the same read-back: the cache "
            f"goes wrong there whatever it is sent, not because of the refusal)"
        )
        root.kv_root = getattr(own, "kv_root", None)
        raise root from error


def check_bad_append(factory: CacheFactory, plan: kvst.CachePlan, case: kvbad.BadInput) -> None:
    """``case`` applied to a warm cache is refused as the contract says and changes nothing."""
    good = kvtensors.random_rows(plan.spec, plan.new_tokens, seed=7)
    value = functools.partial(kvtensors.as_values, plan.spec, good)
    check_refused(factory, plan, case, "append", lambda cache: case.make(good, value()))


@st.composite
def latent_cache_plans(draw, room: int = 3) -> kvst.CachePlan:
    """A warm latent layer's cache (contract, section 10.2): one "head", rope keys and
    latents of their own widths, the declared ones where there are some."""
    plan = draw(kvst.cache_plans(room=room), label="plan")
    value_dim, head_dim = draw(kvst.latent_widths(plan.spec.max_length, plan.spec.head_dim))
    spec = dataclasses.replace(plan.spec, kv_heads=1, head_dim=head_dim, value_dim=value_dim)
    return dataclasses.replace(plan, spec=spec)


def check_bad_latent_attend(
    factory: CacheFactory, plan: kvst.CachePlan, case: kvbad.BadInput
) -> None:
    """``case`` applied to a warm latent cache's attend_latent is refused as the contract
    says and changes nothing."""
    plan = kvdevices.placed(plan)
    spec = plan.spec
    key = kvtensors.random_rows(spec, plan.new_tokens, seed=7)
    value = kvtensors.as_values(spec, key)
    shape = (spec.batch, 2, plan.new_tokens, spec.value_width + spec.head_dim)
    query = torch.randn(shape, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    query = query.to(device=spec.device, dtype=spec.dtype)
    scale = 1 / math.sqrt(spec.head_dim + 2)
    check_refused(
        factory, plan, case, "attend_latent", lambda cache: case.make(query, key, value, scale)
    )


def check_overflow(factory: CacheFactory, plan: kvst.CachePlan) -> None:
    """Past max_length a cache may refuse or grow, but never drop, wrap or overwrite."""
    cache = warm(factory, plan)
    note_state(plan)
    rows = plan.spec.max_length - cache.given_length + plan.new_tokens
    new = kvtensors.random_rows(plan.spec, rows, seed=rows)
    where = f"{rows} tokens appended to {plan.describe()}, {plan.new_tokens} past max_length"
    bad = (new, kvtensors.as_values(plan.spec, new, 2))
    error = kvassert.raised_by(lambda: cache.append(*bad))
    case = kvbad.overflow(plan.spec.max_length, rows)
    if kvassert.assert_refused(error, case, where=where):
        kvassert.assert_unchanged(cache, plan.spec, who="the cache", where=where, case=case)
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
    kvassert.assert_refused(error, case, where=where, sent=bad, method="model")
    for layer, cache in enumerate([*state.caches, state.spare]):
        who = "the spare cache" if cache is state.spare else f"layer {layer}"
        kvassert.assert_unchanged(cache, state.spec, who=who, where=where, case=case)
    kvassert.assert_clear_error(error, case, bad, where=where)


# --- Bounded-exhaustive enumerations (kvcheck.scope) -----------------------------------
# A cache-level plan has no model: its spec is that of one layer of a layout of the scope.


def layer_specs(scope: kvscope.Scope, *, latent: bool = False) -> tuple[dict, ...]:
    """The distinct cache specs (less max_length) the layers of the scope's layouts are built
    for, in layout order: each layout's batch, kv heads and head width, windowed on its even
    layers where it has a window (so a window layout gives a window spec and a global one);
    the scope's dtype, on the kit's device. Layouts that differ only in query heads (which a
    cache spec does not hold) give one spec. With ``latent``, a latent layer's (contract,
    section 10.2): one "head", the rope key the first declared rope width (else the
    layout's head width), the latent the first declared latent width, else the first of
    ``latent_widths``' widths that differs from the key's (6 for a key 2 wide: a latent as
    wide as the key would hide keys and latents swapped)."""
    domain = kvsizes.domain()
    specs: dict[tuple, dict] = {}
    for layout in scope.layouts:
        windows = (layout.window, None) if layout.window and layout.layers > 1 else (layout.window,)
        for window in windows:
            spec = {
                "batch": layout.batch,
                "kv_heads": layout.kv_heads,
                "head_dim": layout.head_dim,
                "dtype": scope.dtype,
                "device": kvdevices.current(),
                "window": window,
            }
            if latent:
                rope = domain.rope_dims[0] if domain.rope_dims else layout.head_dim
                widths = domain.latent_dims or [w for w in (2, 6, 16, 64, 512) if w != rope]
                spec.update(kv_heads=1, head_dim=rope, value_dim=widths[0])
            specs.setdefault(tuple(spec.items()), spec)
    return tuple(specs.values())


def warm_ups(rows: int, min_chunks: int = 0) -> Iterator[tuple[int, ...]]:
    """Every split of ``rows`` warm-up rows into appends, of at least ``min_chunks`` appends
    (no append at all for 0 rows): 2^(rows-1) of them for ``min_chunks`` 1, and 1 for 0 rows
    where ``min_chunks`` is 0."""
    if rows == 0:
        if min_chunks == 0:
            yield ()
        return
    yield from (chunks for chunks in kvscope.compositions(rows) if len(chunks) >= min_chunks)


def every_cache_plan(
    scope: kvscope.Scope,
    room: int = 1,
    *,
    min_chunks: int = 0,
    max_new: int = 0,
    overflow: bool = False,
    latent: bool = False,
) -> Iterator[kvst.CachePlan]:
    """Every ``CachePlan`` within ``scope``, fewest tokens first, then by spec
    (``layer_specs``, in the scope's layout order), then by the next append's size, the room
    and the warm-up: a cache warmed by every split of W rows into appends (at least
    ``min_chunks`` of them; W = 0 is the empty cache), built for max_length W + ``room``.

    The tokens of a plan are every row it feeds a cache: the W warm-up rows; with
    ``max_new``, the next append's ``new_tokens`` (every size 1 to ``max_new``); else the
    property does not read ``new_tokens`` and it is 1, uncounted. With ``overflow`` the
    room is every size from ``room`` up and counted too: the overflowing append fills the
    room and ``new_tokens`` more. Per spec, with c(0) = 1 where ``min_chunks`` is 0 (else
    0) and c(w) = 2^(w-1) for w >= 1 (``min_chunks`` <= 1), the plans of exactly t tokens
    number:

    - nothing new: c(t);
    - ``max_new`` M: sum over n = 1..M of c(t - n);
    - ``overflow``: sum over r >= ``room``, n = 1..M of c(t - r - n).

    The seeds are fixed: warm-up rows from ``random_rows`` seeds 0, 1, ... as ``warm`` makes
    them. Not enumerated: half precision (the scope's dtype), and max_length beyond W +
    ``room`` (a cache with more room is, to every case here, a cache warmed by more rows;
    ``overflow`` is the exception, and enumerates it)."""
    specs = layer_specs(scope, latent=latent)
    news = range(1, max_new + 1) if max_new else (0,)
    for total in range(scope.tokens + 1):
        for fields in specs:
            for new in news:
                for extra in range(room, total + 1) if overflow else (room,):
                    rows = total - new - (extra if overflow else 0)
                    if rows < 0 or rows + extra < 1:
                        continue
                    spec = CacheSpec(max_length=rows + extra, **fields)
                    for chunks in warm_ups(rows, min_chunks):
                        yield kvst.CachePlan(spec, chunks, new or 1)


def every_bad_append(scope: kvscope.Scope) -> Iterator[kvst.CachePlan]:
    """``every_cache_plan`` with room 3 and next appends of 1 to 3 rows (the strategy's):
    per spec, the plans of t tokens number 1, 2, 4 for t = 1, 2, 3, and 7 x 2^(t-4) from
    t = 4 (sum over n = 1..3 of c(t - n)); crossed with every case by the runner."""
    return every_cache_plan(scope, room=3, max_new=3)


def every_overflow(scope: kvscope.Scope) -> Iterator[kvst.CachePlan]:
    """``every_cache_plan`` with every room from 1 up (one row to read the cache back after
    a refusal) and 1 to 3 rows past max_length: an append of room + n rows after every
    warm-up, counted whole."""
    return every_cache_plan(scope, room=1, max_new=3, overflow=True)


def every_refusal(scope: kvscope.Scope) -> Iterator[kvst.CachePlan]:
    """``every_cache_plan`` with room 1 (to read the cache back) and no next append: an
    empty cache (0 tokens, first), then every warm-up of W rows, 2^(W-1) per spec; for
    ``truncate`` and ``reorder``'s tables, whose cases are made from the cache or its spec."""
    return every_cache_plan(scope, room=1)


def every_import(scope: kvscope.Scope) -> Iterator[kvst.CachePlan]:
    """``every_cache_plan`` with room 1, at least one warm-up append and no next append:
    2^(W-1) plans of W tokens per spec; the bad rows of ``import_rows``' table are made
    from the spec (an import into a cache that holds tokens: into the warm one)."""
    return every_cache_plan(scope, room=1, min_chunks=1)


def every_latent_plan(scope: kvscope.Scope) -> Iterator[kvst.CachePlan]:
    """``every_bad_append``'s plans on latent specs (``layer_specs(latent=True)``): the next
    append's 1 to 3 rows are the key and value of the bad ``attend_latent``."""
    return every_cache_plan(scope, room=3, max_new=3, latent=True)


def every_model_plan(scope: kvscope.Scope) -> Iterator[kvst.ModelPlan]:
    """Every ``ModelPlan`` within ``scope``, fewest tokens first, then by layout, then by
    the layer a case picks on, then by the split: caches fed t tokens in every split into
    a prefill and decode steps (2^(t-1)), on each layout's model with at least 2 layers (a
    1-layer layout raised to 2: the strategy's least, and the cases of two layers need
    them), every layer, the layout's batch, the scope's dtype, token seed 0. Per layout of
    L layers, L x 2^(t-1) plans of t tokens (the good next tokens are the case's, not
    counted)."""
    layouts = dict.fromkeys(
        dataclasses.replace(layout, layers=max(2, layout.layers)) for layout in scope.layouts
    )
    for total in range(1, scope.tokens + 1):
        for layout in layouts:
            for layer in range(layout.layers):
                for chunks in kvscope.compositions(total):
                    yield kvst.ModelPlan(
                        config=layout.config(),
                        dtype=scope.dtype,
                        batch=layout.batch,
                        chunks=chunks,
                        layer=layer,
                        token_seed=0,
                    )


BAD_APPEND = Property(
    "bad append",
    "a bad append is refused with a ValueError naming the problem, changing nothing",
    check_bad_append,
    kvst.cache_plans(room=3),
    failures.ACCEPTS_BAD_INPUT,
    cases=tuple(kvbad.BAD_APPENDS),
    reaches=STATE_EDGES,
    # Each of the many cases has its own search; what varies within one is only the warm
    # cache it is tried on, and the thorough profile still gives it hundreds.
    examples_share=0.4,
    every_plan=every_bad_append,
    exhaustive_tokens=12,
    since="1.0",
    holds=(
        "every kind of bad `append` in `kvcheck.badinput.BAD_APPENDS` (one test each) is refused "
        "(`ValueError`; `TypeError` too for non-tensors; T = 0 may be a no-op) with a message that "
        "names the problem, and changes nothing"
    ),
)
OVERFLOW = Property(
    "overflow",
    "past max_length an append is refused (changing nothing) or held exactly",
    check_overflow,
    kvst.cache_plans(room=1),  # after a refusal, room for one row to read the cache back
    failures.DATA_LOSS,
    reaches=STATE_EDGES,
    every_plan=every_overflow,
    exhaustive_tokens=12,
    since="1.0",
    holds=("past `max_length` an append is refused, changing nothing, or held exactly"),
)
BAD_MODEL_CALL = Property(
    "bad model call",
    "a bad model call is refused before any cache changes",
    check_bad_model_call,
    kvst.model_plans(),
    failures.ACCEPTS_BAD_INPUT,
    cases=tuple(kvbad.BAD_CALLS),
    examples_share=0.25,
    every_plan=every_model_plan,
    exhaustive_tokens=8,
    since="1.0",
    holds=(
        "every kind of bad model call in `kvcheck.badinput.BAD_CALLS` (wrong number of caches, one "
        "cache for two layers, unequal layers, another batch, bad token ids) is refused before any "
        "cache changes"
    ),
)
# Each state the bad latent attends name, pinned (a run under one --hypothesis-seed draws the
# same few warm caches for every case): a batch of 2 warmed by 2 appends; an empty window cache.
LATENT_STATES_PINNED = tuple(
    kvst.CachePlan(
        CacheSpec(batch, 1, 2, 8, torch.float64, torch.device("cpu"), window, value_dim=6),
        chunks,
    )
    for batch, window, chunks in ((2, None, (1, 2)), (1, 4, ()))
)


BAD_LATENT_ATTEND = Property(
    "bad latent attend",
    "a bad attend_latent (query, scale or rows) is refused with a ValueError naming the "
    "problem, changing nothing",
    check_bad_latent_attend,
    latent_cache_plans(),
    failures.ACCEPTS_BAD_INPUT,
    cases=tuple(kvbad.BAD_LATENT_ATTENDS),
    requires=("attend_latent", "latent"),
    pinned=LATENT_STATES_PINNED,
    reaches=STATE_EDGES[:4],  # a latent layer's cache has one kv head
    examples_share=0.25,
    since="1.6",
    every_plan=every_latent_plan,
    exhaustive_tokens=12,
    holds=(
        "every kind of bad `attend_latent` in `kvcheck.badinput.BAD_LATENT_ATTENDS` (a query of the"
        " wrong width, heads or dtype, a scale that is not a positive finite number, rows of "
        "another width) sent to a warm latent cache is refused with a `ValueError` naming the "
        "problem, and the cache reads back as it was (contract, section 10.2; where `attend_latent`"
        " is offered and `latent` declared)"
    ),
)


class RejectionTests(KitTests):
    """Bad input is refused as the contract says, and changes nothing."""

    test_bad_append_is_refused_and_changes_nothing = property_test(BAD_APPEND)
    test_bad_latent_attend_is_refused_and_changes_nothing = property_test(BAD_LATENT_ATTEND)
    test_append_past_max_length_is_refused_or_held_exactly = property_test(OVERFLOW)
    test_bad_model_call_is_refused_before_any_cache_changes = property_test(BAD_MODEL_CALL)
