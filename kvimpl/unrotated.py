"""A preallocated cache that keeps keys as they were before RoPE (contract, section 8.4).

The model hands it keys unrotated and rotates the keys it returns at their current positions,
so the cache is storage only: its rows are returned bit for bit as given, and a context shift
is a deletion, exact whatever the dtype, with no key re-rotated (the positions after the span
change because their indices do). It takes the append path: with keys to rotate after they
are read, the model never calls an ``attend`` (none is offered here).

Its keys move (``export_rows``, ``import_rows``: section 11.2) as it stores them, unrotated:
the kit moves rows only between caches that store keys the same way.
"""

from __future__ import annotations

from torch import Tensor

from kvimpl.preallocated import PreallocatedCache


class UnrotatedCache(PreallocatedCache):
    keys_stored = "unrotated"

    def _moved_keys(self, keys: Tensor, count: int) -> Tensor:
        return keys  # positions are the model's to apply: nothing to re-rotate
