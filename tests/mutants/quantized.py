"""Broken quantized caches (docs/contract.md, section 10.1): each the built-in
``QuantizedCache`` with one bug in how it codes, keeps or moves rows. The first paragraph of
each docstring names the bug and the second the real failure it stands for."""

from __future__ import annotations

import torch
from torch import Tensor

from kvimpl import quantized
from kvimpl.quantized import QuantizedCache, dequantize


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


QUANTIZED_MUTANTS = (
    ScaleIgnoredOnRead,
    ScalesOverPaddedWidth,
    RecentWindowOffByOne,
    ReorderLeavesRecentRows,
    ReorderLeavesScales,
    AnotherRowsScale,
    NbytesAtFullPrecision,
)
