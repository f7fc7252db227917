"""Token-major storage (L, B, H, D) in ONE buffer for K and V, grown by doubling.
append returns non-contiguous permuted views aliasing the internal buffer.
Terse errors via a ValueError subclass. T = 0 is a no-op returning the rows held."""

import torch
from torch import Tensor


class CacheInputError(ValueError):
    pass


class ViewCache:
    def __init__(self, spec):
        self._s = spec
        self._n = 0
        self._buf = self._alloc(4)

    def _alloc(self, rows):
        s = self._s
        return torch.zeros(2, rows, s.batch, s.kv_heads, s.head_dim, dtype=s.dtype, device=s.device)

    @property
    def length(self):
        return self._n

    @property
    def nbytes(self):
        return self._buf.nbytes

    def reset(self):
        self._n = 0

    def _view(self):
        kv = self._buf[:, : self._n].permute(0, 2, 3, 1, 4)  # (2, B, H, L, D), non-contiguous
        return kv[0], kv[1]

    def append(self, key, value):
        s = self._s
        for t in (key, value):
            if not isinstance(t, Tensor):
                raise TypeError(type(t).__name__)
        if key.ndim != 4 or value.ndim != 4:
            raise CacheInputError(f"expected 4 axes, got {key.ndim} and {value.ndim}")
        if key.shape[2] != value.shape[2]:
            raise CacheInputError(f"k/v T: {key.shape[2]} vs {value.shape[2]}")
        for t in (key, value):
            b, h, _, d = t.shape
            if b != s.batch:
                raise CacheInputError(f"B={b}!={s.batch}")
            if h != s.kv_heads:
                raise CacheInputError(f"H={h}!={s.kv_heads}")
            if d != s.head_dim:
                raise CacheInputError(f"D={d}!={s.head_dim}")
            if t.dtype != s.dtype:
                raise CacheInputError(f"{t.dtype}!={s.dtype}")
            if t.device.type != torch.device(s.device).type:
                raise CacheInputError(f"{t.device}!={s.device}")
        T = key.shape[2]
        if T == 0:
            return self._view()
        need = self._n + T
        if need > self._buf.shape[1]:
            rows = self._buf.shape[1]
            while rows < need:
                rows *= 2
            bigger = self._alloc(rows)
            bigger[:, : self._n] = self._buf[:, : self._n]
            self._buf = bigger
        self._buf[0, self._n : need] = key.permute(2, 0, 1, 3)
        self._buf[1, self._n : need] = value.permute(2, 0, 1, 3)
        self._n = need
        return self._view()
