"""mlx-lm 0.32.2: a refused update_and_fetch is counted in offset, so the cache then lies
about its length and the next token is placed (and RoPE'd) one position too far.

KVCache.update_and_fetch adds the new tokens to ``offset`` (mlx_lm/models/cache.py:366)
before it writes them (367); when the write fails (here: a value of another batch, equally of
another head count or head width, or a value that is not an array), offset counts tokens never
stored, and the next call returns a row of zeros among the rows held. QuantizedKVCache does the
same (294 before the writes at 298-300), and BatchKVCache (offset and _idx advanced before the
writes). Exits 1 while the defect is there.
"""

import sys

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache

failed = False
for make in (KVCache, QuantizedKVCache, lambda: BatchKVCache(left_padding=[0])):
    cache = make()
    width = 64
    row = mx.ones((1, 1, 1, width))
    cache.update_and_fetch(row, row)
    try:
        cache.update_and_fetch(row, mx.ones((2, 1, 1, width)))  # a value of another batch
    except Exception as error:
        refusal = f"{type(error).__name__}: {error}"
    else:
        refusal = "accepted"
    length = cache.size() if isinstance(cache, BatchKVCache) else cache.offset
    name = type(cache).__name__
    print(f"{name}: refused update ({refusal}); length now {length}, it holds 1")
    if length != 1:
        failed = True
if failed:
    print("DEFECT: a refused update_and_fetch is counted in the cache's length", file=sys.stderr)
    sys.exit(1)
