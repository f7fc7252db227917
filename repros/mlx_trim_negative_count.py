"""mlx-lm 0.32.2: KVCache.trim(n) (and trim_prompt_cache) takes any n: a negative count
GROWS the cache, bringing rows back that an earlier trim removed; a count past the length is
clamped silently; a float makes offset a float.

trim is ``n = min(self.offset, n); self.offset -= n`` (mlx_lm/models/cache.py:391-394; the
same in QuantizedKVCache 323, RotatingKVCache 547, BatchKVCache 983), with no check of n.
A caller that computes the count to trim as ``held - wanted`` with wanted > held (a draft
longer than the cache thought) gets the rejected draft rows back. Exits 1 while the defect
is there.
"""

import sys

import mlx.core as mx
from mlx_lm.models.cache import KVCache, trim_prompt_cache

problems = []
cache = KVCache()
rows = mx.arange(5, dtype=mx.float32).reshape(1, 1, 5, 1)
cache.update_and_fetch(rows, rows)
trim_prompt_cache([cache], 3)  # a rejected draft of 3 tokens: the cache holds 2
trimmed = trim_prompt_cache([cache], -3)
keys, _ = cache.update_and_fetch(mx.full((1, 1, 1, 1), 9.0), mx.full((1, 1, 1, 1), 9.0))
held = keys[0, 0, :, 0].tolist()
print(f"trim_prompt_cache(-3) returned {trimmed}; the next update returns rows {held}")
if trimmed != 0 or len(held) != 3:
    problems.append(f"a negative trim grew the cache back over the rows trimmed: {held}")

cache = KVCache()
cache.update_and_fetch(rows, rows)
trimmed = trim_prompt_cache([cache], 1.5)
print(f"trim_prompt_cache(1.5) returned {trimmed}; offset is now {cache.offset!r}")
if not isinstance(cache.offset, int):
    problems.append(f"a float count made offset a float: {cache.offset!r}")

for problem in problems:
    print("DEFECT:", problem, file=sys.stderr)
sys.exit(1 if problems else 0)
