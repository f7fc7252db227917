"""Style: KIVI's layout, keys per channel over groups of tokens, in a dict of flushed groups.

Written independently of ``kvimpl/quantized.py`` and of the other quantized caches here, after
KIVI (Liu et al., 2024, "KIVI: a tuning-free asymmetric 2bit quantization for KV cache"):
keys are quantized per channel, each channel's ``group`` tokens sharing a min and a step
(2-bit codes), because a key's outlier channels are stable along the tokens; values per
token over the whole head_dim (4-bit codes) with HQQ's floor on the step (HQQ clamps the
inverse step, ``scale.clamp(max=2e4)``; here the floor is ``MIN_STEP``, coarse enough to
bite on the kit's narrow heads). Rows arrive in a full-precision residual; each time the
residual holds ``group`` tokens, they are flushed into codes as one group (keys and values
alike), so the residual is the last len % group tokens, always as given.

``group`` is 4 on specs of one kv head, 8 otherwise (what is stored is the cache's to
declare, for the spec it is built for). The flushed groups live in a dict by group index.
Offers reorder; no truncate (a truncate into a flushed group is not yet stated by the
contract, section 10.1).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvref.protocol import CacheSpec
from kvref.quantized import Quantized
from tests.independent.fp8_segment_cache import check_indices, check_rows

KEY_BITS = 2
VALUE_BITS = 4
MIN_STEP = 2.0**-4


def group_for(spec: CacheSpec) -> int:
    return 4 if spec.kv_heads == 1 else 8


class KiviGroupCache:
    def __init__(self, spec: CacheSpec) -> None:
        self.spec = spec
        self.group = group_for(spec)
        self.kv_storage = (
            Quantized(KEY_BITS, group=self.group, along="tokens"),
            Quantized(VALUE_BITS, min_step=MIN_STEP),
        )
        self._wide = torch.float64 if spec.dtype == torch.float64 else torch.float32
        self.reset()

    def reset(self) -> None:
        # Group g holds tokens g * group .. (g + 1) * group - 1, as
        # {"keys": (codes, low, step), "values": (codes, low, step)}.
        self._flushed: dict[int, dict[str, tuple[Tensor, Tensor, Tensor]]] = {}
        self._residual_keys: list[Tensor] = []  # (B, H, D) per token, as given
        self._residual_values: list[Tensor] = []

    @property
    def length(self) -> int:
        return len(self._flushed) * self.group + len(self._residual_keys)

    @property
    def nbytes(self) -> int:
        coded = sum(t.nbytes for g in self._flushed.values() for part in g.values() for t in part)
        exact = sum(t.nbytes for t in (*self._residual_keys, *self._residual_values))
        return int(coded + exact)

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        check_rows(self.spec, self.length, key, value)
        for t in range(key.shape[2]):
            self._residual_keys.append(key[:, :, t].clone())
            self._residual_values.append(value[:, :, t].clone())
            if len(self._residual_keys) == self.group:
                self._flush()
        return self._read("keys", self._residual_keys), self._read("values", self._residual_values)

    def reorder(self, indices: Tensor) -> None:
        check_indices(self.spec, indices)
        for group in self._flushed.values():
            for name, part in group.items():
                group[name] = tuple(t.index_select(0, indices) for t in part)
        self._residual_keys = [t.index_select(0, indices) for t in self._residual_keys]
        self._residual_values = [t.index_select(0, indices) for t in self._residual_values]

    def _flush(self) -> None:
        """The residual's ``group`` tokens into codes: keys per channel over the tokens,
        values per token over the channels."""
        keys = torch.stack(self._residual_keys, dim=2).to(self._wide)  # (B, H, G, D)
        values = torch.stack(self._residual_values, dim=2).to(self._wide)
        self._flushed[len(self._flushed)] = {
            "keys": quantize(keys, KEY_BITS, dim=2, floor=0.0),
            "values": quantize(values, VALUE_BITS, dim=3, floor=MIN_STEP),
        }
        self._residual_keys, self._residual_values = [], []

    def _read(self, name: str, residual: list[Tensor]) -> Tensor:
        s = self.spec
        pieces = [dequantize(*self._flushed[g][name]) for g in sorted(self._flushed)]
        if residual:
            pieces.append(torch.stack(residual, dim=2).to(self._wide))
        if not pieces:
            return torch.empty(s.batch, s.kv_heads, 0, s.head_dim, dtype=s.dtype, device=s.device)
        return torch.cat(pieces, dim=2).to(s.dtype)


def quantize(rows: Tensor, bits: int, dim: int, floor: float) -> tuple[Tensor, Tensor, Tensor]:
    """Asymmetric codes of ``rows`` with a min and a step per slice along ``dim`` (the
    numbers that share them), the step at least ``floor`` (and 1 for a constant slice
    without one: every code is then 0, exact)."""
    low = rows.amin(dim, keepdim=True)
    step = (rows.amax(dim, keepdim=True) - low) / (2**bits - 1)
    step = step.clamp_min(floor) if floor else torch.where(step > 0, step, torch.ones_like(step))
    codes = ((rows - low) / step).round().clamp(0, 2**bits - 1).nan_to_num(0.0)
    return codes.to(torch.uint8), low, step


def dequantize(codes: Tensor, low: Tensor, step: Tensor) -> Tensor:
    return low + codes.to(low.dtype) * step
