"""One buffer of ``max_length`` rows per K and V and a write position; refuses to overflow."""

from __future__ import annotations

import torch
from torch import Tensor

from kvref.protocol import CacheSpec, check_append, check_reorder, check_truncate


class PreallocatedCache:
    def __init__(self, spec: CacheSpec) -> None:
        self.spec = spec
        shape = (spec.batch, spec.kv_heads, spec.max_length, spec.head_dim)
        self.key = torch.zeros(shape, dtype=spec.dtype, device=spec.device)
        self.value = torch.zeros(shape, dtype=spec.dtype, device=spec.device)
        self._length = 0

    @property
    def length(self) -> int:
        return self._length

    @property
    def nbytes(self) -> int:
        return self.key.nbytes + self.value.nbytes

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        start = self._length
        end = start + check_append(self.spec, start, key, value, capacity=self.spec.max_length)
        self.key[:, :, start:end] = key
        self.value[:, :, start:end] = value
        self._length = end
        # Only the rows written since the last reset: stale rows never leave the cache.
        return self.key[:, :, :end], self.value[:, :, :end]

    def truncate(self, length: int) -> None:
        check_truncate(self._length, length)
        self._length = length  # the rows past it are never returned, and will be overwritten

    def reorder(self, indices: Tensor) -> None:
        check_reorder(self.spec, indices)
        valid = self._length  # only the rows written, not the whole buffer
        for buffer in (self.key, self.value):
            buffer[:, :, :valid] = buffer[:, :, :valid].index_select(0, indices)

    def reset(self) -> None:
        self._length = 0
