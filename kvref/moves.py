"""Rows out of a cache (contract, section 11.2): what ``export_rows`` hands over and
``import_rows`` takes, so that rows move between caches of other layouts (block size, shard
count, device), as disaggregated prefill and decode move them. The capability itself is
declared as ``kvref.capabilities.Movable``; ``kvref.checks.check_import`` checks an import.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvref.protocol import CacheSpec


@dataclass(frozen=True)
class CacheRows:
    """A cache's rows out of it, in no layout (contract, section 11.2): ``keys`` (B, H_kv,
    rows, D) and ``values`` (B, H_kv, rows, value width), oldest first, the last at position
    ``length - 1``; ``block_size`` the block size of the layout they came from (None: none)."""

    keys: Tensor
    values: Tensor
    length: int
    block_size: int | None = None

    @property
    def rows(self) -> int:
        return self.keys.shape[2] if isinstance(self.keys, Tensor) else 0


def no_rows(spec: CacheSpec) -> tuple[Tensor, Tensor]:
    """Zero rows of keys and values for ``spec``: an empty cache's, or its export."""
    shape = (spec.batch, spec.kv_heads, 0)
    return (
        torch.empty((*shape, spec.head_dim), dtype=spec.dtype, device=spec.device),
        torch.empty((*shape, spec.value_width), dtype=spec.dtype, device=spec.device),
    )
