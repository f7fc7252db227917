"""mlx-lm 0.32.2, class 3 (a deviation from the kit's contract, not a defect):
KVCache.trim(n) (and trim_prompt_cache) takes any n.

trim is ``n = min(self.offset, n); self.offset -= n`` (mlx_lm/models/cache.py:391-394; the
same in the other caches), with no check of n: a negative count grows the cache back over
rows an earlier trim removed, a count past the length is clamped, a float makes offset a
float. mlx-lm's own callers (speculative decoding in generate.py, the server's prompt cache)
only pass counts they computed from what the cache holds: a negative or float count is bad
input, which Python code conventionally does not check.

Plain mlx and mlx-lm. Run as `python repros/mlx_trim_negative_count.py`. Exits 0.
"""

import mlx.core as mx
from mlx_lm.models.cache import KVCache, trim_prompt_cache

seen = []
cache = KVCache()
rows = mx.arange(5, dtype=mx.float32).reshape(1, 1, 5, 1)
cache.update_and_fetch(rows, rows)
trim_prompt_cache([cache], 3)  # the cache now holds 2
trimmed = trim_prompt_cache([cache], -3)
keys, _ = cache.update_and_fetch(mx.full((1, 1, 1, 1), 9.0), mx.full((1, 1, 1, 1), 9.0))
held = keys[0, 0, :, 0].tolist()
print(f"trim_prompt_cache(-3) returned {trimmed}; the next update returns rows {held}")
if len(held) != 3:
    seen.append("a negative count grew the cache")

cache = KVCache()
cache.update_and_fetch(rows, rows)
trimmed = trim_prompt_cache([cache], 1.5)
print(f"trim_prompt_cache(1.5) returned {trimmed}; offset is now {cache.offset!r}")
if not isinstance(cache.offset, int):
    seen.append("a float count made offset a float")
verdict = "seen" if seen else "no longer seen"
print(
    f"class 3: deviation from the kit's contract, not a defect ({verdict}): "
    "an unchecked count, bad input that mlx-lm's own callers never pass"
)
