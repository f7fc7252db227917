"""One buffer of ``max_length`` rows per K and V and a write position; refuses to overflow."""

from __future__ import annotations

import torch
from torch import Tensor

from kvref.protocol import CacheSpec, check_append


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

    def reset(self) -> None:
        self._length = 0
