"""mlx-lm 0.32.2, class 3 (a deviation from the kit's contract, not a defect):
RotatingKVCache applies half of an update whose values fail.

_update_concat (the path of any update of 2 or more tokens) replaces ``self.keys`` with the
grown keys (mlx_lm/models/cache.py:476) before it builds the values (477); when the values
fail (another head width, batch, head count or rank than the keys), the keys keep the refused
tokens, and the next update returns one key more than values. A model's attention computes
its key and value from the same tokens and batch, so only a direct call of the per-layer
update can pass such a pair: bad input to an internal API.

Plain mlx and mlx-lm. Run as `python repros/mlx_rotating_half_applied_update.py`. Exits 0.
"""

import mlx.core as mx
from mlx_lm.models.cache import RotatingKVCache

cache = RotatingKVCache(max_size=16)
rows = mx.ones((1, 1, 2, 4))
cache.update_and_fetch(rows, rows)
try:
    cache.update_and_fetch(mx.ones((1, 1, 2, 4)), mx.ones((1, 1, 2, 5)))  # a value 5 wide
except ValueError as error:
    print(f"refused: ValueError: {str(error)[:80]}")
row = mx.ones((1, 1, 1, 4))
keys, values = cache.update_and_fetch(row, row)
print(f"the next update returns keys {keys.shape} and values {values.shape}")
seen = "seen" if keys.shape[2] != values.shape[2] else "no longer seen"
print(
    f"class 3: deviation from the kit's contract, not a defect ({seen}): a key and value of "
    "different widths reach the per-layer update only from a direct call"
)
