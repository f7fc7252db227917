"""mlx-lm 0.32.2, class 1 (wrong results in normal use): QuantizedKVCache().nbytes raises on
a cache that holds nothing yet.

nbytes is ``tree_reduce(lambda a, x: a + x.nbytes, (self.keys, self.values), 0)``
(mlx_lm/models/cache.py:335-336); before the first update keys and values are None, which
tree_reduce hands to the lambda: AttributeError. KVCache, RotatingKVCache and the batch caches
return 0 there (e.g. 417-420), and the base class documents nbytes as "the size of this cache
in bytes" (177-179). mlx-lm sums it over its own caches (BatchGenerator.prompt_cache_nbytes,
generate.py:1772-1776), so a memory report over a quantized cache that holds nothing yet
crashes. Exits 1 while the defect is there.
"""

import sys

from mlx_lm.models.cache import KVCache, QuantizedKVCache

print(f"KVCache().nbytes = {KVCache().nbytes}")
try:
    print(f"QuantizedKVCache().nbytes = {QuantizedKVCache().nbytes}")
except Exception as error:
    print(f"DEFECT (class 1): QuantizedKVCache().nbytes raised {type(error).__name__}: {error}")
    sys.exit(1)
print("fixed: an empty QuantizedKVCache reports 0 bytes")
