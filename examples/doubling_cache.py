"""A cache written as a user of the suite would write one: buffers that double when full.

Run the suite on it with ``pytest -n auto --kv-impl examples.doubling_cache:DoublingCache``.
Growth copies the held rows once per doubling, so appends cost amortised O(1) copies per
token; once it holds more than ``initial_capacity`` tokens, at most half of what it
reserves is unused.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvref import CacheSpec, check_append


class DoublingCache:
    def __init__(self, spec: CacheSpec, initial_capacity: int = 8) -> None:
        if isinstance(initial_capacity, bool) or not isinstance(initial_capacity, int):
            raise TypeError(f"initial_capacity must be an int, got {initial_capacity!r}")
        if initial_capacity < 1:  # doubling 0 would never make room
            raise ValueError(f"initial_capacity must be >= 1, got {initial_capacity}")
        self.spec = spec
        self.initial_capacity = initial_capacity
        self.reset()

    @property
    def length(self) -> int:
        return self._length

    @property
    def nbytes(self) -> int:
        return self.key.nbytes + self.value.nbytes

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        new_tokens = check_append(self.spec, self._length, key, value)
        end = self._length + new_tokens
        self._reserve(end)
        self.key[:, :, self._length : end] = key
        self.value[:, :, self._length : end] = value
        self._length = end
        return self.key[:, :, :end], self.value[:, :, :end]

    def reset(self) -> None:
        self.key, self.value = self._buffers(self.initial_capacity)
        self._length = 0

    def _reserve(self, needed: int) -> None:
        capacity = self.key.shape[2]
        if needed <= capacity:
            return
        while capacity < needed:
            capacity *= 2
        key, value = self._buffers(capacity)
        key[:, :, : self._length] = self.key[:, :, : self._length]
        value[:, :, : self._length] = self.value[:, :, : self._length]
        self.key, self.value = key, value

    def _buffers(self, capacity: int) -> tuple[Tensor, Tensor]:
        s = self.spec
        shape = (s.batch, s.kv_heads, capacity, s.head_dim)
        return (
            torch.zeros(shape, dtype=s.dtype, device=s.device),
            torch.zeros(shape, dtype=s.dtype, device=s.device),
        )
