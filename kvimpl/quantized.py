"""Rows in 8-bit codes with one scale and zero point per token, the most recent ``recent``
rows kept as given (contract, section 10.1), as KIVI-style and Hugging Face quantized caches
keep a full-precision residual beside the codes.

A row is quantized when it leaves the recent window and stays quantized: a truncate that
brings the window back over it does not bring its precision back. Offers truncate and
reorder (beam search moves codes, scales and the recent rows together), and no move
(``export_rows``, ``import_rows``: contract, section 11.2): what it holds is codes, so the
rows it could export are not the rows it was given.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvref.checks import check_append, check_reorder, check_truncate
from kvref.protocol import CacheSpec
from kvref.quantized import Quantized

BITS = 8
LEVELS = 2**BITS - 1


def quantize(rows: Tensor, wide: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """Codes (uint8), scale and zero point (``wide``, one per row) of ``rows`` (..., D):
    code = round((x - min) / scale), scale = (max - min) / 255."""
    rows = rows.to(wide)
    low, high = rows.amin(-1, keepdim=True), rows.amax(-1, keepdim=True)
    scale = (high - low) / LEVELS
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant row: codes 0
    codes = ((rows - low) / scale).round().clamp(0, LEVELS).to(torch.uint8)
    return codes, scale, low


def dequantize(codes: Tensor, scale: Tensor, zero: Tensor, dtype: torch.dtype) -> Tensor:
    return (codes.to(scale.dtype) * scale + zero).to(dtype)


class QuantizedCache:
    """Codes for ``max_length`` rows of keys and of values, preallocated, and the recent rows
    as given in a tensor of their own."""

    def __init__(self, spec: CacheSpec, recent: int = 16) -> None:
        self.spec = spec
        self.recent = recent
        self.kv_storage = Quantized(bits=BITS, recent=recent)
        # Scales in float32 (float64 for float64 rows): the bound allows the storage dtype's
        # roundings of them, and half precision would spend the whole of it.
        self.wide = torch.promote_types(spec.dtype, torch.float32)
        codes = (spec.batch, spec.kv_heads, spec.max_length, spec.head_dim)
        per_row = (*codes[:3], 1)
        device = spec.device
        self.codes = [torch.zeros(codes, dtype=torch.uint8, device=device) for _ in "kv"]
        self.scales = [torch.zeros(per_row, dtype=self.wide, device=device) for _ in "kv"]
        self.zeros = [torch.zeros(per_row, dtype=self.wide, device=device) for _ in "kv"]
        self.reset()

    @property
    def length(self) -> int:
        return self.quantized + self.exact[0].shape[2]

    @property
    def nbytes(self) -> int:
        held = (*self.codes, *self.scales, *self.zeros, *self.exact)
        return sum(tensor.nbytes for tensor in held)

    def reset(self) -> None:
        s = self.spec
        empty = (s.batch, s.kv_heads, 0, s.head_dim)
        self.quantized = 0  # rows 0 .. quantized - 1 are in codes, the rest in ``exact``
        self.exact = [torch.empty(empty, dtype=s.dtype, device=s.device) for _ in "kv"]

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        check_append(self.spec, self.length, key, value, capacity=self.spec.max_length)
        exact = [
            torch.cat((held, new), dim=2)
            for held, new in zip(self.exact, (key, value), strict=True)
        ]
        leaving = max(0, exact[0].shape[2] - self.recent)  # out of the window: into codes
        start, stop = self.quantized, self.quantized + leaving
        for part, rows in enumerate(exact):
            codes, scale, zero = quantize(rows[:, :, :leaving], self.wide)
            self.codes[part][:, :, start:stop] = codes
            self.scales[part][:, :, start:stop] = scale
            self.zeros[part][:, :, start:stop] = zero
        self.quantized = stop
        # Copies, so that the rows gone into codes free their storage and nbytes stays what
        # the cache holds.
        self.exact = [rows[:, :, leaving:].clone() if leaving else rows for rows in exact]
        return self.rows(0), self.rows(1)

    def rows(self, part: int) -> Tensor:
        """Every row held of keys (0) or values (1): the codes dequantized, then the recent."""
        held = slice(0, self.quantized)
        old = dequantize(
            self.codes[part][:, :, held],
            self.scales[part][:, :, held],
            self.zeros[part][:, :, held],
            self.spec.dtype,
        )
        return torch.cat((old, self.exact[part]), dim=2)

    def truncate(self, length: int) -> None:
        check_truncate(self.length, length)
        if length >= self.quantized:
            self.exact = [rows[:, :, : length - self.quantized].clone() for rows in self.exact]
        else:
            self.quantized = length
            self.exact = [rows[:, :, :0] for rows in self.exact]

    def reorder(self, indices: Tensor) -> None:
        check_reorder(self.spec, indices)
        for held in (self.codes, self.scales, self.zeros, self.exact):
            held[:] = [rows[indices] for rows in held]
