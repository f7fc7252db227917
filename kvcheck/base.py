"""The test classes a user subclasses: one class per area, each test bound to one property.

``CacheTests`` inherits them all; subclass it and set ``factory`` to run every property on
your cache (new properties reach you with the next release, with no change on your side)::

    from kvcheck import CacheTests
    from mypkg.caches import MyCache

    class TestMyCache(CacheTests):
        factory = MyCache

With ``factory`` left as None, the caches come from ``--kv-impl`` / ``KV_IMPL`` / the
``kv_impl`` ini option, one test per cache, named in the test id. Each area class lives in
its area module (``kvcheck/properties/<area>.py``) beside the properties it runs.
"""

from __future__ import annotations

from kvcheck.kit import KitTests
from kvcheck.properties.attend import AttendTests
from kvcheck.properties.core import CoreTests
from kvcheck.properties.edits import ReorderTests, TruncateTests
from kvcheck.properties.interactions import InteractionTests
from kvcheck.properties.isolation import IsolationTests
from kvcheck.properties.memory import MemoryTests
from kvcheck.properties.moves import MoveTests
from kvcheck.properties.pool import PoolTests
from kvcheck.properties.rejection import RejectionTests
from kvcheck.properties.requests import ForkTests, RequestsTests
from kvcheck.properties.reset import ResetTests
from kvcheck.properties.rows import RowsTests
from kvcheck.properties.serving import ServingTests
from kvcheck.properties.sharded import ShardedTests
from kvcheck.properties.shared import SharedLayersTests
from kvcheck.properties.shift import ShiftTests
from kvcheck.properties.sinks import SinksTests
from kvcheck.properties.stateful import StatefulTests
from kvcheck.properties.tree import TreeTests


class CacheTests(
    CoreTests,
    ResetTests,
    IsolationTests,
    RejectionTests,
    MemoryTests,
    StatefulTests,
    RequestsTests,
    SharedLayersTests,
    AttendTests,
    ForkTests,
    PoolTests,
    ServingTests,
    TreeTests,
    TruncateTests,
    ReorderTests,
    RowsTests,
    ShiftTests,
    SinksTests,
    MoveTests,
    ShardedTests,
    InteractionTests,
):
    """Every property of the kit. Subclass it, set ``factory``, and pytest runs them all;
    those of a capability the cache does not offer are skipped as "not offered"."""


__all__ = [
    "AttendTests",
    "CacheTests",
    "CoreTests",
    "ForkTests",
    "InteractionTests",
    "IsolationTests",
    "KitTests",
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
    "StatefulTests",
    "TreeTests",
    "TruncateTests",
]
