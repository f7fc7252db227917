"""kvcheck: a conformance kit for transformer key/value caches.

Install the project, then run every property of the kit on your cache in one of two ways.

With a test file of your own (this is all it needs)::

    from kvcheck import CacheTests
    from mypkg.caches import MyCache

    class TestMyCache(CacheTests):
        factory = MyCache

and ``pytest -n auto`` in your repository. Or with no file at all::

    pytest -n auto --pyargs kvcheck --kv-impl mypkg.caches:MyCache

(``--kv-impl`` is repeatable; ``KV_IMPL`` and the ``kv_impl`` ini option name caches too;
``--kv-impl mine=mypkg.caches:MyCache`` calls the cache ``mine`` in test ids and the verdict;
with no cache named, a class without ``factory`` stops the run with a usage error that says
how to name one).
Either way the run ends with a verdict per cache (each property: pass, or FAIL with its
severity and first line), ``--kv-report PATH`` writes it as JSON, and Hypothesis prints the
smallest input it found for each failure. New properties reach you with a new release of the
kit, with no change on your side.

``CacheTests`` inherits one class per area (``CoreTests``, ``ResetTests``,
``IsolationTests``, ``RejectionTests``, ``MemoryTests``, ``StatefulTests``,
``RequestsTests``, ``SharedLayersTests`` (layers that read another layer's cache, declared
by the model), and for the optional capabilities ``AttendTests``, ``ForkTests``,
``PoolTests`` (a factory that is a ``kvref.BlockPool``), ``TruncateTests``, ``ReorderTests``
``RowsTests`` (rows of their own, ``append_rows``), ``ShiftTests`` (context shift, ``shift``),
``SinksTests`` (attention sinks a cache declares), ``ServingTests`` (prefix caching and
offload), ``TreeTests`` (tree drafts), ``MoveTests`` (moves between layouts) and
``ShardedTests`` (tensor-parallel ranks, run on every cache) and ``InteractionTests`` (every
pair of events the cache offers)); subclass one of them instead
to run only that area. ``EngineTests`` puts a whole engine under the kit where its cache
cannot be reached layer by layer (``kvcheck.engines``, contract section 13). The contract a
cache must keep is in ``kvref.protocol`` and
``docs/contract.md``.
"""

from typing import TYPE_CHECKING

__all__ = [
    "AttendTests",
    "CacheTests",
    "CoreTests",
    "Domain",
    "EngineTests",
    "ForkTests",
    "InteractionTests",
    "IsolationTests",
    "MemoryTests",
    "MoveTests",
    "PoolTests",
    "RejectionTests",
    "ReorderTests",
    "RequestsTests",
    "ResetTests",
    "RowsTests",
    "ServingTests",
    "ShardedTests",
    "SharedLayersTests",
    "ShiftTests",
    "SinksTests",
    "Sizes",
    "StatefulTests",
    "TreeTests",
    "TruncateTests",
]

if TYPE_CHECKING:  # what __getattr__ below serves, for type checkers and the API reference
    from kvcheck.base import (
        AttendTests,
        CacheTests,
        CoreTests,
        ForkTests,
        InteractionTests,
        IsolationTests,
        MemoryTests,
        MoveTests,
        PoolTests,
        RejectionTests,
        ReorderTests,
        RequestsTests,
        ResetTests,
        RowsTests,
        ServingTests,
        ShardedTests,
        SharedLayersTests,
        ShiftTests,
        SinksTests,
        StatefulTests,
        TreeTests,
        TruncateTests,
    )
    from kvcheck.engines import EngineTests
    from kvcheck.sizes import Domain, Sizes


def __getattr__(name: str):
    # The test classes import torch, Hypothesis and the reference model: only when asked
    # for, so that the plugin (kvcheck.plugin, loaded by every pytest run where this is
    # installed) imports none of them in a run without kit tests, nor does
    # `python -m kvcheck.verdict`.
    if name in ("Sizes", "Domain"):
        from kvcheck import sizes

        return getattr(sizes, name)
    if name == "EngineTests":  # a whole engine, driven by token ids (contract, section 13)
        from kvcheck.engines import EngineTests

        return EngineTests
    if name in __all__:
        from kvcheck import base

        return getattr(base, name)
    raise AttributeError(f"module 'kvcheck' has no attribute {name!r}")
