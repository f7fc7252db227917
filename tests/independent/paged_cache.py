"""Style 3: fixed pages of 8 rows kept in a dict {page_index: (key_page, value_page)}.

Deliberately different: storage is allocated a page at a time, on demand, and never moved;
the return value is a gather (``torch.cat`` over the pages in index order, trimmed to length);
validation goes through one helper comparing a whole expected shape, worded as
"key has shape (3, 2, 1, 4), expected (2, 2, T, 4)"; non-tensors raise TypeError; T = 0 is a
no-op; there is no length limit: it keeps adding pages past max_length and never refuses.
"""

from __future__ import annotations

import torch
from torch import Tensor

PAGE = 8


def _fmt(shape: tuple) -> str:
    return "(" + ", ".join("T" if n is None else str(n) for n in shape) + ")"


def _require_shape(name: str, tensor: Tensor, expected: tuple) -> None:
    """Raise unless ``tensor`` has ``expected`` shape; None in ``expected`` matches any size."""
    got = tuple(tensor.shape)
    if len(got) != len(expected) or any(
        e is not None and g != e for g, e in zip(got, expected, strict=False)
    ):
        raise ValueError(f"{name} has shape {_fmt(got)}, expected {_fmt(expected)}")


class PagedCache:
    def __init__(self, spec) -> None:
        self.spec = spec
        self.device = torch.device(spec.device)
        self.pages: dict[int, tuple[Tensor, Tensor]] = {}
        self.count = 0

    @property
    def length(self) -> int:
        return self.count

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.pages.values())

    def reset(self) -> None:
        self.pages = {}
        self.count = 0

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        self._validate(key, value)
        t = key.shape[2]
        written = 0
        while written < t:
            pos = self.count + written
            index, offset = divmod(pos, PAGE)
            if index not in self.pages:
                self.pages[index] = (self._page(), self._page())
            k_page, v_page = self.pages[index]
            n = min(PAGE - offset, t - written)
            k_page[:, :, offset : offset + n] = key[:, :, written : written + n]
            v_page[:, :, offset : offset + n] = value[:, :, written : written + n]
            written += n
        self.count += t
        return self._gather()

    def _page(self) -> Tensor:
        s = self.spec
        return torch.zeros(s.batch, s.kv_heads, PAGE, s.head_dim, dtype=s.dtype, device=self.device)

    def _gather(self) -> tuple[Tensor, Tensor]:
        order = sorted(self.pages)
        if not order:
            s = self.spec
            empty = torch.empty(
                s.batch, s.kv_heads, 0, s.head_dim, dtype=s.dtype, device=self.device
            )
            return empty, empty.clone()
        keys = torch.cat([self.pages[i][0] for i in order], dim=2)[:, :, : self.count]
        values = torch.cat([self.pages[i][1] for i in order], dim=2)[:, :, : self.count]
        return keys, values

    def _validate(self, key: object, value: object) -> None:
        s = self.spec
        for name, x in (("key", key), ("value", value)):
            if not isinstance(x, Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, not {type(x).__name__}")
        _require_shape("key", key, (s.batch, s.kv_heads, None, s.head_dim))
        _require_shape("value", value, tuple(key.shape))
        for name, x in (("key", key), ("value", value)):
            if x.dtype != s.dtype:
                raise ValueError(f"{name} has dtype {x.dtype}, expected {s.dtype}")
            if x.device.type != self.device.type or self.device.index not in (None, x.device.index):
                raise ValueError(f"{name} is on {x.device}, expected {self.device}")
