"""mlx-lm 0.32.2, class 2 (corrupted state after an error the caller caught): a refused
update_and_fetch is counted in offset, so the cache then lies about its length and the next
token is placed (and RoPE'd) one position too far, beside a row of zeros.

KVCache.update_and_fetch adds the new tokens to ``offset`` (mlx_lm/models/cache.py:366)
before it writes them (367-368); when the write fails, offset counts tokens never stored.
QuantizedKVCache does the same (294 before the writes at 298-300), and BatchKVCache (offset
and _idx advanced before the writes). Through the public API: a model called on its prompt
cache (make_prompt_cache) with a batch of another size raises in the first layer after that
layer has counted; a caller that catches the error and goes on with a valid call gets wrong
logits, with no error.

Plain mlx and mlx-lm (a tiny random Llama built from mlx_lm.models.llama). Run as
`python repros/mlx_refused_update_counted.py`. Exits 1 while the defect is there.
"""

import contextlib
import sys

import mlx.core as mx
from mlx_lm.models import llama
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache, make_prompt_cache

args = llama.ModelArgs(
    model_type="llama",
    hidden_size=32,
    num_hidden_layers=2,
    intermediate_size=24,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    vocab_size=32,
    head_dim=8,
)
mx.random.seed(0)
model = llama.Model(args)
ids = mx.array([[1, 2, 3, 4, 5]])
full = model(ids)[0, -1]
cache = make_prompt_cache(model)
model(ids[:, :4], cache=cache)
try:
    model(mx.array([[5], [5]]), cache=cache)  # a batch of 2 on a cache of 1
    refusal = "accepted"
except ValueError as error:
    refusal = f"ValueError: {error}"
offsets = [c.offset for c in cache]
diff = mx.abs(model(ids[:, 4:], cache=cache)[0, -1] - full).max().item()
print(f"a batch of 2 refused ({refusal}); the layers' offsets now {offsets} (4 held)")
print(f"the next valid call's logits differ from the uncached model's by {diff:.2g}")
broken = diff > 1e-4

for make in (KVCache, QuantizedKVCache, lambda: BatchKVCache(left_padding=[0])):
    layer = make()
    row = mx.ones((1, 1, 1, 64))
    layer.update_and_fetch(row, row)
    with contextlib.suppress(ValueError):
        layer.update_and_fetch(row, mx.ones((2, 1, 1, 64)))
    length = layer.size() if isinstance(layer, BatchKVCache) else layer.offset
    print(f"{type(layer).__name__}: after a refused update its length is {length} (1 held)")
if broken:
    print("DEFECT (class 2): after a caught error the cache counts tokens it never stored")
    sys.exit(1)
print("fixed: a refused call leaves the cache as it was")
