"""What every property of the kit is made of, and how a test class runs one.

A ``Property`` is a check, the strategy that draws its input and what its failure means.
An area module (``kvcheck/properties/<area>.py``) declares its properties and binds each to
a test in its area's class (``property_test``); ``kvcheck.properties`` collects them into
the registry. ``KitTests`` is what every area class shares: the cache under test and the
class attributes a user sets.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pytest
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

from kvcheck import contract, exhaustive, reach
from kvcheck import devices as kvdevices
from kvcheck import profiles as kvprofiles
from kvcheck import sizes as kvsizes
from kvcheck import strategies as kvst
from kvcheck.asserts import LOSSY_CAPABILITIES, lossy_capabilities
from kvcheck.harness import PATHS, offers_attend
from kvcheck.scope import Scope
from kvcheck.session import young_objects_only
from kvref import BlockPool, CacheFactory, CacheSpec, LayerCache, PrefixCaching, capabilities

NOT_OFFERED = "not offered"
OUTSIDE = "outside the declared domain"
# Capabilities of the factory itself, not of its caches.
FACTORY_CAPABILITIES = {"block pool": BlockPool, "prefix caching": PrefixCaching}
# The methods a capability takes, where it is not the one named after it.
METHODS = {
    "tree": "append_tree() and commit_tree()",
    "offload": "offload() and restore()",
    "move": "export_rows() and import_rows()",
}
# Capabilities a cache declares in its sizes or by an attribute, not by a method, and why one
# is missing.
DECLARED_CAPABILITIES = {
    "sinks": "the cache declares no attention sinks (its supports' sinks, contract 8.5)",
    "latent": "the cache declares no latent (MLA) layers (its supports' latent, contract 10.2)",
    "shift per row": (
        "the cache declares no shift per row (shift_per_row = True beside append_rows and "
        "shift, contract 8.4)"
    ),
    **LOSSY_CAPABILITIES,
}


def probe_spec() -> CacheSpec:
    """The spec a factory is asked for once, to see which optional capabilities its caches
    offer: the smallest inside its declared domain, on the kit's device, in the first dtype
    there."""
    domain = kvsizes.domain()
    dtype = kvst.supported_dtypes(kvst.DTYPES)[0]  # one at least, or nothing is offered
    head_dim = domain.head_dims[0] if domain.head_dims else 2
    kv_heads = domain.kv_heads[0] if domain.kv_heads else 1
    device = kvdevices.current()
    return CacheSpec(1, kv_heads, head_dim, max_length=8, dtype=dtype, device=device)


def paths_offered(factory: CacheFactory) -> tuple[str, ...]:
    """The paths the model may take through ``factory``'s caches: append, and attend where
    they have it. A factory that cannot build the probe (or is declared for another device)
    gets append only: its own test then shows why."""
    if outside_domain(factory):
        return PATHS[:1]
    try:
        return PATHS if offers_attend(factory(probe_spec())) else PATHS[:1]
    except Exception:  # the test reports it, with the property's context
        return PATHS[:1]


def offered(factory: CacheFactory, cache: LayerCache | None = None) -> set[str]:
    """The optional capabilities of ``factory``'s caches (of ``cache``, one of them, where
    given; else of the probe's), and the factory's own."""
    probe = factory(probe_spec()) if cache is None else cache
    names = set(capabilities(probe)) | lossy_capabilities(probe)  # storage declared: 10.1
    names.update(name for name, kind in FACTORY_CAPABILITIES.items() if isinstance(factory, kind))
    if kvsizes.domain().offers_sinks:
        names.add("sinks")
    if kvst.latent_drawable():
        names.add("latent")
    return names


def offered_and_methods(factory: CacheFactory) -> set[str]:
    """What an ``Edge``'s needs may name: the capabilities ``offered`` counts and the public
    methods (``join``, ``reset_at``, ...) of ``factory``'s caches, from one probe cache."""
    cache = factory(probe_spec())
    methods = {name for name in dir(cache) if not name.startswith("_")}
    return offered(factory, cache) | {name for name in methods if callable(getattr(cache, name))}


def outside_domain(factory: CacheFactory) -> str | None:
    """Why no cache of ``factory`` can be built inside the domain it declares (its device,
    dtypes this device lacks, a pool's block size), or None."""
    domain = kvsizes.domain()
    if not domain.declared:
        return None
    device = kvdevices.current()
    if domain.devices is not None and device.type not in domain.devices:
        return f"the cache supports devices {', '.join(domain.devices)}; this run is on {device}"
    if not kvst.supported_dtypes(kvst.WITH_HALF):
        dtypes = ", ".join(domain.dtype_names)
        return f"the cache supports dtypes {dtypes}, none of which {device} computes in"
    pages = domain.pages
    if isinstance(factory, BlockPool) and pages is not None and factory.block_size not in pages:
        supported = ", ".join(map(str, pages))
        return (
            f"the pool's block_size is {factory.block_size}; the cache supports pages {supported}"
        )
    return None


def nothing_to_draw(prop: Property, path: str) -> str | None:
    """Why ``prop`` on ``path`` has no input inside the declared domain (the dtypes it
    judges, the batch it needs), or None."""
    domain = kvsizes.domain()
    if not domain.declared:
        return None
    judges = prop.attend_dtypes if path == "attend" else prop.dtypes
    if not kvst.supported_dtypes(judges, judges):
        judged = ", ".join(map(kvdevices.dtype_name, judges))
        on = " on the attend path" if path == "attend" else ""
        return f"it judges {judged} only{on}; the cache supports {', '.join(domain.dtype_names)}"
    if domain.max_batch is not None and prop.min_batch > domain.max_batch:
        return f"it needs a batch of {prop.min_batch}; the cache supports up to {domain.max_batch}"
    return None


@dataclass(frozen=True)
class Property:
    """One property of the contract, as the suite checks it."""

    name: str  # the verdict's row and the hunt's name: short, lower case
    title: str  # what holds, in one line
    check: Callable[..., None]  # check(factory, drawn[, case][, path=...])
    strategy: st.SearchStrategy | None  # None: the check draws for itself (a state machine)
    severity: str  # what a plain AssertionError escaping the check means
    cases: tuple = ()  # a table: one test per case
    # The optional capabilities it tests: a cache's ("truncate", ...) or the factory's
    # ("block pool").
    requires: tuple[str, ...] = ()
    # Run once per path the model may take through a cache (append; attend where offered):
    # the check takes ``path=``.
    paths: bool = False
    # The share of the profile's examples each test searches: below 1 for a table of many
    # cases that mostly share one path (the model's own guards).
    examples_share: float = 1.0
    # The dtypes its check can judge (where a cache supports none of them: not offered), on
    # the attend path too, and the smallest batch its plans need.
    dtypes: tuple = kvst.WITH_HALF
    attend_dtypes: tuple = kvst.WITH_HALF
    min_batch: int = 1
    pinned: tuple = ()  # inputs tried first on every run (@example): past regressions
    # Inputs run as plain tests by name, not as @example, so that a search still shrinks.
    edges: dict[str, Any] = field(default_factory=dict)
    # What every example of one test shares, entered around its search: context(factory)
    # (the processes of a torch.distributed group, started once per test).
    context: Callable[[CacheFactory], AbstractContextManager] | None = None
    shrinks: bool = True  # False where a retry costs a restart: the failure is reported as drawn
    # The edges its plans must reach (kvcheck.reach): each noted where a plan runs it.
    reaches: tuple[reach.Edge, ...] = ()
    # Every plan within a scope (kvcheck.scope.Scope), fewest tokens first, for the
    # bounded-exhaustive mode (kvcheck.exhaustive); None: the mode searches it as usual.
    every_plan: Callable[[Scope], Iterable[Any]] | None = None
    # The tokens that mode enumerates to by default (--kv-exhaustive auto): the most whose
    # plans fit the nightly job (docs/exhaustive.md measures them).
    exhaustive_tokens: int = 6
    # The contract version it arrived in (kvcheck.contract.VERSIONS): required, never
    # defaulted, so that a new rule is never counted against a cache pinned to an older one.
    since: str = field(kw_only=True)
    # What holds, in full, for its row of docs/properties.md (generated by
    # ``python -m kvcheck.catalogue``): the cases, sizes and links a reader needs; the title
    # where one line says it all.
    holds: str = field(default="", kw_only=True)

    def __post_init__(self) -> None:
        if self.since not in contract.VERSIONS:
            raise ValueError(
                f"property {self.name!r}: since={self.since!r} names no version of the "
                f"contract (kvcheck.contract.VERSIONS: {', '.join(contract.VERSIONS)})"
            )

    def not_offered(self, factory: CacheFactory, path: str = "append") -> str | None:
        """Why ``factory`` cannot be tested for this property on ``path``: the capabilities
        it lacks, or the domain it declares leaves nothing to draw; None when neither."""
        if why := outside_domain(factory):  # its device or pool: no cache can be built
            return f"{OUTSIDE}: {why}"
        needed = (*self.requires, *(("attend",) if path == "attend" else ()))
        lacks = [name for name in needed if name not in offered(factory)] if needed else []
        methods = [
            METHODS.get(name, f"{name}()")
            for name in lacks
            if name not in FACTORY_CAPABILITIES and name not in DECLARED_CAPABILITIES
        ]
        reasons = [f"the cache has no {' or '.join(methods)} method"] if methods else []
        reasons += [DECLARED_CAPABILITIES[name] for name in lacks if name in DECLARED_CAPABILITIES]
        if "block pool" in lacks:
            reasons.append(
                "the factory is not a kvref.BlockPool (block_size, blocks_in_use, "
                "blocks_free, with_blocks)"
            )
        if "prefix caching" in lacks:
            reasons.append(
                "the factory is not a kvref.PrefixCaching pool (lookup_prefix, "
                "blocks_cached, blocks_evictable)"
            )
        if not reasons and (why := nothing_to_draw(self, path)):
            reasons.append(f"{OUTSIDE}: {why}")
        return "; ".join(reasons) or None

    def run(self, factory: CacheFactory, drawn: Any, case: Any = None, path: str = "append"):
        """The check on one input (of ``case``, on ``path``)."""
        args = (factory,) if self.strategy is None and drawn is None else (factory, drawn)
        if self.cases:
            args = (*args, case)
        with young_objects_only():  # caches dropped in a plan are collected cheaply
            if self.paths:
                return self.check(*args, path=path)
            return self.check(*args)

    def check_all_cases(self, factory: CacheFactory, drawn: Any) -> None:
        """The check on ``drawn`` for every case of the table and every path ``factory``
        offers."""
        for path in kit_paths(self, factory):
            for case in self.cases or [None]:
                self.run(factory, drawn, case, path)


def path_for(drawn: str, factory: CacheFactory) -> str:
    """The path a plan that drew ``drawn`` takes through ``factory``'s caches: attend only
    where they offer it (a plan's path is drawn before the factory is known)."""
    return drawn if drawn in paths_offered(factory) else "append"


def on_both_paths(plans: tuple) -> tuple:
    """Each pinned plan (one with a drawn ``path``) on the append path and on the attend
    path, which it takes where the cache offers attend (``path_for``)."""
    return (*plans, *(dataclasses.replace(plan, path="attend") for plan in plans))


def kit_paths(prop: Property, factory: CacheFactory) -> tuple[str, ...]:
    """The paths ``prop`` runs on for ``factory``: each it offers, or append alone."""
    return paths_offered(factory) if prop.paths else PATHS[:1]


def property_test(prop: Property):
    """A test method that searches ``prop`` with Hypothesis on the cache under test, once
    per case of its table and per path of the model through the cache.

    The search is built when the test runs, with the kit's settings for this run
    (``kvcheck.profiles``): a Hypothesis profile loaded for the host process does not change
    it, and the kit changes none."""

    def body(self, cache_factory, case, path, block):
        sizes = kvsizes.declared_by(cache_factory, type(self))
        with kvsizes.aiming_at(sizes):
            skip_unless_offered(prop, cache_factory, path)
        if block is not None:  # the bounded-exhaustive mode: every plan of one block
            with kvprofiles.torch_threads(), kvsizes.aiming_at(sizes):
                exhaustive.run_block(
                    prop,
                    block,
                    lambda plan: prop.run(cache_factory, plan, case, path),
                    lambda plan: search(
                        prop,
                        lambda drawn: prop.run(cache_factory, drawn, case, path),
                        {prop.name: (plan,)},
                        sizes,
                        pinned_only=True,
                    ),
                    factory=cache_factory,
                    test_id=f"{type(self).__qualname__}.{prop.name}[{case}-{path}]",
                )
            return
        if exhaustive.setting_for(type(self)) is not None:  # an exhaustive run searches it
            exhaustive.note_searched()
        if prop.strategy is None:  # a state machine: it draws for itself
            paths = {"path": path} if prop.paths else {}
            with kvprofiles.torch_threads(), kvsizes.aiming_at(sizes), young_objects_only():
                prop.check(cache_factory, examples_scale=self.examples_scale, **paths)
            return
        with prop.context(cache_factory) if prop.context else nullcontext():
            search(
                prop,
                lambda drawn: prop.run(cache_factory, drawn, case, path),
                self.pinned,
                sizes,
                self.examples_scale,
            )

    # pytest parametrizes only arguments without defaults: one signature per shape.
    # ``kv_block`` is the plugin's fixture: None, or the block of plans the exhaustive mode
    # parametrizes it with (kvcheck.exhaustive).
    if prop.cases and prop.paths:

        def test(self, cache_factory, case, path, kv_block):
            body(self, cache_factory, case, path, kv_block)

    elif prop.cases:

        def test(self, cache_factory, case, kv_block):
            body(self, cache_factory, case, "append", kv_block)

    elif prop.paths:

        def test(self, cache_factory, path, kv_block):
            body(self, cache_factory, None, path, kv_block)

    else:

        def test(self, cache_factory, kv_block):
            body(self, cache_factory, None, "append", kv_block)

    if prop.paths:  # the plugin parametrizes the paths each cache offers, with the cache
        test = pytest.mark.kv_paths(test)
    if prop.cases:
        test = pytest.mark.parametrize("case", prop.cases, ids=str)(test)
    test.__doc__ = prop.title
    return pytest.mark.kv_property(prop.name, prop.since)(test)


def skip_unless_offered(prop: Property, factory, path: str = "append") -> None:
    """Skip, as "not offered", a property (or the attend path) of a capability the cache
    does not have (a cache offers one by having the method), or the factory (a BlockPool)."""
    if reason := prop.not_offered(factory, path):
        pytest.skip(f"{NOT_OFFERED}: {reason}")


def search(
    prop: Property,
    check,
    pinned: dict[str, tuple] | None = None,
    sizes: kvsizes.Sizes = kvsizes.NONE,
    examples_scale: float = 1.0,
    *,
    pinned_only: bool = False,
) -> None:
    """Search ``prop.strategy`` for an input that fails ``check``, pinned inputs first: the
    kit's, then the test class's own (``pinned[prop.name]``); the draws aim at ``sizes``;
    ``examples_scale`` times the profile's examples (and the property's share). With
    ``pinned_only``, ``pinned[prop.name]`` alone runs, and nothing is drawn."""

    explicit = (*(() if pinned_only else prop.pinned), *(pinned or {}).get(prop.name, ()))
    # Every draw runs, a plan drawn twice included: Hypothesis itself does not run one
    # choice sequence twice for a new example, and measured on the built-ins (ci and dev
    # profiles, 980 runs each) no two draws of a test built the same plan. The kit once
    # rejected a plan that held already; Hypothesis reruns a choice sequence while shrinking
    # and replaying, and a run valid the first time and rejected the next is a flaky test
    # to it, reported in place of the failure it had found.

    def falsify(drawn):
        try:
            check(drawn)
        except kvsizes.OutsideDomain:
            if not any(drawn is given for given in explicit):
                raise
            # A pinned input outside the cache's declared domain: left out, not run.

    falsify.__name__ = falsify.__qualname__ = prop.name.replace(" ", "_")
    test = falsify
    for drawn in explicit:
        test = example(drawn=drawn)(test)
    kit = kvprofiles.current()
    examples = max(1, math.ceil(kit.max_examples * prop.examples_share * examples_scale))
    phases = kit.phases if prop.shrinks else tuple(p for p in kit.phases if p != Phase.shrink)
    if pinned_only:
        phases = (Phase.explicit,)
    chosen = settings(kit, max_examples=examples, phases=phases)
    with kvprofiles.torch_threads(), kvsizes.aiming_at(sizes):
        # A property whose plans are built, not drawn, reruns an enumerated one as pinned.
        strategy = st.nothing() if prop.strategy is None else prop.strategy
        given(drawn=strategy)(chosen(test))()


def edge_test(prop: Property):
    """A plain test of ``prop`` on each of its hand-picked edge inputs, on each path."""

    @pytest.mark.parametrize("edge", prop.edges.values(), ids=list(prop.edges))
    def test(self, cache_factory, edge):
        with kvsizes.aiming_at(kvsizes.declared_by(cache_factory, type(self))):
            skip_unless_offered(prop, cache_factory)
            with kvprofiles.torch_threads():
                try:
                    for path in kit_paths(prop, cache_factory):
                        prop.run(cache_factory, edge, path=path)
                except kvsizes.OutsideDomain as error:
                    pytest.skip(f"{NOT_OFFERED}: {OUTSIDE}: {error.what}")

    test.__doc__ = f"{prop.title} (hand-picked edges)"
    return pytest.mark.kv_property(prop.name, prop.since)(test)


class KitTests:
    """What every class of the kit shares: the cache under test."""

    factory = None  # a CacheFactory (a class taking a CacheSpec qualifies); None: --kv-impl
    cache_name: str | None = None  # the name in test ids; default: the factory's __name__
    # Your own regressions, tried first on every run: property name -> inputs, e.g. the
    # `drawn=` of a falsifying example pasted from a failure.
    pinned: ClassVar[dict[str, tuple]] = {}
    # The sizes your cache is built around (kvcheck.Sizes: page, head_dims, kv_heads,
    # max_batch), for the draws to hit on purpose, and what it supports (supports=: nothing
    # is drawn outside it); the factory's own `kv_sizes` otherwise, field by field.
    sizes: ClassVar[kvsizes.Sizes | None] = None
    # Examples per property, as a multiple of the profile's (--kv-profile): more for a
    # nightly job on one cache, fewer for caches that only guard against false alarms.
    examples_scale: ClassVar[float] = 1.0
    # The bounded-exhaustive mode for this class (--kv-exhaustive wins over it): every plan
    # of up to N tokens of each property that enumerates its plans, or "auto" for each
    # property's own N; None: a Hypothesis search (kvcheck.exhaustive, docs/exhaustive.md).
    exhaustive: ClassVar[int | str | None] = None
