"""Ten one-bug caches and engines whose bug shows only where two events meet.

Each module is a cache (or an engine, or a block pool) in a storage style of its own,
written from docs/contract.md without subclassing or wrapping this repository's built-in or
independent caches. Each is correct but for one bug that needs an event to leave a
particular state and a second event to meet it; the module docstring names the two events,
the state between them and why a correct cache differs. Each bug has a correct twin, the
same code with a flag turned the other way (a subclass in the same module).

- ``INTERPLAY_BUGS``: name -> factory (a cache class, a block pool instance, or an engine
  class, which is an ``EngineFactory``).
- ``TWINS``: the same names -> the twin's factory.
- ``ENGINES``: the names whose factory is an engine (run them through
  ``kvcheck.engines.EngineTests``, not ``--kv-impl``).
- ``KV_IMPL``: name -> the ``MODULE:ATTR`` a ``--kv-impl`` (or an engine test) imports,
  for the bug and for its twin.

How the kit fares on each, in the ci profile and under random seeds, is measured by
``tests/interplay/measure.py`` (its table is written where ``--out`` says; the figures of a
release are in its notes).
"""

from __future__ import annotations

from tests.interplay.beams import LazyGatherComposesReorders, LazyGatherOverwritesPendingReorder
from tests.interplay.chunks import ImportIndexesChunk, ImportLeavesChunkIndexBehind
from tests.interplay.lag_engine import (
    LagEngineAddsPendingRotation,
    LagEngineOverwritesPendingRotation,
)
from tests.interplay.ledger import RESTORE_ENTERS_LEDGER, RESTORE_SKIPS_LEDGER
from tests.interplay.mirror import MirrorSyncedMarkRewound, MirrorSyncedMarkSurvivesTruncate
from tests.interplay.positions import TreeAnchorFollowsTruncate, TreeAnchorSurvivesTruncate
from tests.interplay.segments import ShiftCopiesSegments, ShiftRotatesSharedSegments
from tests.interplay.slab import ResetDetachesSharedSlab, ResetScrubsSharedSlab
from tests.interplay.slots import JoinReusesLiveSlot, JoinTakesFreeSlot
from tests.interplay.tombstone_engine import (
    TombstoneEngineCompactsBeforeCopy,
    TombstoneEngineCopiesDeadEntries,
)

# name -> (module, bug's attribute, twin's attribute, the bug's factory, the twin's)
_TABLE = {
    "LazyGatherOverwritesPendingReorder": (
        "beams", "LazyGatherOverwritesPendingReorder", "LazyGatherComposesReorders",
        LazyGatherOverwritesPendingReorder, LazyGatherComposesReorders,
    ),
    "MirrorSyncedMarkSurvivesTruncate": (
        "mirror", "MirrorSyncedMarkSurvivesTruncate", "MirrorSyncedMarkRewound",
        MirrorSyncedMarkSurvivesTruncate, MirrorSyncedMarkRewound,
    ),
    "ResetScrubsSharedSlab": (
        "slab", "ResetScrubsSharedSlab", "ResetDetachesSharedSlab",
        ResetScrubsSharedSlab, ResetDetachesSharedSlab,
    ),
    "ImportLeavesChunkIndexBehind": (
        "chunks", "ImportLeavesChunkIndexBehind", "ImportIndexesChunk",
        ImportLeavesChunkIndexBehind, ImportIndexesChunk,
    ),
    "TreeAnchorSurvivesTruncate": (
        "positions", "TreeAnchorSurvivesTruncate", "TreeAnchorFollowsTruncate",
        TreeAnchorSurvivesTruncate, TreeAnchorFollowsTruncate,
    ),
    "RestoreSkipsLedger": (
        "ledger", "RESTORE_SKIPS_LEDGER", "RESTORE_ENTERS_LEDGER",
        RESTORE_SKIPS_LEDGER, RESTORE_ENTERS_LEDGER,
    ),
    "JoinReusesLiveSlot": (
        "slots", "JoinReusesLiveSlot", "JoinTakesFreeSlot",
        JoinReusesLiveSlot, JoinTakesFreeSlot,
    ),
    "ShiftRotatesSharedSegments": (
        "segments", "ShiftRotatesSharedSegments", "ShiftCopiesSegments",
        ShiftRotatesSharedSegments, ShiftCopiesSegments,
    ),
    "LagEngineOverwritesPendingRotation": (
        "lag_engine", "LagEngineOverwritesPendingRotation", "LagEngineAddsPendingRotation",
        LagEngineOverwritesPendingRotation, LagEngineAddsPendingRotation,
    ),
    "TombstoneEngineCopiesDeadEntries": (
        "tombstone_engine", "TombstoneEngineCopiesDeadEntries",
        "TombstoneEngineCompactsBeforeCopy",
        TombstoneEngineCopiesDeadEntries, TombstoneEngineCompactsBeforeCopy,
    ),
}  # fmt: skip

# Each bug's two events and the state between them, in a line (the module docstring says more).
PAIRS = {
    "LazyGatherOverwritesPendingReorder": "reorder → [a permutation pending] → reorder",
    "MirrorSyncedMarkSurvivesTruncate":
        "attend, truncate → [mirror marked synced past the length] → attend",
    "ResetScrubsSharedSlab": "fork → [a slab with two owners] → reset of either side",
    "ImportLeavesChunkIndexBehind": "import_rows → [a chunk the index lacks] → truncate",
    "TreeAnchorSurvivesTruncate": "truncate → [draft anchor past the length] → append_tree",
    "RestoreSkipsLedger":
        "offload, restore → [blocks the ledger does not list] → reset or drop",
    "JoinReusesLiveSlot": "select_rows (a row leaves) → [slot ids not 0..B-1] → join",
    "ShiftRotatesSharedSegments": "fork → [segments shared] → shift",
    "LagEngineOverwritesPendingRotation":
        "shift → [rotation pending, sequence not decoded since] → shift",
    "TombstoneEngineCopiesDeadEntries":
        "remove → [tombstones not reclaimed, source not run since] → copy",
}  # fmt: skip

INTERPLAY_BUGS = {name: row[3] for name, row in _TABLE.items()}
TWINS = {name: row[4] for name, row in _TABLE.items()}
ENGINES = frozenset({"LagEngineOverwritesPendingRotation", "TombstoneEngineCopiesDeadEntries"})
KV_IMPL = {
    name: (f"tests.interplay.{module}:{bug}", f"tests.interplay.{module}:{twin}")
    for name, (module, bug, twin, _, _) in _TABLE.items()
}
