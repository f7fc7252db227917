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

import torch
from hypothesis import strategies as st

from kvcheck import asserts as kvassert
from kvcheck import badinput as kvbad
from kvcheck import failures, reach
from kvcheck import strategies as kvst
from kvcheck.harness import SPEC_EDGES, note_spec, warm
from kvcheck.kit import KitTests, Property, property_test
from kvcheck.reach import Edge
from kvref import CacheFactory

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
    good = kvst.random_rows(plan.spec, plan.new_tokens, seed=7)
    value = functools.partial(kvst.as_values, plan.spec, good)
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
    spec = plan.spec
    key = kvst.random_rows(spec, plan.new_tokens, seed=7)
    value = kvst.as_values(spec, key)
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
    new = kvst.random_rows(plan.spec, rows, seed=rows)
    where = f"{rows} tokens appended to {plan.describe()}, {plan.new_tokens} past max_length"
    bad = (new, kvst.as_values(plan.spec, new, 2))
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
)
OVERFLOW = Property(
    "overflow",
    "past max_length an append is refused (changing nothing) or held exactly",
    check_overflow,
    kvst.cache_plans(room=1),  # after a refusal, room for one row to read the cache back
    failures.DATA_LOSS,
    reaches=STATE_EDGES,
)
BAD_MODEL_CALL = Property(
    "bad model call",
    "a bad model call is refused before any cache changes",
    check_bad_model_call,
    kvst.model_plans(),
    failures.ACCEPTS_BAD_INPUT,
    cases=tuple(kvbad.BAD_CALLS),
    examples_share=0.25,
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
    reaches=STATE_EDGES[:4],  # a latent layer's cache has one kv head
    examples_share=0.25,
    since="1.6",
)


class RejectionTests(KitTests):
    """Bad input is refused as the contract says, and changes nothing."""

    test_bad_append_is_refused_and_changes_nothing = property_test(BAD_APPEND)
    test_bad_latent_attend_is_refused_and_changes_nothing = property_test(BAD_LATENT_ATTEND)
    test_append_past_max_length_is_refused_or_held_exactly = property_test(OVERFLOW)
    test_bad_model_call_is_refused_before_any_cache_changes = property_test(BAD_MODEL_CALL)
