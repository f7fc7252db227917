"""mlx-lm 0.32.2: a warm KVCache accepts keys and values it cannot hold, by broadcasting and
casting them into its buffer, with no error.

update_and_fetch writes with ``self.keys[..., prev : self.offset, :] = keys``
(mlx_lm/models/cache.py:367-368), counting ``keys.shape[2]`` tokens (366). A key of rank 3,
(B, H, D), as one forgets the token axis, is counted as D tokens and broadcast into D rows;
a float16 key into a float32 cache is cast silently. Exits 1 while the defect is there.
"""

import sys

import mlx.core as mx
from mlx_lm.models.cache import KVCache

problems = []

cache = KVCache()
row = mx.ones((1, 1, 1, 4))
cache.update_and_fetch(row, row)
try:
    keys, _ = cache.update_and_fetch(mx.full((1, 1, 4), 2.0), mx.full((1, 1, 4), 2.0))
except Exception as error:
    print(f"rank-3 key refused: {type(error).__name__}: {error}")
else:
    problems.append(f"a rank-3 key (1, 1, 4) was accepted: offset is {cache.offset} (was 1)")

cache = KVCache()
cache.update_and_fetch(row, row)
try:
    half = mx.ones((1, 1, 1, 4), dtype=mx.float16)
    keys, _ = cache.update_and_fetch(half, half)
except Exception as error:
    print(f"float16 rows refused: {type(error).__name__}: {error}")
else:
    problems.append(f"float16 rows were accepted into a float32 cache, returned as {keys.dtype}")

for problem in problems:
    print("DEFECT:", problem, file=sys.stderr)
sys.exit(1 if problems else 0)
