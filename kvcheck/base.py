"""The test classes a user subclasses: one class per area, each test bound to one property.

``CacheTests`` inherits them all; subclass it and set ``factory`` to run every property on
your cache (new properties reach you with the next release, with no change on your side)::

    from kvcheck import CacheTests
    from mypkg.caches import MyCache

    class TestMyCache(CacheTests):
        factory = MyCache

With ``factory`` left as None, the caches come from ``--kv-impl`` / ``KV_IMPL`` (every
built-in when neither is given), one test per cache, named in the test id.
"""

from __future__ import annotations

import math
from typing import ClassVar

import pytest
from hypothesis import example, given, settings

from kvcheck import profiles as kvprofiles
from kvcheck import properties as kvprop
from kvcheck import sizes as kvsizes
from kvcheck.properties import Property


def property_test(prop: Property):
    """A test method that searches ``prop`` with Hypothesis on the cache under test.

    The search is built when the test runs, with the kit's settings for this run
    (``kvcheck.profiles``): a Hypothesis profile loaded for the host process does not change
    it, and the kit changes none."""
    if prop.strategy is None:

        def test(self, cache_factory):
            skip_unless_offered(prop, cache_factory)
            sizes = kvsizes.declared_by(cache_factory, type(self))
            with kvprofiles.torch_threads(), kvsizes.aiming_at(sizes):
                prop.check(cache_factory)

    elif prop.cases:

        @pytest.mark.parametrize("case", prop.cases, ids=str)
        def test(self, cache_factory, case):
            skip_unless_offered(prop, cache_factory)
            sizes = kvsizes.declared_by(cache_factory, type(self))
            search(
                prop,
                lambda drawn: prop.check(cache_factory, drawn, case),
                self.pinned,
                sizes,
                self.examples_scale,
            )

    else:

        def test(self, cache_factory):
            skip_unless_offered(prop, cache_factory)
            sizes = kvsizes.declared_by(cache_factory, type(self))
            search(
                prop,
                lambda drawn: prop.check(cache_factory, drawn),
                self.pinned,
                sizes,
                self.examples_scale,
            )

    test.__doc__ = prop.title
    return pytest.mark.kv_property(prop.name)(test)


NOT_OFFERED = "not offered"


def skip_unless_offered(prop: Property, factory) -> None:
    """Skip, as "not offered", a property of a capability the cache does not have (a cache
    offers one by having the method), or the factory (a BlockPool)."""
    if prop.requires and (reason := prop.not_offered(factory)):
        pytest.skip(f"{NOT_OFFERED}: {reason}")


def search(
    prop: Property,
    check,
    pinned: dict[str, tuple] | None = None,
    sizes: kvsizes.Sizes = kvsizes.NONE,
    examples_scale: float = 1.0,
) -> None:
    """Search ``prop.strategy`` for an input that fails ``check``, pinned inputs first: the
    kit's, then the test class's own (``pinned[prop.name]``); the draws aim at ``sizes``;
    ``examples_scale`` times the profile's examples (and the property's budget)."""

    def falsify(drawn):
        check(drawn)

    falsify.__name__ = falsify.__qualname__ = prop.name.replace(" ", "_")
    test = falsify
    for drawn in (*prop.pinned, *(pinned or {}).get(prop.name, ())):
        test = example(drawn=drawn)(test)
    kit = kvprofiles.current()
    examples = max(1, math.ceil(kit.max_examples * prop.budget * examples_scale))
    with kvprofiles.torch_threads(), kvsizes.aiming_at(sizes):
        given(drawn=prop.strategy)(settings(kit, max_examples=examples)(test))()


def edge_test(prop: Property):
    """A plain test of ``prop`` on each of its hand-picked edge inputs."""

    @pytest.mark.parametrize("edge", prop.edges.values(), ids=list(prop.edges))
    def test(self, cache_factory, edge):
        with kvprofiles.torch_threads():
            prop.check(cache_factory, edge)

    test.__doc__ = f"{prop.title} (hand-picked edges)"
    return pytest.mark.kv_property(prop.name)(test)


class KitTests:
    """What every class of the kit shares: the cache under test."""

    factory = None  # a CacheFactory (a class taking a CacheSpec qualifies); None: --kv-impl
    cache_name: str | None = None  # the name in test ids; default: the factory's __name__
    # Your own regressions, tried first on every run: property name -> inputs, e.g. the
    # `drawn=` of a falsifying example pasted from a failure.
    pinned: ClassVar[dict[str, tuple]] = {}
    # The sizes your cache is built around (kvcheck.Sizes: page, head_dims, kv_heads,
    # max_batch), for the draws to hit on purpose; the factory's own `kv_sizes` otherwise.
    sizes: ClassVar[kvsizes.Sizes | None] = None
    # Examples per property, as a multiple of the profile's (--kv-profile): more for a
    # nightly job on one cache, fewer for caches that only guard against false alarms.
    examples_scale: ClassVar[float] = 1.0


class CoreTests(KitTests):
    """Cached decoding computes what the uncached model computes, step by step."""

    test_logits_match_uncached = property_test(kvprop.LOGITS)
    test_logits_at_edges = edge_test(kvprop.LOGITS)
    test_length_invariants = property_test(kvprop.LENGTHS)
    test_lengths_at_edges = edge_test(kvprop.LENGTHS)
    test_contents_equal_uncached_keys_and_values = property_test(kvprop.CONTENTS)
    test_contents_at_edges = edge_test(kvprop.CONTENTS)


class ResetTests(KitTests):
    """Nothing from before a reset, or from a cache's earlier life, comes back."""

    test_poisoned_session_leaves_no_trace = property_test(kvprop.RESET)
    test_rows_from_before_a_reset_never_come_back = property_test(kvprop.STALE_ROWS)


class IsolationTests(KitTests):
    """Caches from one factory share no rows."""

    test_caches_from_one_factory_share_no_storage = property_test(kvprop.ISOLATION)


class RejectionTests(KitTests):
    """Bad input is refused as the contract says, and changes nothing."""

    test_bad_append_is_refused_and_changes_nothing = property_test(kvprop.BAD_APPEND)
    test_append_past_max_length_is_refused_or_held_exactly = property_test(kvprop.OVERFLOW)
    test_bad_model_call_is_refused_before_any_cache_changes = property_test(kvprop.BAD_MODEL_CALL)


class MemoryTests(KitTests):
    """``nbytes`` never claims less than the keys and values held."""

    test_nbytes_never_less_than_what_is_held = property_test(kvprop.MEMORY)


class StatefulTests(KitTests):
    """Any interleaving of the calls an engine makes keeps every set of caches right."""

    test_any_sequence_of_prefill_decode_reset_and_bad_calls = property_test(kvprop.STATEFUL)


class RequestsTests(KitTests):
    """Requests interleaved on one factory, as a serving engine's scheduler runs them."""

    test_interleaved_requests_each_match_the_model = property_test(kvprop.REQUESTS)


class AttendTests(KitTests):
    """``attend(query, key, value)``, for caches that compute attention: run when offered."""

    test_attend_equals_the_reference_attention = property_test(kvprop.ATTEND)


class ForkTests(KitTests):
    """``fork()``, for parallel sampling and shared prompts: run when offered."""

    test_forks_are_independent_histories = property_test(kvprop.FORK)


class PoolTests(KitTests):
    """A factory that is a ``kvref.BlockPool`` (a paged pool): run when it is one."""

    test_pool_books_match_the_live_caches = property_test(kvprop.POOL)
    test_exhausted_pool_refuses_and_changes_nothing = property_test(kvprop.EXHAUSTED_POOL)


class TruncateTests(KitTests):
    """``truncate(length)``, for speculative decoding and regenerate: run when offered."""

    test_rollbacks_and_rewinds_act_on_the_history_left = property_test(kvprop.TRUNCATE)
    test_bad_truncate_is_refused_and_changes_nothing = property_test(kvprop.BAD_TRUNCATE)


class ReorderTests(KitTests):
    """``reorder(indices)``, for beam search: run when offered."""

    test_reorders_act_on_the_permuted_histories = property_test(kvprop.REORDER)
    test_bad_reorder_is_refused_and_changes_nothing = property_test(kvprop.BAD_REORDER)
    test_truncates_and_reorders_mixed_act_on_the_history_left = property_test(kvprop.EDITS)


class CacheTests(
    CoreTests,
    ResetTests,
    IsolationTests,
    RejectionTests,
    MemoryTests,
    StatefulTests,
    RequestsTests,
    AttendTests,
    ForkTests,
    PoolTests,
    TruncateTests,
    ReorderTests,
):
    """Every property of the kit. Subclass it, set ``factory``, and pytest runs them all;
    those of a capability the cache does not offer are skipped as "not offered"."""
