"""mlx-lm 0.32.2: RotatingKVCache applies half of an update whose values fail: the keys grow
and the values do not, and from then on it returns more keys than values.

_update_concat (the path of any update of 2 or more tokens) replaces ``self.keys`` with the
grown keys (mlx_lm/models/cache.py:476) before it builds the values (477); when the values
fail (here: a value of another head width; equally of another batch, head count or rank), the
keys keep the refused tokens while ``offset`` (478) does not count them. The next decode step
(one token) returns keys and values of different lengths, and attention over them fails far
from the cause. Exits 1 while the defect is there.
"""

import sys

import mlx.core as mx
from mlx_lm.models.cache import RotatingKVCache

cache = RotatingKVCache(max_size=16)
rows = mx.ones((1, 1, 2, 4))
cache.update_and_fetch(rows, rows)
try:
    cache.update_and_fetch(mx.ones((1, 1, 2, 4)), mx.ones((1, 1, 2, 5)))  # a value 5 wide
except Exception as error:
    print(f"refused: {type(error).__name__}: {str(error)[:100]}")
row = mx.ones((1, 1, 1, 4))  # the next decode step: one token
keys, values = cache.update_and_fetch(row, row)
print(f"next update returns keys {keys.shape} and values {values.shape}; offset {cache.offset}")
if keys.shape[2] != values.shape[2]:
    print("DEFECT: a refused update left keys and values of different lengths", file=sys.stderr)
    sys.exit(1)
