"""mlx-lm 0.32.2, class 3 (a deviation from the kit's contract, not a defect):
RotatingKVCache refuses every trim once offset reaches max_size, even one it could do
exactly (the last token of a window that has evicted nothing, or everything).

is_trimmable() is ``self.offset < self.max_size`` (mlx_lm/models/cache.py:544-545), and
trim_prompt_cache trims nothing where a cache is not trimmable (137-138). mlx-lm's API allows
the refusal: trim_prompt_cache "will trim the cache if possible (in-place) and return the
number of tokens that were trimmed" (123-134), and a wrapped ring does not keep what a trim
would need in general (a PR that would trim a full window, ml-explore/mlx-lm#1437, was closed
unmerged). The kit's contract lets a window refuse only the trims that need evicted rows,
hence the deviation. (A caller that ignores the count returned is another matter: mlx-lm's
speculative decoding does, ml-explore/mlx-lm#1423.)

Plain mlx and mlx-lm. Run as `python repros/mlx_rotating_refuses_trim_it_could_do.py`. Exits 0.
"""

import mlx.core as mx
from mlx_lm.models.cache import RotatingKVCache, trim_prompt_cache

seen = []
cache = RotatingKVCache(max_size=4)
for i in range(4):  # one token at a time, as decoding does: nothing is evicted yet
    row = mx.full((1, 1, 1, 2), float(i))
    keys, _ = cache.update_and_fetch(row, row)
print(f"holds {keys.shape[2]} of {cache.offset} tokens; is_trimmable() is {cache.is_trimmable()}")
trimmed = trim_prompt_cache([cache], 1)
print(f"a trim of 1 token trimmed {trimmed}")
if trimmed != 1:
    seen.append("trim of 1")
for i in range(4, 6):  # the ring has wrapped
    row = mx.full((1, 1, 1, 2), float(i))
    cache.update_and_fetch(row, row)
trimmed = trim_prompt_cache([cache], cache.offset)
print(f"a trim back to 0 trimmed {trimmed} of {cache.offset}")
if trimmed == 0:
    seen.append("trim to 0")
verdict = "seen" if seen else "no longer seen"
print(
    f"class 3: deviation from the kit's contract, not a defect ({verdict}): "
    "a full rotating cache is not trimmable by design"
)
