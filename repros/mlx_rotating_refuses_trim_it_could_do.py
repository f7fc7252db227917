"""mlx-lm 0.32.2: RotatingKVCache refuses every trim once offset reaches max_size, even one
it can do exactly: trimming the last token of a cache that has evicted nothing, or trimming
everything.

is_trimmable() is ``self.offset < self.max_size`` (mlx_lm/models/cache.py:544-545), and
trim_prompt_cache returns 0 (trims nothing) for a cache that is not trimmable (137-138). At
offset == max_size the in-place path has evicted nothing yet (the ring wraps on the next
token), and a trim back to 0 never needs an evicted row. So speculative decoding cannot roll
back a rejected draft on a sliding-window layer once its window is full, and a model that
mixes window and full layers (trim_prompt_cache gates on all layers) cannot roll back at all.
Exits 1 while the defect is there.
"""

import sys

import mlx.core as mx
from mlx_lm.models.cache import RotatingKVCache, trim_prompt_cache

problems = []
cache = RotatingKVCache(max_size=4)
for i in range(4):  # one token at a time, as decoding does: nothing is evicted yet
    row = mx.full((1, 1, 1, 2), float(i))
    keys, _ = cache.update_and_fetch(row, row)
print(f"holds {keys.shape[2]} of {cache.offset} tokens; is_trimmable() is {cache.is_trimmable()}")
trimmed = trim_prompt_cache([cache], 1)
if trimmed != 1:
    problems.append(f"trim of 1 token from a cache holding every token trimmed {trimmed}")

for i in range(4, 6):  # the ring has wrapped: positions 0 and 1 are gone
    row = mx.full((1, 1, 1, 2), float(i))
    cache.update_and_fetch(row, row)
held = cache.offset
trimmed = trim_prompt_cache([cache], held)
if trimmed != held:
    problems.append(f"trim back to 0 (of {held} tokens) trimmed {trimmed}")

for problem in problems:
    print("DEFECT:", problem, file=sys.stderr)
sys.exit(1 if problems else 0)
