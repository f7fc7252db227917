"""Style 2: one tensor holding keys AND values, shape (2, batch, kv_heads, capacity, head_dim).

Deliberately different: keys and values share a single allocation (index 0 keys, 1 values),
which grows by 1.5x with a copy (never beyond max_length) and shrinks back on reset; its own
exception class ``CacheInputError(ValueError)``, also used for non-tensors; dtype and device
are checked before shapes; messages mostly show the values involved; T = 0 is refused;
appending past max_length is refused ("no room: 5 + 3 > 7").
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


class CacheInputError(ValueError):
    """An append this cache will not take; the cache is unchanged."""


class StackedCache:
    INITIAL = 4

    def __init__(self, spec) -> None:
        self.spec = spec
        self.device = torch.device(spec.device)
        self.reset()

    @property
    def length(self) -> int:
        return self._used

    @property
    def nbytes(self) -> int:
        return self._kv.nbytes

    def reset(self) -> None:
        self._kv = self._alloc(min(self.INITIAL, self.spec.max_length))
        self._used = 0

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        t = self._check(key, value)
        start, end = self._used, self._used + t
        if end > self._kv.shape[3]:
            grown = self._alloc(
                min(self.spec.max_length, max(end, math.ceil(self._kv.shape[3] * 1.5)))
            )
            grown[:, :, :, :start] = self._kv[:, :, :, :start]
            self._kv = grown
        self._kv[0, :, :, start:end] = key
        self._kv[1, :, :, start:end] = value
        self._used = end
        return self._kv[0, :, :, :end], self._kv[1, :, :, :end]

    def _alloc(self, capacity: int) -> Tensor:
        s = self.spec
        return torch.zeros(
            2, s.batch, s.kv_heads, capacity, s.head_dim, dtype=s.dtype, device=self.device
        )

    def _check(self, key: object, value: object) -> int:
        s = self.spec
        for what, x in (("key", key), ("value", value)):
            if not isinstance(x, Tensor):
                raise CacheInputError(f"{what}: expected a torch.Tensor, got {type(x).__name__}")
        for what, x in (("key", key), ("value", value)):
            same_device = x.device.type == self.device.type and self.device.index in (
                None,
                x.device.index,
            )
            if x.dtype != s.dtype or not same_device:
                raise CacheInputError(
                    f"{what}: expected {s.dtype} on {self.device}, got {x.dtype} on {x.device}"
                )
        if key.ndim != 4 or value.ndim != 4:
            raise CacheInputError(
                f"expected (B, H, T, D), got key {tuple(key.shape)} and value {tuple(value.shape)}"
            )
        if key.shape != value.shape:
            raise CacheInputError(f"key {tuple(key.shape)} vs value {tuple(value.shape)}")
        b, h, t, d = key.shape
        if (b, h, d) != (s.batch, s.kv_heads, s.head_dim):
            raise CacheInputError(
                f"(B, H, D): expected {(s.batch, s.kv_heads, s.head_dim)}, got {(b, h, d)}"
            )
        if t == 0:
            raise CacheInputError("T = 0: nothing to append")
        if self._used + t > s.max_length:
            raise CacheInputError(f"no room: {self._used} + {t} > {s.max_length}")
        return t
