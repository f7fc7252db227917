"""The simplest cache: grow by ``torch.cat`` along the length axis (copies everything held).
Its rows move to and from other layouts (``kvimpl.movable``)."""

from __future__ import annotations

import torch
from torch import Tensor

from kvimpl.movable import MovableMixin
from kvref.checks import check_append, check_reorder, check_truncate
from kvref.protocol import CacheSpec


class ConcatCache(MovableMixin):
    def __init__(self, spec: CacheSpec) -> None:
        self.spec = spec
        self.reset()

    @property
    def length(self) -> int:
        return self.key.shape[2]

    @property
    def nbytes(self) -> int:
        return self.key.nbytes + self.value.nbytes

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        check_append(self.spec, self.length, key, value)
        self.key = torch.cat((self.key, key), dim=2)
        self.value = torch.cat((self.value, value), dim=2)
        return self.key, self.value

    def truncate(self, length: int) -> None:
        check_truncate(self.length, length)
        # Copies, so that the dropped rows' storage is freed and nbytes stays what it holds.
        self.key = self.key[:, :, :length].clone()
        self.value = self.value[:, :, :length].clone()

    def reorder(self, indices: Tensor) -> None:
        check_reorder(self.spec, indices)
        self.key = self.key.index_select(0, indices)
        self.value = self.value.index_select(0, indices)

    def _rows_to_move(self) -> tuple[Tensor, Tensor]:
        return self.key, self.value

    def reset(self) -> None:
        s = self.spec

        def empty(width: int) -> Tensor:
            return torch.empty(s.batch, s.kv_heads, 0, width, dtype=s.dtype, device=s.device)

        self.key, self.value = empty(s.head_dim), empty(s.value_width)
