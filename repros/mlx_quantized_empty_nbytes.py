"""mlx-lm 0.32.2: QuantizedKVCache().nbytes raises on a cache that holds nothing yet.

nbytes is ``tree_reduce(lambda a, x: a + x.nbytes, (self.keys, self.values), 0)``
(mlx_lm/models/cache.py:335-336); before the first update keys and values are None, which
tree_reduce hands to the lambda: AttributeError. KVCache, RotatingKVCache and the batch caches
return 0 there (e.g. 245-248). A memory report over a fresh prompt cache (make_prompt_cache
with quantized layers, then sum(c.nbytes for c in cache)) crashes. Exits 1 while the defect
is there.
"""

import sys

from mlx_lm.models.cache import KVCache, QuantizedKVCache

print(f"KVCache().nbytes = {KVCache().nbytes}")
try:
    print(f"QuantizedKVCache().nbytes = {QuantizedKVCache().nbytes}")
except Exception as error:
    print(
        f"DEFECT: QuantizedKVCache().nbytes raised {type(error).__name__}: {error}", file=sys.stderr
    )
    sys.exit(1)
