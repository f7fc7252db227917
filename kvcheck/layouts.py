"""The layouts a cache moves between (docs/contract.md, section 11.2), and the kit's own
cache at the other end of a move.

A layout is where a request's caches live: "the cache" (the factory under test as given),
("block size", n) (its pool rebuilt with blocks of n tokens, where it has
``with_block_size``), or "the reference" (``ReferenceRows``, the kit's). A move from the
cache to the reference and back tells an export bug from an import bug: the reference's
export and import are a few lines that hold every row.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvref import CacheFactory, CacheRows, CacheSpec, check_append, check_import
from kvref.moves import no_rows
from kvref.protocol import keys_stored

REFERENCE = "the reference"
THE_CACHE = "the cache"


class ReferenceRows:
    """The kit's movable cache: every row it was given or imported, oldest first, in one
    pair of tensors (a window's recent run, after the import of one)."""

    def __init__(self, spec: CacheSpec) -> None:
        self.spec = spec
        self.reset()

    @property
    def length(self) -> int:
        return self._length

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        self._length += check_append(self.spec, self._length, key, value)
        self.keys = torch.cat((self.keys, key), dim=2)  # new tensors: the input is copied
        self.values = torch.cat((self.values, value), dim=2)
        return self.keys, self.values

    def reset(self) -> None:
        self.keys, self.values = no_rows(self.spec)
        self._length = 0

    def export_rows(self) -> CacheRows:
        return CacheRows(self.keys.clone(), self.values.clone(), self._length)

    def import_rows(self, rows: CacheRows) -> None:
        rows = check_import(self.spec, self._length, rows)
        self.keys, self.values = rows.keys.clone(), rows.values.clone()
        self._length = rows.length


def factory_of(factory: CacheFactory, layout) -> CacheFactory:
    """The factory whose caches make up ``layout``."""
    if layout == REFERENCE:
        return ReferenceRows
    if layout == THE_CACHE:
        return factory
    _, block_size = layout
    return factory.with_block_size(block_size)


def reference_fits(factory: CacheFactory, probe: object) -> bool:
    """Whether the reference can stand at the other end of ``factory``'s moves: it keeps
    keys rotated, as ``probe`` (a cache of the factory) must too."""
    return keys_stored(probe) == "rotated"


def said(layout) -> str:
    """A layout, for a message."""
    if isinstance(layout, tuple):
        return f"the cache's pool with blocks of {layout[1]} tokens"
    if layout == REFERENCE:
        return "the kit's reference cache (kvcheck.layouts.ReferenceRows)"
    return "the cache under test"
