"""Style 9: a list of the tensors each call brought, and attention by torch's fused kernel.

Deliberately different from the built-ins: every accepted append or attend adds its own copy
of the keys and values to a list (merged into one piece once the list grows past 16, so
that a long decode does not join thousands), and nothing is ever written in place, so a fork
is a copy of the list: parent and child share the tensors until either changes (a truncate
or reorder makes new ones). ``attend`` calls
``torch.nn.functional.scaled_dot_product_attention``, in float32 for half precision and
rounded once (the contract's accumulation: torch's CPU kernel in bfloat16 rounds its scores
and lands up to 32 x the uncached model's error from float64), with grouped-query
heads left to ``enable_gqa`` and an explicit boolean mask by absolute position (causal, and the
window), over the keys of the window only. The window is not used to drop rows: ``append``
returns every row. ``spec`` is not exposed. Validation collects every problem first and
reports them in one message, each as "what: got ..., expected ..."; T = 0 in ``append`` is a
no-op that returns the rows held, and ``attend`` refuses it; there is no capacity limit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

MERGE_PAST = 16  # pieces kept apart before they are joined into one


class SdpaCache:
    def __init__(self, spec) -> None:
        self._spec = spec
        self._device = torch.device(spec.device)
        self._keys: list[Tensor] = []
        self._values: list[Tensor] = []
        self._tokens = 0

    @property
    def length(self) -> int:
        return self._tokens

    @property
    def nbytes(self) -> int:
        return sum(piece.nbytes for piece in (*self._keys, *self._values))

    def reset(self) -> None:
        self._keys, self._values, self._tokens = [], [], 0

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        if self._examine(key, value):
            self._add(key, value)
        return self._rows()

    def attend(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        if not self._examine(key, value, query):
            raise ValueError("attend: zero tokens: the key has T = 0, at least one is needed")
        self._add(key, value)
        keys, values = self._rows()
        end, new = self._tokens, key.shape[2]
        window = self._spec.window
        oldest = 0 if window is None else max(0, end - new - window + 1)  # the first key seen
        asking = torch.arange(end - new, end, device=self._device)[:, None]
        offered = torch.arange(oldest, end, device=self._device)[None, :]
        visible = offered <= asking
        if window is not None:
            visible &= offered > asking - window
        wide = torch.promote_types(query.dtype, torch.float32)
        return F.scaled_dot_product_attention(
            query.to(wide),
            keys[:, :, oldest:].to(wide),
            values[:, :, oldest:].to(wide),
            attn_mask=visible,
            enable_gqa=True,
        ).to(query.dtype)

    def truncate(self, length: int) -> None:
        if isinstance(length, bool) or not isinstance(length, int):
            raise ValueError(
                f"truncate: length: got {type(length).__name__} {length!r}, expected int"
            )
        if not 0 <= length <= self._tokens:
            raise ValueError(f"truncate: length: got {length}, expected 0..{self._tokens}")
        if length == self._tokens:
            return
        keys, values = self._rows()
        self._keys = [keys[:, :, :length].clone()] if length else []
        self._values = [values[:, :, :length].clone()] if length else []
        self._tokens = length

    def reorder(self, indices: Tensor) -> None:
        s = self._spec
        if not isinstance(indices, Tensor):
            raise ValueError(f"reorder: indices: got {type(indices).__name__}, expected a tensor")
        problems = []
        if indices.dtype != torch.int64:
            problems.append(f"dtype: got {indices.dtype}, expected torch.int64")
        if tuple(indices.shape) != (s.batch,):
            problems.append(f"shape: got {list(indices.shape)}, expected [{s.batch}] (batch)")
        if not _same_place(indices.device, self._device):
            problems.append(f"device: got {indices.device}, expected {self._device}")
        if not problems and not bool(((indices >= 0) & (indices < s.batch)).all()):
            problems.append(f"values: got {indices.tolist()}, expected rows in 0..{s.batch - 1}")
        if problems:
            raise ValueError("reorder: indices: " + "; ".join(problems))
        self._keys = [piece.index_select(0, indices) for piece in self._keys]
        self._values = [piece.index_select(0, indices) for piece in self._values]

    def fork(self) -> SdpaCache:
        twin = SdpaCache(self._spec)
        twin._keys, twin._values, twin._tokens = list(self._keys), list(self._values), self._tokens
        return twin

    def _add(self, key: Tensor, value: Tensor) -> None:
        self._keys.append(key.clone())
        self._values.append(value.clone())
        self._tokens += key.shape[2]
        if len(self._keys) > MERGE_PAST:
            self._keys = [torch.cat(self._keys, dim=2)]
            self._values = [torch.cat(self._values, dim=2)]

    def _rows(self) -> tuple[Tensor, Tensor]:
        if not self._keys:
            s = self._spec
            empty = torch.zeros(s.batch, s.kv_heads, 0, s.head_dim, dtype=s.dtype, device=s.device)
            return empty, empty.clone()
        return torch.cat(self._keys, dim=2), torch.cat(self._values, dim=2)

    def _examine(self, key: object, value: object, query: object = None) -> bool:
        """Raise ValueError (TypeError for a non-tensor) naming every problem with the call;
        return whether it brings any token."""
        s = self._spec
        named = {"key": key, "value": value} | ({} if query is None else {"query": query})
        strangers = [
            f"{name}: got {type(t).__name__}"
            for name, t in named.items()
            if not isinstance(t, Tensor)
        ]
        if strangers:
            raise TypeError("expected tensors; " + "; ".join(strangers))
        problems = []
        for name, t in named.items():
            if t.dim() != 4:
                problems.append(f"{name}: got {t.dim()} dims {list(t.shape)}, expected 4 dims")
            if t.dtype != s.dtype:
                problems.append(f"{name}: got dtype {t.dtype}, expected {s.dtype}")
            if not _same_place(t.device, self._device):
                problems.append(f"{name}: got device {t.device}, expected {self._device}")
        if not problems:
            wanted = {
                "batch": (0, s.batch),
                "kv_heads": (1, s.kv_heads),
                "head_dim": (3, s.head_dim),
            }
            for name, t in (("key", key), ("value", value)):
                for axis, (at, size) in wanted.items():
                    if t.shape[at] != size:
                        problems.append(f"{name}: {axis} got {t.shape[at]}, expected {size}")
            if value.shape[2] != key.shape[2]:
                problems.append(
                    f"value: got T = {value.shape[2]} tokens, the key's T is {key.shape[2]}"
                )
        if not problems and query is not None:
            b, heads, t, d = query.shape
            if (
                (b, t, d) != (key.shape[0], key.shape[2], key.shape[3])
                or heads % s.kv_heads
                or not heads
            ):
                problems.append(
                    f"query: got shape {list(query.shape)}, expected [{key.shape[0]}, a positive "
                    f"multiple of kv_heads {s.kv_heads}, {key.shape[2]}, {key.shape[3]}]"
                )
        if problems:
            raise ValueError("; ".join(problems))
        return key.shape[2] > 0


def _same_place(got: torch.device, wanted: torch.device) -> bool:
    return got.type == wanted.type and wanted.index in (None, got.index)
