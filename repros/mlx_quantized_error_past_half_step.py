"""mlx 0.32.4 / mlx-lm 0.32.2: QuantizedKVCache's affine codes (mx.quantize) come back up to
a whole step off, twice the half step of a min/max affine code of the same bits.

mx.quantize makes the group's edge of larger magnitude exact and rounds the step to
edge / round(edge / step) so that the grid passes through 0; the other end of the range is
then clipped or the step grows, and numbers there err by up to ~1 step (range / (2^bits - 1))
instead of half of one. The cache stores every row so (QuantizedKVCache.update_and_fetch,
mlx_lm/models/cache.py:296-297). This prints the worst error over 200 random groups, in steps;
a min/max affine code stays within 0.5. Exits 1 while it is past 0.5 (plus 1% for float32
rounding).
"""

import sys

import mlx.core as mx
import numpy as np

worst = {}
for bits in (8, 4):
    ratio = 0.0
    for seed in range(200):
        x = mx.random.normal((1, 1, 4, 64), key=mx.random.key(seed)) * 3 + (seed % 5)
        codes = mx.quantize(x, group_size=64, bits=bits)
        back = np.array(mx.dequantize(*codes, group_size=64, bits=bits)).reshape(-1, 64)
        given = np.array(x).reshape(-1, 64)
        step = (given.max(1) - given.min(1)) / (2**bits - 1)
        ratio = max(ratio, float((np.abs(given - back).max(1) / step).max()))
    worst[bits] = ratio
    print(f"{bits}-bit groups of 64: worst error {ratio:.3f} steps (a min/max code: 0.5)")
if max(worst.values()) > 0.505:
    print("DEFECT: quantized rows come back beyond half a step", file=sys.stderr)
    sys.exit(1)
