"""Rotary position embeddings (RoPE): rotating keys and queries at their absolute positions,
and rotating held keys on by a distance (``rerotate``), which a context shift needs (contract,
section 8.4). The angles come from tables kept per width, base, dtype and device, so that a
position's rotation is one value whichever call computes it.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor


def rope_cos_sin(positions: Tensor, head_dim: int, base: float, dtype: torch.dtype):
    """cos and sin of the rotation angles, each shaped (T, head_dim // 2): rows of a table
    of every position below a power of two (``rope_table``), or computed for these positions
    alone where they reach past ``ROPE_TABLE_POSITIONS``."""
    low, high = (int(end) for end in positions.aminmax())
    if low < 0 or high >= ROPE_TABLE_POSITIONS:
        return rope_angles_cos_sin(positions, head_dim, base, dtype)
    rows = max(64, 1 << high.bit_length())
    cos, sin = rope_table(rows, head_dim, base, dtype, positions.device)
    return cos[positions], sin[positions]


# A model's step recomputed cos and sin for every position, a fifth of a small model's step;
# a table per width, base, dtype and device serves every step, and a position's rotation is
# then one value whichever call computes it. Positions from this one on are computed per call
# (a table of them takes 16 MiB at head_dim 256 in float64, and a worker may keep dozens).
ROPE_TABLE_POSITIONS = 1 << 13


@functools.lru_cache(maxsize=64)
def rope_table(rows: int, head_dim: int, base: float, dtype: torch.dtype, device: torch.device):
    """``rope_angles_cos_sin`` of positions 0 to ``rows`` - 1."""
    with torch.inference_mode(False), torch.no_grad():  # a plain tensor, whoever asks first
        positions = torch.arange(rows, device=device)
        return rope_angles_cos_sin(positions, head_dim, base, dtype)


def rope_angles_cos_sin(positions: Tensor, head_dim: int, base: float, dtype: torch.dtype):
    """cos and sin of the rotation angles of ``positions``, computed in float64."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device)
    inverse_frequencies = base ** (-exponents / head_dim)
    angles = positions.to(torch.float64)[..., None] * inverse_frequencies
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: Tensor, positions: Tensor, base: float) -> Tensor:
    """Rotate x (B, H, T, head_dim) by its absolute positions, (T,) shared by every batch row
    or (B, T) a row's own; channel i pairs with i + D/2."""
    cos, sin = rope_cos_sin(positions, x.shape[-1], base, x.dtype)
    if positions.ndim == 2:  # per row: broadcast over the heads
        cos, sin = cos[:, None], sin[:, None]
    first, second = x.chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)


def rerotate(keys: Tensor, delta: int, base: float) -> Tensor:
    """``keys`` (..., T, head_dim), rotated at their positions, rotated on by ``delta``
    positions (negative: back), computed in float64 and rounded once into their dtype: RoPE's
    rotations add, so a key rotated at p becomes the key rotated at p + delta (contract,
    section 8.4: a context shift moves the keys after the span it discards)."""
    if not keys.shape[-2]:
        return keys.clone()
    wide = torch.float32 if keys.device.type == "mps" else torch.float64  # MPS: no float64
    positions = torch.full((keys.shape[-2],), delta, device=keys.device)
    return apply_rope(keys.to(wide), positions, base).to(keys.dtype)
