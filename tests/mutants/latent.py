"""Broken latent (MLA) caches and a broken MLA model (docs/contract.md, section 10.2): the
caches are the built-in ``LatentCache`` with one bug in where a row's two parts go, the
model a patch of ``kvref.latent`` run on it. The first paragraph of each docstring names the
bug and the second the real failure it stands for."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import torch
from torch import Tensor

from kvimpl.latent import LatentCache
from kvimpl.streaming import grouped_softmax_attention
from kvref import latent
from kvref.checks import check_append
from kvref.protocol import CacheSpec


class RopeKeyOneSlotBack(LatentCache):
    """The rope keys sit in a buffer of their own, and a decode step writes its rope key one
    slot back: the newest token's latent comes back beside the previous token's rope key,
    and the previous token's rope key is lost.

    Stands for latent rows returned with the rope part of another position (mlx-lm 1189,
    sglang 30433): the latent and the rope key kept apart, their slots computed apart, one
    of them from the length before the other's update.
    """

    def __init__(self, spec: CacheSpec) -> None:
        super().__init__(spec)
        shape = (spec.batch, spec.kv_heads, spec.max_length, spec.head_dim)
        self.rope = torch.zeros(shape, dtype=spec.dtype, device=spec.device)

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes + self.rope.nbytes

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        start = self._length
        end = start + check_append(self.spec, start, key, value, capacity=self.spec.max_length)
        latent = self.spec.value_width
        self.rows[:, :, start:end, :latent] = value
        slot = start - 1 if end - start == 1 and start else start  # decode: one slot back
        self.rope[:, :, slot : slot + end - start] = key
        self._length = end
        return self._held()

    def _held(self) -> tuple[Tensor, Tensor]:
        return self.rope[:, :, : self._length], self.rows[
            :, :, : self._length, : self.spec.value_width
        ]

    def reorder(self, indices: Tensor) -> None:
        super().reorder(indices)
        held = slice(0, self._length)
        self.rope[:, :, held] = self.rope[:, :, held].index_select(0, indices)

    def fork(self) -> RopeKeyOneSlotBack:
        child = RopeKeyOneSlotBack(self.spec)
        child.rows.copy_(self.rows)
        child.rope.copy_(self.rope)
        child._length = self._length
        return child


class LatentCutToHeadDim(LatentCache):
    """The buffer is shaped by head_dim for both parts: a latent is cut to the rope key's
    width (or padded with zeros up to it), and comes back that wide.

    Stands for a cache shaped by head_dim for keys and values alike (mlx-lm 1323): an MLA
    model's latent, wider than its rope key, stored in a tensor built for per-head keys.
    """

    def __init__(self, spec: CacheSpec) -> None:
        super().__init__(spec)
        shape = (spec.batch, spec.kv_heads, spec.max_length, 2 * spec.head_dim)
        self.rows = torch.zeros(shape, dtype=spec.dtype, device=spec.device)

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        start = self._length
        end = start + check_append(self.spec, start, key, value, capacity=self.spec.max_length)
        width = self.spec.head_dim
        kept = value[..., :width]
        self.rows[:, :, start:end, :width] = torch.nn.functional.pad(
            kept, (0, width - kept.shape[-1])
        )
        self.rows[:, :, start:end, width:] = key
        self._length = end
        return self._held()

    def _held(self) -> tuple[Tensor, Tensor]:
        held, width = self.rows[:, :, : self._length], self.spec.head_dim
        return held[..., width:], held[..., :width]

    def fork(self) -> LatentCutToHeadDim:
        child = LatentCutToHeadDim(self.spec)
        child.rows.copy_(self.rows)
        child._length = self._length
        return child


@contextmanager
def absorbed_without_rope_key() -> Iterator[None]:
    """The absorbed path scores each head's folded query against the latents alone: the rope
    query and the rope keys take no part.

    Stands for an absorbed decode path that drops the decoupled rope key (sglang 30433's
    class): the naive path, which prefill and the uncached model take, is right, so only
    cached calls on the absorbed path are wrong.
    """

    def without_rope(attend, query, rope_keys, latents, up_key, up_value, *args, **kwargs):
        nope = up_key.shape[1]
        folded = torch.einsum("bhtn,hnc->bhtc", query[..., :nope], up_key)
        kwargs.pop("sink_query", None)
        scale = 1 / query.shape[-1] ** 0.5
        mixed = attend(folded, latents, latents, *args, scale=scale, **kwargs)
        return torch.einsum("bhtc,hdc->bhtd", mixed, up_value)

    with mock.patch.object(latent, "absorbed_attention", without_rope):
        yield


class LatentAttendWithoutRope(LatentCache):
    """``attend_latent`` scores each head's folded query against the latents alone: the
    rope channels of the query and the rope keys take no part.

    Stands for an absorbed decode kernel handed the latent part of each ``kv_c_and_k_pe``
    row (d_c where d_c + d_r was meant), the decoupled rope key dropped (sglang 30433's
    absorbed single-token path, right in extend mode over the same rows): ``append``'s rows
    are right, so only the cache's own attention shows it.
    """

    def attend_latent(self, query: Tensor, key: Tensor, value: Tensor, scale: float) -> Tensor:
        start = self._length
        self.append(key, value)
        latent = self.spec.value_width
        latents = self.rows[:, :, : self._length, :latent]
        return grouped_softmax_attention(
            query[..., :latent], latents, latents, self._visible(start), scale
        )


class LatentAttendScaledByLatentWidth(LatentCache):
    """``attend_latent`` scales its scores by 1/sqrt(d_c), the latent width it holds, not by
    the scale given (1/sqrt of the query heads' nope + rope width).

    Stands for MLA backends that derive ``softmax_scale`` from the tensors they see
    (kv_lora_rank 512, or 576 with the rope key) instead of the model's qk_head_dim (192)
    and its YaRN factor: every score is off by one factor, a softmax too flat or too sharp.
    """

    def attend_latent(self, query: Tensor, key: Tensor, value: Tensor, scale: float) -> Tensor:
        return super().attend_latent(query, key, value, 1 / self.spec.value_width**0.5)


class LatentAttendsOneRowTooMany(LatentCache):
    """``attend_latent`` reads one row past the last one written, and each query sees the
    row after its own: a prompt's tokens see their successors, a decode step the buffer's
    next (zeroed, or truncated-away) slot.

    Stands for a paged MLA kernel handed ``seq_lens`` one too long, the length counted with
    a slot not yet written (the off-by-one ``+1`` class, LLamaSharp 714's ``seq_rm`` and
    ``seq_add``): the rows ``append`` returns are right, so only the cache's own attention
    shows it.
    """

    def attend_latent(self, query: Tensor, key: Tensor, value: Tensor, scale: float) -> Tensor:
        start = self._length
        self.append(key, value)
        end = min(self._length + 1, self.spec.max_length)
        rows = self.rows[:, :, :end]
        keys = torch.arange(end, device=rows.device)[None, :]
        queries = torch.arange(start, self._length, device=rows.device)[:, None]
        visible = keys <= queries + 1
        if self.spec.window is not None:
            visible &= keys > queries - self.spec.window
        latents = rows[..., : self.spec.value_width]
        return grouped_softmax_attention(query, rows, latents, visible, scale)


LATENT_MUTANTS = (
    RopeKeyOneSlotBack,
    LatentCutToHeadDim,
    LatentAttendWithoutRope,
    LatentAttendScaledByLatentWidth,
    LatentAttendsOneRowTooMany,
)
LATENT_MODEL_MUTANTS = (absorbed_without_rope_key,)
