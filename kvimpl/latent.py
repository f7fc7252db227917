"""A latent (MLA) cache: each token's latent and rope key side by side in one row of one
buffer, as vLLM and FlashMLA lay out ``kv_c_and_k_pe`` (contract, section 10.2).

An MLA layer's spec has values (the compressed latent, ``value_dim`` wide) wider than its
keys (the rope key, ``head_dim`` wide). Keeping the two in one buffer row, latent first,
means one write per token and one copy per reorder; what ``append`` returns are two views
of that buffer, the rope keys and the latents, neither of them contiguous. The cache takes
any spec, of one head or many, of one width or two, and declares the latent layout so that
the kit draws MLA models for it. Its rows move (contract, section 11.2) from
``kvimpl.movable``: rope keys as the keys, latents as the values, as ``append`` returns them.

It computes attention itself too: ``attend_latent`` (MLA's absorbed path, contract section
10.2) is one matmul of the absorbed query (latent channels, then rope channels) over the
buffer rows as they lie, the latent part of the same rows the values; ``attend`` the same
for an ordinary layer's spec, over its keys and values.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from kvimpl.movable import MovableMixin
from kvimpl.streaming import grouped_softmax_attention
from kvref.checks import (
    check_append,
    check_attend,
    check_attend_latent,
    check_reorder,
    check_truncate,
)
from kvref.protocol import CacheSpec


class LatentCache(MovableMixin):
    kv_sizes: ClassVar[dict] = {"supports": {"latent": True}}

    def __init__(self, spec: CacheSpec) -> None:
        self.spec = spec
        # Per token: its latent (the values), then its rope key (the keys).
        width = spec.value_width + spec.head_dim
        self.rows = torch.zeros(
            spec.batch, spec.kv_heads, spec.max_length, width, dtype=spec.dtype, device=spec.device
        )
        self._length = 0

    @property
    def length(self) -> int:
        return self._length

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        start = self._length
        end = start + check_append(self.spec, start, key, value, capacity=self.spec.max_length)
        latent = self.spec.value_width
        self.rows[:, :, start:end, :latent] = value
        self.rows[:, :, start:end, latent:] = key
        self._length = end
        return self._held()

    def attend(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        start = self._length
        check_attend(self.spec, start, query, key, value, capacity=self.spec.max_length)
        keys, values = self.append(key, value)
        return grouped_softmax_attention(query, keys, values, self._visible(start))

    def attend_latent(self, query: Tensor, key: Tensor, value: Tensor, scale: float) -> Tensor:
        start = self._length
        check_attend_latent(
            self.spec, start, query, key, value, scale, capacity=self.spec.max_length
        )
        self.append(key, value)
        rows = self.rows[:, :, : self._length]  # [latent ; rope key], as the query is laid out
        latents = rows[..., : self.spec.value_width]
        return grouped_softmax_attention(query, rows, latents, self._visible(start), scale)

    def _visible(self, start: int) -> Tensor:
        """(T, length): whether the query at each position from ``start`` sees each row held
        (every row since the reset, at its index): causal, the window, and the sinks."""
        device = self.rows.device
        keys = torch.arange(self._length, device=device)[None, :]
        queries = torch.arange(start, self._length, device=device)[:, None]
        visible = keys <= queries
        if self.spec.window is not None:
            visible &= (keys > queries - self.spec.window) | (keys < self.spec.sinks)
        return visible

    def _held(self) -> tuple[Tensor, Tensor]:
        """The rope keys and the latents of every token held: views of the buffer."""
        held = self.rows[:, :, : self._length]
        latent = self.spec.value_width
        return held[..., latent:], held[..., :latent]

    def _rows_to_move(self) -> tuple[Tensor, Tensor]:
        return self._held()

    def _import_capacity(self) -> int:
        return self.spec.max_length

    def truncate(self, length: int) -> None:
        check_truncate(self._length, length)
        self._length = length  # rows past it are overwritten before they are returned again

    def reorder(self, indices: Tensor) -> None:
        check_reorder(self.spec, indices)
        held = slice(0, self._length)
        self.rows[:, :, held] = self.rows[:, :, held].index_select(0, indices)

    def fork(self) -> LatentCache:
        child = LatentCache(self.spec)
        child.rows[:, :, : self._length] = self.rows[:, :, : self._length]
        child._length = self._length
        return child

    def reset(self) -> None:
        self._length = 0
