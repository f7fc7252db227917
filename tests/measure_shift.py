"""Measure the context shift's rounding budget (``kvcheck.asserts.shift_rounding``) on a
re-rotation with float32 angles and on one with its angles in half precision: the numbers
behind docs/contract.md, section 8.4.

    python -m tests.measure_shift [--seeds 3] [--keys 256]

Keys of every storage dtype, head width and RoPE base are rotated at positions from 4096 on
(in float64, rounded once into their dtype, as the model hands them), then shifted back by
each count: by ``ShiftingListCache``'s rotation (float32 angles, as llama.cpp forms them),
by ``ShiftAnglesInHalfPrecision``'s (the frequencies, angles, cos and sin in the storage
dtype), and by a rotation that undoes each key's absolute position and applies its new one,
float32 angles (a cache that re-rotates from a table of positions). Each is compared with
the float64 re-rotation as the kit compares it: the largest error of a key, relative to its
row's largest magnitude, over the budget for that shift. Above 1 the kit flags it.
"""

from __future__ import annotations

import argparse

import torch

from kvcheck.asserts import shift_rounding
from kvref import rerotate
from kvref.rope import apply_rope
from tests.independent.shifting_list_cache import rotate_in_dtype
from tests.mutants.shift import rotate_with_angles_in

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
HEAD_DIMS = (8, 64, 128)
BASES = (10_000.0, 500_000.0, 1_000_000.0)
COUNTS = (1, 16, 48, 100, 128, 256, 1024)
FIRST = 4096  # where the keys sit before the shift


def rotate_at(keys, angles):
    """``keys`` rotated by ``angles`` (T, D/2, float32), the products in the keys' dtype."""
    head_dim = keys.shape[-1]
    cos, sin = angles.cos().to(keys.dtype), angles.sin().to(keys.dtype)
    first, second = keys[..., : head_dim // 2], keys[..., head_dim // 2 :]
    return torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)


def rotate_from_absolute(keys, delta: int, base: float, at: torch.Tensor):
    """Each key (at position ``at``) rotated back from there and on to ``at + delta``, the
    angles of both positions in float32, as from a table of positions."""
    exponents = torch.arange(0, keys.shape[-1], 2, dtype=torch.float32)
    inverse = base ** (-exponents / keys.shape[-1])
    unrotated = rotate_at(keys, -(at.float()[:, None] * inverse))
    return rotate_at(unrotated, (at + delta).float()[:, None] * inverse)


def over_budget(got, want, dtype: torch.dtype, count: int) -> float:
    """The largest error of a key row, relative to its largest magnitude, in budgets."""
    scale = want.abs().amax(dim=-1, keepdim=True)
    return ((got.double() - want).abs() / scale).max().item() / shift_rounding(dtype, (count,))


def measure(dtype, head_dim: int, base: float, count: int, seeds: int, keys: int) -> dict:
    """The largest ratio over ``seeds`` draws of ``keys`` keys, for each rotation."""
    worst = {"float32 angles": 0.0, "angles in the storage dtype": 0.0, "absolute": 0.0}
    at = torch.arange(FIRST, FIRST + keys)
    for number in range(seeds):
        generator = torch.Generator().manual_seed(number)
        raw = torch.randn(1, 4, keys, head_dim, dtype=torch.float64, generator=generator)
        given = apply_rope(raw, at, base).to(dtype)
        want = rerotate(given.double(), -count, base)
        got = {
            "float32 angles": rotate_in_dtype(given, -count, base),
            "angles in the storage dtype": rotate_with_angles_in(given, -count, base),
            "absolute": rotate_from_absolute(given, -count, base, at),
        }
        for name, rotated in got.items():
            worst[name] = max(worst[name], over_budget(rotated, want, dtype, count))
    return worst


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--keys", type=int, default=256)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"largest error / budget, keys at {FIRST}.., shifted back by {COUNTS}:")
    for dtype in DTYPES:
        for head_dim in HEAD_DIMS:
            for base in BASES:
                rows = [measure(dtype, head_dim, base, c, args.seeds, args.keys) for c in COUNTS]
                for name in rows[0]:
                    ratios = " ".join(f"{row[name]:7.2f}" for row in rows)
                    print(f"{str(dtype)[6:]:8} D {head_dim:3} base {base:9.0f} {name:28} {ratios}")


if __name__ == "__main__":
    main()
