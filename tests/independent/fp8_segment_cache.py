"""Style: float8 codes kept as one segment per append, each a dict of tensors, decoded on read.

Written independently of ``kvimpl/quantized.py`` (integer codes in preallocated buffers) and
of ``group_int4_cache.py`` (per-token chunks): every append becomes one segment, its rows held
as float8 codes (``torch.float8_e4m3fn`` or ``torch.float8_e5m2``) and their scales, nothing
kept as given. What it stores depends on the spec it is built for (contract, section 10.1:
the declaration is the cache's), so that one factory covers the float code layouts the kit
knows:

- an even head_dim: e4m3fn, an odd one: e5m2;
- one batch row: a scale per token (absmax of the head_dim / the format's max); more: a
  scale per block of ``BLOCK`` channels; on float64 specs, one fixed per-tensor scale
  instead (as a calibrated k_scale or v_scale) that puts the format's max at
  ``FIXED_RANGE``, numbers beyond it clamped to it (saturation).

Codes are ``(x / scale).clamp(-max, max)`` cast to the format, decoded as ``code * scale`` in
float32 (float64 on float64 specs). Offers truncate (segments cut or dropped) and reorder.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvref.protocol import CacheSpec
from kvref.quantized import Quantized

BLOCK = 8
# A fixed scale puts the format's max at this magnitude: the kit's normal rows pass it now and
# then, so saturation (the clamp) is exercised, as an outlier beyond a calibrated k_scale is.
FIXED_RANGE = 3.5


def float_codes_for(spec: CacheSpec) -> torch.dtype:
    return torch.float8_e4m3fn if spec.head_dim % 2 == 0 else torch.float8_e5m2


def storage_for(spec: CacheSpec) -> Quantized:
    codes = float_codes_for(spec)
    if spec.dtype == torch.float64:
        scale = FIXED_RANGE / torch.finfo(codes).max  # 2**-7 for e4m3fn, 2**-14 for e5m2
        return Quantized(8, codes=codes, symmetric=True, scale=scale)
    group = None if spec.batch == 1 else BLOCK
    return Quantized(8, group=group, codes=codes, symmetric=True)


def check_indices(spec: CacheSpec, indices: Tensor) -> None:
    """reorder's argument checked: an int64 tensor of shape (batch,) on the spec's device,
    each index a row of the batch (kivi_group_cache's too: rows and indices, no codes)."""
    batch = spec.batch
    if not isinstance(indices, Tensor):
        raise TypeError(f"reorder indices must be a tensor, not {type(indices).__name__}")
    if indices.dtype != torch.int64 or indices.shape != (batch,):
        raise ValueError(
            f"reorder indices must be int64 of shape ({batch},), got {indices.dtype} "
            f"{tuple(indices.shape)}"
        )
    if indices.device != torch.device(spec.device):
        raise ValueError(f"reorder indices are on {indices.device}, not {spec.device}")
    if bool(((indices < 0) | (indices >= batch)).any()):
        raise ValueError(f"reorder indices {indices.tolist()} out of range for batch {batch}")


def check_rows(spec: CacheSpec, held: int, key: Tensor, value: Tensor) -> None:
    """append's rows checked against the spec and the ``held`` tokens' room, before any is
    stored (kivi_group_cache's too)."""
    for what, rows in (("key", key), ("value", value)):
        if not isinstance(rows, Tensor):
            raise TypeError(f"{what} should be a torch.Tensor, got {type(rows).__name__}")
        if rows.dtype != spec.dtype or rows.device != torch.device(spec.device):
            raise ValueError(
                f"{what} is {rows.dtype} on {rows.device}; this cache holds {spec.dtype} on "
                f"{spec.device}"
            )
        wanted = (spec.batch, spec.kv_heads, spec.head_dim)
        if rows.ndim != 4 or (rows.shape[0], rows.shape[1], rows.shape[3]) != wanted:
            raise ValueError(
                f"{what} has shape {tuple(rows.shape)}; expected (batch, kv_heads, tokens, "
                f"head_dim) with (batch, kv_heads, head_dim) = {wanted}"
            )
    if key.shape != value.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} differ")
    if key.shape[2] == 0:
        raise ValueError("nothing to append: key and value hold 0 tokens")
    if held + key.shape[2] > spec.max_length:
        raise ValueError(
            f"overflow: {held} held + {key.shape[2]} new > max_length {spec.max_length}"
        )


class Fp8SegmentCache:
    def __init__(self, spec: CacheSpec) -> None:
        self.spec = spec
        self.kv_storage = storage_for(spec)
        self._codes = float_codes_for(spec)
        self._top = torch.finfo(self._codes).max
        self._wide = torch.float64 if spec.dtype == torch.float64 else torch.float32
        self.reset()

    def reset(self) -> None:
        # Oldest first; each {"key": codes, "key_scale": scales, "value": ..., "value_scale": ...}
        self._segments: list[dict[str, Tensor]] = []

    @property
    def length(self) -> int:
        return sum(segment["key"].shape[2] for segment in self._segments)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for segment in self._segments for t in segment.values())

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        check_rows(self.spec, self.length, key, value)
        segment = {}
        for name, rows in (("key", key), ("value", value)):
            segment[name], segment[f"{name}_scale"] = self._encode(rows)
        self._segments.append(segment)
        return self._read("key"), self._read("value")

    def truncate(self, length: int) -> None:
        if isinstance(length, bool) or not isinstance(length, int):
            raise TypeError(f"truncate wants an int length, not {type(length).__name__}")
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate to length {length}: it holds {self.length} tokens")
        kept, room = [], length
        for segment in self._segments:
            if room == 0:
                break
            take = min(room, segment["key"].shape[2])
            kept.append({name: t[:, :, :take] for name, t in segment.items()})
            room -= take
        self._segments = kept

    def reorder(self, indices: Tensor) -> None:
        check_indices(self.spec, indices)
        self._segments = [
            {name: t.index_select(0, indices) for name, t in segment.items()}
            for segment in self._segments
        ]

    def _block(self) -> int:
        """Channels per scale: BLOCK, the last block the channels left; per token, all."""
        return self.kv_storage.group_size(self.spec.head_dim)

    def _encode(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        """(B, H, n, D) rows as float8 codes (B, H, n, D) and their scales (B, H, n, blocks)."""
        wide = rows.to(self._wide)
        if self.kv_storage.scale is not None:
            scale = torch.full(
                (*wide.shape[:3], 1), self.kv_storage.scale, dtype=self._wide, device=wide.device
            )
        else:
            scale = (
                torch.stack([c.abs().amax(-1) for c in wide.split(self._block(), dim=-1)], dim=-1)
                / self._top
            )
            # An all-zero block: any scale codes it exactly; an inf or nan one bounds nothing.
            scale = torch.where((scale > 0) & scale.isfinite(), scale, torch.ones_like(scale))
        spread = self._spread(scale)
        codes = (wide / spread).clamp(-self._top, self._top).to(self._codes)
        return codes, scale

    def _spread(self, scale: Tensor) -> Tensor:
        """Per-block scales (..., blocks) as one per channel (..., D)."""
        if scale.shape[-1] == 1:  # one scale for the row (per token, or the fixed one)
            return scale.expand(*scale.shape[:-1], self.spec.head_dim)
        sizes = [len(c) for c in torch.arange(self.spec.head_dim).split(self._block())]
        return scale.repeat_interleave(torch.tensor(sizes, device=scale.device), dim=-1)

    def _read(self, name: str) -> Tensor:
        pieces = [
            (segment[name].to(self._wide) * self._spread(segment[f"{name}_scale"]))
            for segment in self._segments
        ]
        return torch.cat(pieces, dim=2).to(self.spec.dtype)
