"""Style 10: a cache shaped for a fused half-precision attention kernel.

Deliberately different: it is built only for what a FlashAttention-like kernel takes
(float16 or bfloat16, head width 64 or 128) and refuses every other spec in its constructor,
declaring that domain as a plain dict (``kv_sizes``) so that the kit draws nothing outside
it. Storage is reserved once, ``max_length`` rows, token-major as a paged kernel lays it
out: (batch, max_length, kv_heads, head_dim), one tensor for keys and one for values.
``append`` writes the new rows through a transposed view and hands back transposed views
of the held rows in the protocol's (batch, kv_heads, rows, head_dim) layout. Windows are
ignored (every row is kept; the model masks). Input is vetted by a small table of checks
raising ``KernelInputError`` (a ``ValueError``) worded as "<call>: <what> — <got>, kernel
expects <want>"; T = 0 is refused; a non-tensor raises ``TypeError``.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

_KERNEL_DTYPES = (torch.float16, torch.bfloat16)
_KERNEL_HEAD_DIMS = (64, 128)


class KernelInputError(ValueError):
    """An argument the kernel-backed cache cannot take; nothing was changed."""


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _device_fits(got: torch.device, home: torch.device) -> bool:
    # A cache on "cuda" takes "cuda:N"; a cache on "cuda:1" takes only "cuda:1".
    return got.type == home.type and (home.index is None or home.index == got.index)


class HalfKernelCache:
    kv_sizes: ClassVar[dict[str, dict]] = {
        "supports": {"dtypes": ("float16", "bfloat16"), "head_dims": (64, 128)}
    }

    def __init__(self, spec) -> None:
        if spec.dtype not in _KERNEL_DTYPES:
            raise ValueError(
                f"HalfKernelCache supports dtypes float16 and bfloat16 only "
                f"(a fused half-precision kernel); spec asks for {_name(spec.dtype)}"
            )
        if isinstance(spec.head_dim, bool) or spec.head_dim not in _KERNEL_HEAD_DIMS:
            raise ValueError(
                f"HalfKernelCache supports head_dim 64 or 128 only (the kernel's head "
                f"widths); spec asks for head_dim {spec.head_dim}"
            )
        self.spec = spec
        self._home = torch.device(spec.device)
        rows = (spec.batch, spec.max_length, spec.kv_heads, spec.head_dim)  # token-major
        self._k = torch.zeros(rows, dtype=spec.dtype, device=self._home)
        self._v = torch.zeros(rows, dtype=spec.dtype, device=self._home)
        self._used = 0

    # -- protocol ----------------------------------------------------------------------

    @property
    def length(self) -> int:
        return self._used

    @property
    def nbytes(self) -> int:
        return int(self._k.nbytes + self._v.nbytes)

    def reset(self) -> None:
        self._used = 0  # rows at and past 0 are never shown again until rewritten

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        fresh = self._vet_rows(key, value)
        lo, hi = self._used, self._used + fresh
        # (B, H, T, D) -> (B, T, H, D): copied into the reserved rows, never kept.
        self._k[:, lo:hi].copy_(key.transpose(1, 2))
        self._v[:, lo:hi].copy_(value.transpose(1, 2))
        self._used = hi
        return self._shown()

    # -- optional capabilities ---------------------------------------------------------

    def truncate(self, length: int) -> None:
        if isinstance(length, bool) or not isinstance(length, int):
            raise KernelInputError(
                f"truncate: length — got {type(length).__name__} {length!r}, "
                f"kernel expects an int token count"
            )
        if length < 0 or length > self._used:
            raise KernelInputError(
                f"truncate: length — got {length}, kernel expects 0..{self._used} (the tokens held)"
            )
        self._used = length  # every row is kept, so any held position can be returned to

    def reorder(self, indices: Tensor) -> None:
        s = self.spec
        if not isinstance(indices, Tensor):
            raise TypeError(
                f"reorder: indices — got {type(indices).__name__}, kernel expects a tensor"
            )
        if indices.dtype != torch.int64:
            raise KernelInputError(
                f"reorder: indices dtype — got {_name(indices.dtype)}, kernel expects int64"
            )
        if tuple(indices.shape) != (s.batch,):
            raise KernelInputError(
                f"reorder: indices shape — got {tuple(indices.shape)}, kernel expects "
                f"({s.batch},) (one source row per batch row)"
            )
        if not _device_fits(indices.device, self._home):
            raise KernelInputError(
                f"reorder: indices device — got {indices.device}, kernel expects {self._home}"
            )
        lowest, highest = int(indices.min()), int(indices.max())
        if lowest < 0 or highest >= s.batch:
            raise KernelInputError(
                f"reorder: indices values — got {lowest}..{highest}, kernel expects "
                f"0..{s.batch - 1} (batch rows)"
            )
        held = self._used
        for store in (self._k, self._v):
            picked = store[:, :held].index_select(0, indices)  # a copy: repeats are safe
            store[:, :held] = picked

    # -- internals ---------------------------------------------------------------------

    def _shown(self) -> tuple[Tensor, Tensor]:
        n = self._used
        return self._k[:, :n].transpose(1, 2), self._v[:, :n].transpose(1, 2)

    def _vet_rows(self, key: object, value: object) -> int:
        s = self.spec
        for label, x in (("key", key), ("value", value)):
            if not isinstance(x, Tensor):
                raise TypeError(
                    f"append: {label} type — got {type(x).__name__}, kernel expects a tensor"
                )
        for label, x in (("key", key), ("value", value)):
            if x.dim() != 4:
                raise KernelInputError(
                    f"append: {label} rank — got {x.dim()}-D {tuple(x.shape)}, kernel "
                    f"expects 4-D (batch, kv_heads, T, head_dim)"
                )
        for label, x in (("key", key), ("value", value)):
            b, h, _, d = x.shape
            for axis, got, want in (
                ("batch", b, s.batch),
                ("kv_heads", h, s.kv_heads),
                ("head_dim", d, s.head_dim),
            ):
                if got != want:
                    raise KernelInputError(
                        f"append: {label} {axis} — got {got}, kernel expects {want} "
                        f"(shape {tuple(x.shape)})"
                    )
        fresh, other = key.shape[2], value.shape[2]
        if fresh != other:
            raise KernelInputError(
                f"append: key/value token counts differ — key has T={fresh}, value T={other}"
            )
        if fresh == 0:
            raise KernelInputError("append: zero tokens — kernel expects at least one (T >= 1)")
        for label, x in (("key", key), ("value", value)):
            if x.dtype != s.dtype:
                raise KernelInputError(
                    f"append: {label} dtype — got {_name(x.dtype)}, kernel expects "
                    f"{_name(s.dtype)} (no casting)"
                )
            if not _device_fits(x.device, self._home):
                raise KernelInputError(
                    f"append: {label} device — got {x.device}, kernel expects {self._home}"
                )
        if self._used + fresh > s.max_length:
            raise KernelInputError(
                f"append: overflow — {self._used} held + {fresh} new exceeds max_length "
                f"{s.max_length}"
            )
        return fresh
