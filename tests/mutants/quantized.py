"""Broken quantized caches (docs/contract.md, section 10.1): each the built-in
``QuantizedCache`` with one bug in how it codes, keeps or moves rows. The first paragraph of
each docstring names the bug and the second the real failure it stands for."""

from __future__ import annotations

import torch
from torch import Tensor

from kvimpl import quantized
from kvimpl.quantized import QuantizedCache, dequantize
from kvref.quantized import Quantized
from tests.independent import kivi_group_cache as kivi
from tests.independent.fp8_segment_cache import Fp8SegmentCache
from tests.independent.kivi_group_cache import KiviGroupCache


class ScaleIgnoredOnRead(QuantizedCache):
    """Rows are read back from their codes and zero points without their scales.

    Stands for scales never applied on read (and a scale left at 1.0): a dequantize path
    that adds the zero point to the raw codes, as in lmdeploy 4849's kv-int8 read.
    """

    def rows(self, part: int) -> Tensor:
        held = slice(0, self.quantized)
        codes, zeros = self.codes[part][:, :, held], self.zeros[part][:, :, held]
        old = (codes.to(zeros.dtype) + zeros).to(self.spec.dtype)
        return torch.cat((old, self.exact[part]), dim=2)


class ScalesOverPaddedWidth(QuantizedCache):
    """Each row's scale and zero point are computed over its head width padded with zeros
    to the next power of two, which stretches the range of a row whose numbers share a sign.

    Stands for a quantizer range stretched when head_dim is not a power of two (vllm 27232):
    a kernel's padded lanes took part in the min/max reduction.
    """

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        original = quantized.quantize

        def padded(rows: Tensor, wide: torch.dtype):
            width = rows.shape[-1]
            lanes = 1 << (width - 1).bit_length()
            wider = torch.nn.functional.pad(rows.to(wide), (0, lanes - width))
            codes, scale, zero = original(wider, wide)
            return codes[..., :width], scale, zero

        quantized.quantize = padded
        try:
            return super().append(key, value)
        finally:
            quantized.quantize = original


class RecentWindowOffByOne(QuantizedCache):
    """One row fewer than declared stays as given: the oldest of the declared recent rows is
    already in codes.

    Stands for a residual window's boundary off by one (transformers 39106): the
    full-precision residual held residual_length - 1 tokens, so the newest quantized token
    was one the model still read at full precision elsewhere.
    """

    def __init__(self, spec, recent: int = 16) -> None:
        super().__init__(spec, recent)
        self.recent = recent - 1  # the declaration (kv_storage) still says ``recent``


class ReorderLeavesRecentRows(QuantizedCache):
    """reorder moves the codes and scales of every batch row, but not the recent rows kept
    as given.

    Stands for a reorder (beam search) that moves the quantized part and not the residual
    part (transformers 48700): each beam then read another beam's latest tokens.
    """

    def reorder(self, indices: Tensor) -> None:
        exact = list(self.exact)  # reorder moves the lists' tensors in place
        super().reorder(indices)
        self.exact = exact


class ReorderLeavesScales(QuantizedCache):
    """reorder moves the codes and the recent rows, but not the scales and zero points.

    Stands for a beam reorder that forgot the side tensors of a quantized cache: each beam's
    codes were then read with another beam's scales (sglang 20705's scale buffers).
    """

    def reorder(self, indices: Tensor) -> None:
        scales, zeros = list(self.scales), list(self.zeros)
        super().reorder(indices)
        self.scales, self.zeros = scales, zeros


class AnotherRowsScale(QuantizedCache):
    """Each quantized row is read back with the scale and zero point of the row before it
    (the first with its own).

    Stands for int8 rows dequantized with another row's scale: a scale index off by one
    position, as when a kernel's scale offset ignored the block's first token.
    """

    def rows(self, part: int) -> Tensor:
        held = slice(0, self.quantized)
        scales, zeros = self.scales[part][:, :, held], self.zeros[part][:, :, held]
        shifted = [torch.cat((side[:, :, :1], side[:, :, :-1]), dim=2) for side in (scales, zeros)]
        old = dequantize(self.codes[part][:, :, held], *shifted, self.spec.dtype)
        return torch.cat((old, self.exact[part]), dim=2)


class NbytesAtFullPrecision(QuantizedCache):
    """``nbytes`` counts every row held at its full-precision size, codes and all.

    Stands for a quantized cache that reports the size of the tensors its codes stand for:
    quanto's quantized tensors report their full-precision ``nbytes`` (found by this kit,
    docs/found-in-the-wild.md), so a memory figure built on them shows no saving at all.
    """

    @property
    def nbytes(self) -> int:
        itemsize = torch.empty((), dtype=self.spec.dtype).element_size()
        s = self.spec
        return 2 * s.batch * s.kv_heads * self.length * s.head_dim * itemsize


class KeysScaledPerToken(KiviGroupCache):
    """Keys are coded with a min and a step per token over its head_dim, where the cache
    declares them per channel over each group of tokens (KIVI's layout).

    Stands for a scale applied on the wrong axis: transformers' quantized caches take an
    ``axis_key`` whose meaning differs by backend (HQQ's axis 0 groups numbers across batch
    rows, tests/test_found_in_the_wild_quantized.py), and KIVI's keys coded on its values'
    per-token path let a key's outlier channel set every other channel's step.
    """

    def _flush(self) -> None:
        keys = torch.stack(self._residual_keys, dim=2).to(self._wide)
        super()._flush()
        last = self._flushed[len(self._flushed) - 1]
        last["keys"] = kivi.quantize(keys, kivi.KEY_BITS, dim=3, floor=0.0)


class ScaleRedrawnPerFlush(KiviGroupCache):
    """Each time a group of tokens is flushed into codes, every key coded before is decoded
    and coded again with one min and step per channel drawn over all the coded tokens.

    Stands for a scale recomputed per flush that drifts: transformers' quantized layers
    dequantize and re-quantize every row at each residual flush (kvimpl/hf_quantized.py),
    and where the new scale spans more than the row's own group, its error grows with the
    history instead of staying within one group's step.
    """

    def _flush(self) -> None:
        super()._flush()
        order = sorted(self._flushed)
        keys = torch.cat([kivi.dequantize(*self._flushed[g]["keys"]) for g in order], dim=2)
        codes, low, step = kivi.quantize(keys, kivi.KEY_BITS, dim=2, floor=0.0)
        for g, group_codes in zip(order, codes.split(self.group, dim=2), strict=True):
            self._flushed[g]["keys"] = (group_codes, low, step)


class Fp8CastUnclamped(Fp8SegmentCache):
    """Under a fixed per-tensor scale, ``x / scale`` is cast to float8 e5m2 without the clamp
    to the format's max: a number beyond max x scale becomes inf instead of saturating.

    Stands for a saturating cast left to the hardware (fp8 overflow to inf or nan), the
    class of shared/BUGS.md section 10: numbers beyond max x k_scale arise only under a
    non-unit scale, which the engines' own tests did not draw ("the added tests only cover
    identity-scale inputs", tokenspeed 759), and a cast without the clamp then writes inf.
    """

    SCALE = 2.0**-14  # e5m2's range is then +-3.5, which normal rows pass now and then

    def __init__(self, spec) -> None:
        super().__init__(spec)
        self._codes = torch.float8_e5m2
        self._top = torch.finfo(self._codes).max
        self.kv_storage = Quantized(8, codes=self._codes, symmetric=True, scale=self.SCALE)

    def _encode(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        wide = rows.to(self._wide)
        scale = torch.full((*wide.shape[:3], 1), self.SCALE, dtype=self._wide, device=wide.device)
        return (wide / scale).to(self._codes), scale


QUANTIZED_MUTANTS = (
    ScaleIgnoredOnRead,
    ScalesOverPaddedWidth,
    RecentWindowOffByOne,
    ReorderLeavesRecentRows,
    ReorderLeavesScales,
    AnotherRowsScale,
    NbytesAtFullPrecision,
    KeysScaledPerToken,
    ScaleRedrawnPerFlush,
    Fp8CastUnclamped,
)
