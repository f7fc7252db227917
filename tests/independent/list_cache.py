"""Style 1: a plain list of per-append (key, value) copies, joined with ``torch.cat`` on return.

Deliberately different: nothing is preallocated (``nbytes`` is exactly the copies held); every
return is a freshly concatenated tensor; validation is a flat run of ``if`` checks with terse
messages; a non-tensor argument raises ValueError (not TypeError); T = 0 is accepted as a
no-op that returns what is held; there is no length limit (it keeps growing past max_length).
"""

from __future__ import annotations

import torch
from torch import Tensor


class ListCache:
    def __init__(self, spec) -> None:
        self.spec = spec
        self._device = torch.device(spec.device)
        self._parts: list[tuple[Tensor, Tensor]] = []
        self._count = 0

    @property
    def length(self) -> int:
        return self._count

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self._parts)

    def reset(self) -> None:
        self._parts = []
        self._count = 0

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        self._validate(key, value)
        if key.shape[2] > 0:
            self._parts.append((key.detach().clone(), value.detach().clone()))
            self._count += key.shape[2]
        return self._joined()

    def _joined(self) -> tuple[Tensor, Tensor]:
        if not self._parts:
            s = self.spec
            empty = torch.empty(
                s.batch, s.kv_heads, 0, s.head_dim, dtype=s.dtype, device=self._device
            )
            return empty, empty.clone()
        return (
            torch.cat([k for k, _ in self._parts], dim=2),
            torch.cat([v for _, v in self._parts], dim=2),
        )

    def _validate(self, key: object, value: object) -> None:
        s = self.spec
        if not isinstance(key, Tensor) or not isinstance(value, Tensor):
            raise ValueError(
                "key and value must be tensors, got "
                f"{type(key).__name__} and {type(value).__name__}"
            )
        if key.dim() != 4 or value.dim() != 4:
            raise ValueError(f"key and value must be 4-D, got {key.dim()}-D and {value.dim()}-D")
        if key.shape != value.shape:
            raise ValueError(f"key shape {tuple(key.shape)} != value shape {tuple(value.shape)}")
        b, h, _, d = key.shape
        if b != s.batch:
            raise ValueError(f"batch {b} != {s.batch}")
        if h != s.kv_heads:
            raise ValueError(f"kv_heads {h} != {s.kv_heads}")
        if d != s.head_dim:
            raise ValueError(f"head_dim {d} != {s.head_dim}")
        if key.dtype != s.dtype or value.dtype != s.dtype:
            raise ValueError(f"dtype {key.dtype}/{value.dtype} != {s.dtype}")
        for t in (key, value):
            if t.device.type != self._device.type or (
                self._device.index is not None and t.device.index != self._device.index
            ):
                raise ValueError(f"device {t.device} != {self._device}")
