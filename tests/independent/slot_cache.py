"""Style 4: a buffer of exactly max_length rows per tensor, written with ``index_copy_``.

Deliberately different: storage is reserved once, at exactly ``spec.max_length`` rows, written
through ``index_copy_`` with an explicit row index and read back through ``narrow``; reset only
rewinds the counter (stale rows are never reachable: only rows [0, length) are returned);
validation messages are short "what: got vs want" notes ("batch mismatch: 3 vs 2",
"dtype float16 not accepted (cache is float32)"); a non-tensor raises ValueError; T = 0 is
refused; overflow is refused with "capacity 12 exceeded".
"""

from __future__ import annotations

import torch
from torch import Tensor


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class SlotCache:
    def __init__(self, spec) -> None:
        s = spec
        self.spec = s
        self.device = torch.device(s.device)
        shape = (s.batch, s.kv_heads, s.max_length, s.head_dim)
        self.k = torch.zeros(shape, dtype=s.dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=s.dtype, device=self.device)
        self.n = 0

    @property
    def length(self) -> int:
        return self.n

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def reset(self) -> None:
        self.n = 0

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        t = self._vet(key, value)
        rows = torch.arange(self.n, self.n + t, device=self.device)
        self.k.index_copy_(2, rows, key)
        self.v.index_copy_(2, rows, value)
        self.n += t
        return self.k.narrow(2, 0, self.n), self.v.narrow(2, 0, self.n)

    def _vet(self, key: object, value: object) -> int:
        s = self.spec
        if not isinstance(key, Tensor):
            raise ValueError(f"not a tensor: key is {type(key).__name__}")
        if not isinstance(value, Tensor):
            raise ValueError(f"not a tensor: value is {type(value).__name__}")
        if key.ndim != 4:
            raise ValueError(f"rank: key is {key.ndim}-D, want 4-D")
        if value.ndim != 4:
            raise ValueError(f"rank: value is {value.ndim}-D, want 4-D")
        if key.shape != value.shape:
            raise ValueError(f"key/value disagree: {list(key.shape)} vs {list(value.shape)}")
        b, h, t, d = key.shape
        if b != s.batch:
            raise ValueError(f"batch mismatch: {b} vs {s.batch}")
        if h != s.kv_heads:
            raise ValueError(f"kv_heads mismatch: {h} vs {s.kv_heads}")
        if d != s.head_dim:
            raise ValueError(f"head_dim: got {d}, want {s.head_dim}")
        for x in (key, value):
            if x.dtype != s.dtype:
                raise ValueError(
                    f"dtype {_short(x.dtype)} not accepted (cache is {_short(s.dtype)})"
                )
            if x.device.type != self.device.type or self.device.index not in (None, x.device.index):
                raise ValueError(f"device {x.device} not accepted (cache is on {self.device})")
        if t == 0:
            raise ValueError("empty append: T is 0")
        if self.n + t > s.max_length:
            raise ValueError(f"capacity {s.max_length} exceeded: {self.n} held, {t} more")
        return t
