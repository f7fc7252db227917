"""Block pools: the protocols of a factory whose caches share one pool of fixed-size blocks
(a paged cache, as serving engines have), the block tables such a cache shows, and a pool
that shares blocks by content (prefix caching, contract section 9.1). These describe the
factory, not one layer's cache; the kit tests pools through them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from torch import Tensor

from kvref.protocol import LayerCache


@runtime_checkable
class BlockPool(Protocol):
    """A factory whose caches take fixed-size blocks from one pool it owns (a paged cache,
    as serving engines have): caches for any layer and any request share it, each through
    block tables of its own, and give their blocks back on ``reset()`` and when collected."""

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        ...

    @property
    def blocks_in_use(self) -> int:
        """Distinct blocks the live caches' block tables reference; a shared block once."""
        ...

    @property
    def blocks_free(self) -> int:
        """Blocks an append may still take before the pool refuses."""
        ...

    def with_blocks(self, num_blocks: int) -> BlockPool:
        """A new, empty pool of the same kind and block size with room for ``num_blocks``
        blocks: the suite builds tight pools with it, so that blocks are freed and reused
        constantly and an exhausted pool's refusal is tested."""
        ...


@runtime_checkable
class BlockTables(Protocol):
    """A cache of a ``BlockPool`` that shows where its rows lie."""

    @property
    def block_tables(self) -> list[list[int]]:
        """Per batch row, the ids of the pool blocks it reads, oldest first."""
        ...


@runtime_checkable
class PrefixCaching(Protocol):
    """A ``BlockPool`` that shares blocks by content (contract, section 9.1): a request's
    caches start holding the longest published prefix of its tokens; its caches take the
    tokens of their rows with ``declare_tokens``. ``with_blocks(n, block_hash=...)`` keys
    blocks by a hash the caller controls."""

    @property
    def blocks_cached(self) -> int:
        """Blocks published for matching, in use or not."""
        ...

    @property
    def blocks_evictable(self) -> int:
        """Published blocks no live cache references (counted in ``blocks_free``)."""
        ...

    def lookup_prefix(
        self, caches: Sequence[LayerCache], tokens: Tensor, *, salt: str | None = None
    ) -> int:
        """Declare ``tokens`` (B, T) to one request's empty caches (one per layer, in layer
        order) and make each hold the longest whole-block prefix published for its layer,
        ``salt`` and first position; return its length."""
        ...
