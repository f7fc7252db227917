"""Lossy storage (contract, section 10.1): how a cache declares that it keeps rows in codes
(``Quantized``, as ``kv_storage``), how far a number may come back under such a declaration
(``Quantized.allowed_error``), and reading a cache's declaration (``storage``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from kvref.protocol import CacheContractError, is_count

# Float codes a declaration may state (section 10.1): a float8 format by its torch dtype. Its
# error is relative (half an ulp at the scaled number), and it saturates at the format's max.
FLOAT8_CODES = (torch.float8_e4m3fn, torch.float8_e5m2)


# What a group of numbers sharing one scale spans: channels of one token (the default), or
# tokens of one channel (keys per channel, as in KIVI).
GROUPED_ALONG = ("channels", "tokens")


@dataclass(frozen=True)
class Quantized:
    """How a cache stores rows in codes (contract, section 10.1): ``bits`` per number, one
    scale (and, unless ``symmetric``, one zero point) per ``group`` channels of a row (None:
    the whole head_dim of one token), and its ``recent`` most recent rows kept as given,
    never quantized. Declared as ``kv_storage``; a pair declares keys and values apart.

    Beside them (section 10.1, float codes, groups along tokens, a floor): ``codes`` a
    float8 dtype (``FLOAT8_CODES``) for float codes (8 bits, symmetric), their scale per group
    or one fixed ``scale`` per tensor; ``along="tokens"`` for a scale per channel over each
    ``group`` tokens (the first ``group`` rows since the reset, the next ...); ``min_step``
    the least step integer codes take (HQQ's floor). Left at their defaults, a declaration
    means what it always did."""

    bits: int
    group: int | None = None
    symmetric: bool = False
    recent: int = 0
    codes: torch.dtype | None = None
    along: str = "channels"
    scale: float | None = None
    min_step: float = 0.0

    def __post_init__(self) -> None:
        if not is_count(self.bits) or not 2 <= self.bits <= 8:
            raise ValueError(f"Quantized: bits must be an int from 2 to 8, got {self.bits!r}")
        if self.group is not None and (not is_count(self.group) or self.group < 1):
            raise ValueError(f"Quantized: group must be None or an int >= 1, got {self.group!r}")
        if not is_count(self.recent):
            raise ValueError(f"Quantized: recent must be an int >= 0, got {self.recent!r}")
        self._check_codes()
        self._check_along()
        self._check_scale()
        self._check_min_step()

    def _check_codes(self) -> None:
        if self.codes is None:
            return
        if self.codes not in FLOAT8_CODES:
            raise ValueError(
                f"Quantized: codes must be None (integers) or one of {FLOAT8_CODES}, got "
                f"{self.codes!r}"
            )
        if self.bits != 8 or not self.symmetric:
            raise ValueError(
                f"Quantized: {self.codes} codes are 8 bits scaled by absmax, with no zero point "
                f"(the code carries its sign): declare bits=8, symmetric=True; got "
                f"bits={self.bits!r}, symmetric={self.symmetric!r}"
            )

    def _check_along(self) -> None:
        if self.along not in GROUPED_ALONG:
            raise ValueError(f"Quantized: along must be one of {GROUPED_ALONG}, got {self.along!r}")
        if self.along == "tokens" and self.group is None:
            raise ValueError(
                "Quantized: along='tokens' shares a scale per channel over `group` tokens: "
                "declare group as that number of tokens (an int >= 1), not None"
            )

    def _check_scale(self) -> None:
        if self.scale is None:
            return
        if (
            isinstance(self.scale, bool)
            or not isinstance(self.scale, (int, float))
            or not math.isfinite(self.scale)
            or self.scale <= 0
        ):
            raise ValueError(f"Quantized: scale must be a finite float > 0, got {self.scale!r}")
        if self.codes is None or self.group is not None:
            raise ValueError(
                f"Quantized: a fixed scale ({self.scale!r}) is one per tensor, for float8 codes "
                f"(a calibrated k_scale or v_scale): declare codes= a float8 dtype and "
                f"group=None; got codes={self.codes!r}, group={self.group!r}"
            )

    def _check_min_step(self) -> None:
        step = self.min_step
        if (
            isinstance(step, bool)
            or not isinstance(step, (int, float))
            or not math.isfinite(step)
            or step < 0
        ):
            raise ValueError(f"Quantized: min_step must be a finite float >= 0, got {step!r}")
        if step and self.codes is not None:
            raise ValueError(
                f"Quantized: min_step ({step!r}) floors the step of integer codes; {self.codes} "
                f"codes have no uniform step"
            )

    def describe(self) -> str:
        if self.along == "tokens":
            grouping = f"per channel over groups of {self.group} tokens"
        elif self.scale is not None:
            grouping = f"with one fixed scale {self.scale:g}"
        else:
            grouping = "per token" if self.group is None else f"per group of {self.group}"
        kind = "symmetric" if self.symmetric else "with zero point"
        name = f"int{self.bits}" if self.codes is None else str(self.codes).removeprefix("torch.")
        floor = f", step at least {self.min_step:g}" if self.min_step else ""
        recent = f", the last {self.recent} rows as given" if self.recent else ""
        return f"{name} {grouping}, {kind}{floor}{recent}"

    @property
    def relative_step(self) -> float:
        """A step of the codes as a share of its group's largest magnitude, at most (a float
        code's: its ulp at the group's magnitude; the floor counted as a share of 1, as the
        budget counts magnitudes of at least 1)."""
        if self.codes is not None:
            return torch.finfo(self.codes).eps
        step = 2 / (2**self.bits - 2) if self.symmetric else 2 / (2**self.bits - 1)
        return max(step, self.min_step)

    def group_size(self, width: int) -> int:
        """The numbers of one row that share a scale in a row ``width`` wide (the last group
        may have fewer); along tokens, one."""
        if self.along == "tokens":
            return 1
        return width if self.group is None else min(self.group, width)

    def coded_rows(self, length: int) -> int:
        """How many of the first rows may be in codes once ``length`` were given since the
        reset: all but the recent run; along tokens, only whole groups of them."""
        settled = max(0, length - self.recent)
        return settled if self.along == "channels" else settled - settled % self.group

    def allowed_error(self, given: Tensor, dtype: torch.dtype) -> Tensor:
        """How far each number of ``given`` (rows (..., D); along tokens (..., T, D), the T
        rows given since the reset from the first) may come back, in float64: half the step of
        its group's codes (a float code's: half its ulp at the number, or what saturation
        takes), plus ``QUANTIZED_ROUNDINGS`` roundings of ``dtype`` over the group's magnitude
        and range (the scale, the zero point, the product, the sum, each held in a float). A
        nan or inf given allows anything (nothing to bound)."""
        rows = given.double()
        if self.along == "tokens":  # the same computation, a channel's tokens as its row
            return self._allowed_in_groups(rows.transpose(-1, -2), self.group, dtype).transpose(
                -1, -2
            )
        return self._allowed_in_groups(rows, self.group_size(rows.shape[-1]), dtype)

    def _allowed_in_groups(self, rows: Tensor, size: int, dtype: torch.dtype) -> Tensor:
        width = rows.shape[-1]
        groups = -(-width // size)
        padded = torch.nn.functional.pad(rows, (0, groups * size - width))
        grouped = padded.unflatten(-1, (groups, size))
        pad = torch.arange(groups * size, device=rows.device).unflatten(0, (groups, size)) >= width
        finite = (grouped.isfinite() | pad).all(-1)
        top = grouped.masked_fill(pad, -torch.inf).amax(-1)
        bottom = grouped.masked_fill(pad, torch.inf).amin(-1)
        magnitude = torch.maximum(top.abs(), bottom.abs())
        unit = torch.finfo(dtype).eps / 2
        roundings = QUANTIZED_ROUNDINGS * unit * (magnitude + (top - bottom))
        if self.codes is not None:
            per_number = self._float_code_error(grouped, magnitude) + roundings[..., None]
            allowed = per_number.masked_fill(~finite[..., None], torch.inf).flatten(-2)
            return allowed[..., :width]
        if self.symmetric:
            step = 2 * magnitude / (2**self.bits - 2)
        else:
            step = (top - bottom) / (2**self.bits - 1)
        allowed = step.clamp_min(self.min_step) / 2 + roundings
        allowed = allowed.masked_fill(~finite, torch.inf)
        return allowed.repeat_interleave(size, dim=-1)[..., :width]

    def _float_code_error(self, grouped: Tensor, magnitude: Tensor) -> Tensor:
        """Per number of ``grouped`` (..., groups, size): half the float8 ulp at it once
        scaled (a subnormal's below the smallest normal), and beyond the format's max, what
        the clamp to it takes."""
        finfo = torch.finfo(self.codes)
        if self.scale is None:
            scale = (magnitude / finfo.max)[..., None]
        else:
            scale = torch.full_like(magnitude, self.scale)[..., None]
        size = grouped.abs()
        half_ulp = torch.maximum(size, scale * finfo.smallest_normal) * (finfo.eps / 2)
        saturated = (size - scale * finfo.max).clamp_min(0)
        return torch.maximum(half_ulp, saturated)

    def nbytes(self, rows: int, width: int) -> int:
        """The least one of keys or values quantized can reserve per (batch row, kv head)
        for ``rows`` quantized rows of ``width`` numbers: the codes, packed (a float8 code a
        byte), and one scale per group (and a zero point) in the smallest float, 2 bytes
        (along tokens, one per channel per whole group of rows; a fixed scale, none)."""
        per_group = 2 if self.symmetric else 4
        codes = rows * -(-width * self.bits // 8)
        if self.scale is not None:
            return codes
        if self.along == "tokens":
            return codes + (rows // self.group) * width * per_group
        groups = -(-width // self.group_size(width))
        return codes + rows * groups * per_group


# Roundings of the storage dtype a dequantized number may carry beyond half a step: the
# scale's, the zero point's, the product's and the sum's (a scale held in bfloat16 rounds
# by that dtype's unit).
QUANTIZED_ROUNDINGS = 4


def storage(cache: object) -> tuple[Quantized | None, Quantized | None]:
    """``cache.kv_storage`` as (keys, values): None for a cache that stores rows as given."""
    declared = getattr(cache, "kv_storage", None)
    if declared is None or isinstance(declared, Quantized):
        return declared, declared
    if (
        isinstance(declared, tuple)
        and len(declared) == 2
        and all(part is None or isinstance(part, Quantized) for part in declared)
    ):
        return declared
    raise CacheContractError(
        f"kv_storage must be a kvref.Quantized, a (keys, values) pair of them (or None), "
        f"got {declared!r}"
    )
