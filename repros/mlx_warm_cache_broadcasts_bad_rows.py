"""mlx-lm 0.32.2, class 3 (a deviation from the kit's contract, not a defect): a warm
KVCache accepts keys and values it cannot hold, by broadcasting and casting them.

update_and_fetch writes with ``self.keys[..., prev : self.offset, :] = keys``
(mlx_lm/models/cache.py:367-368), counting ``keys.shape[2]`` tokens (366). A key of rank 3,
(B, H, D), is counted as D tokens and broadcast into D rows; a float16 key is cast into a
float32 cache. A model's attention always hands its cache (B, H, T, D) arrays of its own
dtype, so only a direct call of the per-layer update can do this: bad input to an internal
API, and mlx's own assignment semantics.

Plain mlx and mlx-lm. Run as `python repros/mlx_warm_cache_broadcasts_bad_rows.py`. Exits 0.
"""

import mlx.core as mx
from mlx_lm.models.cache import KVCache

seen = []
cache = KVCache()
row = mx.ones((1, 1, 1, 4))
cache.update_and_fetch(row, row)
try:
    cache.update_and_fetch(mx.full((1, 1, 4), 2.0), mx.full((1, 1, 4), 2.0))
    seen.append(f"a rank-3 key (1, 1, 4) accepted: offset {cache.offset} (was 1)")
except ValueError as error:
    print(f"a rank-3 key refused: {error}")

cache = KVCache()
cache.update_and_fetch(row, row)
try:
    half = mx.ones((1, 1, 1, 4), dtype=mx.float16)
    keys, _ = cache.update_and_fetch(half, half)
    seen.append(f"float16 rows accepted into a float32 cache, returned as {keys.dtype}")
except ValueError as error:
    print(f"float16 rows refused: {error}")
for line in seen:
    print(line)
verdict = "seen" if seen else "no longer seen"
print(
    f"class 3: deviation from the kit's contract, not a defect ({verdict}): "
    "bad input to the per-layer update, which a model never passes"
)
