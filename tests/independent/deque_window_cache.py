"""Style 7: a deque of per-token row copies, one entry per position, windowed lazily.

Deliberately different: every token is its own ``(key_row, value_row)`` pair of copies shaped
(batch, kv_heads, head_dim) in a ``collections.deque``; each return is a fresh ``torch.stack``
along a new length axis (dim 2). With ``spec.window = W`` the oldest tokens are dropped only
when the next append arrives, down to the last W - 1, so an append of T returns the last
min(length, W - 1 + T) rows. ``nbytes`` is exactly the rows held. Validation is a generator
of complaints (the first one is raised, before anything changes); non-tensors raise TypeError,
T = 0 is refused, and there is no length limit (it keeps growing past max_length). Offers
``truncate`` and ``reorder``; with a window, ``truncate`` refuses when a position the next
query needs was already dropped.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

import torch
from torch import Tensor


class DequeWindowCache:
    def __init__(self, spec) -> None:
        self.spec = spec
        self._device = torch.device(spec.device)
        self._rows: deque[tuple[Tensor, Tensor]] = deque()
        self._seen = 0  # tokens since reset; rows held are positions seen - len(rows) .. seen - 1

    @property
    def length(self) -> int:
        return self._seen

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self._rows)

    def reset(self) -> None:
        self._rows.clear()
        self._seen = 0

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        for name, t in (("key", key), ("value", value)):
            if not isinstance(t, Tensor):
                raise TypeError(f"{name} should be a torch tensor; received {type(t).__name__}")
        _raise_first(self._append_complaints(key, value))
        if self.spec.window is not None:
            while len(self._rows) > self.spec.window - 1:
                self._rows.popleft()
        pairs = zip(key.detach().unbind(2), value.detach().unbind(2), strict=True)
        self._rows.extend((k.clone(), v.clone()) for k, v in pairs)
        self._seen += key.shape[2]
        return (
            torch.stack([k for k, _ in self._rows], dim=2),
            torch.stack([v for _, v in self._rows], dim=2),
        )

    def truncate(self, length: int) -> None:
        if isinstance(length, bool) or not isinstance(length, int):
            raise ValueError(f"truncate wants an int position, not {type(length).__name__}")
        if not 0 <= length <= self._seen:
            raise ValueError(f"truncate position {length} is outside 0..{self._seen}")
        first_held = self._seen - len(self._rows)
        if self.spec.window is not None:
            first_needed = max(0, length - self.spec.window + 1)
            if first_needed < length and first_held > first_needed:
                raise ValueError(
                    f"cannot truncate to {length}: its window starts at position {first_needed} "
                    f"but the oldest row still held is position {first_held}"
                )
        keep = max(0, length - first_held)  # the held rows at positions < length
        while len(self._rows) > keep:
            self._rows.pop()
        self._seen = length

    def reorder(self, indices: Tensor) -> None:
        if not isinstance(indices, Tensor):
            raise ValueError(f"reorder wants a tensor of indices, not {type(indices).__name__}")
        _raise_first(self._reorder_complaints(indices))
        self._rows = deque((k[indices], v[indices]) for k, v in self._rows)

    def _on_my_device(self, t: Tensor) -> bool:
        want = self._device
        return t.device.type == want.type and want.index in (None, t.device.index)

    def _append_complaints(self, key: Tensor, value: Tensor) -> Iterator[str]:
        s = self.spec
        for name, t in (("key", key), ("value", value)):
            if t.ndim != 4:
                yield f"{name} has rank {t.ndim} (shape {tuple(t.shape)}), expected 4"
        if key.shape != value.shape:
            yield f"key/value shape mismatch: {tuple(key.shape)} vs {tuple(value.shape)}"
        b, h, n, d = key.shape
        if b != s.batch:
            yield f"batch size {b}, expected {s.batch}"
        if h != s.kv_heads:
            yield f"kv heads {h}, expected {s.kv_heads}"
        if d != s.head_dim:
            yield f"head_dim {d}, expected {s.head_dim}"
        if n == 0:
            yield f"zero tokens to append (shape {tuple(key.shape)})"
        for name, t in (("key", key), ("value", value)):
            if t.dtype != s.dtype:
                yield f"{name} dtype {t.dtype}, this cache stores {s.dtype}"
            if not self._on_my_device(t):
                yield f"{name} device {t.device}, this cache lives on {self._device}"

    def _reorder_complaints(self, indices: Tensor) -> Iterator[str]:
        batch = self.spec.batch
        if indices.dtype != torch.int64:
            yield f"reorder indices must be int64, not {indices.dtype}"
        if tuple(indices.shape) != (batch,):
            yield f"reorder indices shape {tuple(indices.shape)}, expected ({batch},)"
        if not self._on_my_device(indices):
            yield f"reorder indices on {indices.device}, this cache lives on {self._device}"
        if bool(((indices < 0) | (indices >= batch)).any()):
            yield f"reorder indices {indices.tolist()} fall outside [0, {batch})"


def _raise_first(complaints: Iterator[str]) -> None:
    """Raise ValueError with the first complaint; later checks run only if earlier ones pass."""
    first = next(complaints, None)
    if first is not None:
        raise ValueError(first)
