"""Cross-layer KV sharing (contract, section 10.3): a layer that reads an earlier layer's
cache instead of keeping one. The model hands the source layer its cache wrapped
(``SharedRows``), which keeps what this step's append returned, and each reader a
``SharedReader``, which appends nothing and gets those very rows back.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from kvref.protocol import LayerCache, keys_stored
from kvref.rows import row_positions
from kvref.tree import TreeBatch


class SharedRows:
    """A layer's cache as the model hands it to that layer where later layers read it
    (contract, section 10.3): appends (``append``, ``append_rows``, ``append_tree``) pass
    through, and what the call returned is kept for this step's readers, the very tensors
    (rule 2 keeps them valid until the cache's next call), with the length, or each row's,
    the cache held before it. In an uncached pass there is no cache, and the rows are the
    pass's own keys and values."""

    def __init__(self, cache: LayerCache | None) -> None:
        self.cache = cache
        self.before = 0  # the cache's length before this step's append
        self.rows_before: tuple[int, ...] = ()  # each row's, before this step's append_rows
        self.rows: tuple[Tensor, ...] | None = None

    @property
    def keys_stored(self) -> str:
        return "rotated" if self.cache is None else keys_stored(self.cache)

    @property
    def length(self) -> int:
        return 0 if self.cache is None else self.cache.length

    @property
    def offset(self) -> int:
        """Where a reader's queries start, after the session's first position: at the
        positions this step's new rows were given, the length before the append."""
        return self.before

    @property
    def row_offsets(self) -> tuple[int, ...]:
        """Where each row's reader queries start, after that row's first position: at the
        positions this step's new rows were given, the row lengths before ``append_rows``."""
        return self.rows_before

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        self.before = self.length
        self.rows = (key, value) if self.cache is None else self.cache.append(key, value)
        return self.rows

    def append_rows(self, key: Tensor, value: Tensor, counts) -> tuple[Tensor, Tensor, Tensor]:
        self.rows_before = tuple(self.cache.row_lengths)
        self.rows = self.cache.append_rows(key, value, counts)
        return self.rows

    def append_tree(self, key: Tensor, value: Tensor, parents) -> tuple[Tensor, Tensor]:
        self.before = self.length
        self.rows = self.cache.append_tree(key, value, parents)
        return self.rows


class SharedReader:
    """What a layer that reads another's cache is handed in its place: appends nothing, and
    gets back the rows its source's append of this step returned (rule 2 keeps them valid
    until the source's next call, which comes after every reader)."""

    def __init__(self, shared: SharedRows) -> None:
        self.shared = shared

    @property
    def keys_stored(self) -> str:
        return self.shared.keys_stored

    @property
    def length(self) -> int:
        return self.shared.before

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        return self.shared.rows

    def append_rows(self, key: Tensor, value: Tensor, counts) -> tuple[Tensor, Tensor, Tensor]:
        return self.shared.rows  # the source's keys, values and valid, each row masked by its own

    def append_tree(self, key: Tensor, value: Tensor, parents) -> tuple[Tensor, Tensor]:
        return self.shared.rows

    def row_positions(self, firsts: Sequence[int], real: Tensor) -> Tensor:
        """(B, T) positions of this reader's queries in ``forward_rows``: row b's from its
        first position plus its source's row length before this step's ``append_rows``."""
        offsets = self.shared.row_offsets
        starts = [first + offset for first, offset in zip(firsts, offsets, strict=True)]
        return row_positions(torch.tensor(starts, device=real.device), real)

    def tree_positions(self, first: int, depths: Tensor) -> Tensor:
        """(T,) positions of this reader's draft nodes: node i at its source's length before
        ``append_tree`` plus its depth, as the source's node i."""
        return first + self.shared.offset + depths

    def tree_batch(self, tree: TreeBatch) -> TreeBatch:
        """The draft as this reader verifies it: its source's, under the same tree mask (a
        sibling seen would leak another branch into a node's logits)."""
        return tree


def is_cached(cache: object) -> bool:
    """Whether the rows a layer attends over come from a cache (not an uncached pass)."""
    if isinstance(cache, SharedReader):
        cache = cache.shared
    return cache is not None and not (isinstance(cache, SharedRows) and cache.cache is None)


def caches_as_handed(config, caches: Sequence[LayerCache | None]) -> list:
    """Each layer's cache as its block is handed it in a model of ``config``: its own;
    wrapped in ``SharedRows`` where later layers read it; for a reader, a ``SharedReader``
    of its source's in place of its None."""
    read = {config.source_of(layer) for layer in range(config.num_layers)} - {None}
    handed: list = []
    for layer, cache in enumerate(caches):
        source = config.source_of(layer)
        if source is not None:
            cache = SharedReader(handed[source])
        elif layer in read:
            cache = SharedRows(cache)
        handed.append(cache)
    return handed
