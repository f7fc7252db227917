"""transformers 5.24.0, class 3 (a deviation from the kit's contract, not a defect):
DynamicLayer accepts keys and values of different lengths.

update concatenates each on its own (cache_utils.py:136-137) and checks nothing, so a value
with one token more than its key is stored, and from then on the layer holds more value rows
than key rows. A model's attention projects its key and value from the same tokens, so only a
direct call of the per-layer update can pass them: bad input to an internal API, not a defect.

Plain transformers and torch. Run as `python repros/hf_dynamic_layer_unequal_lengths.py`.
Exits 0.
"""

import torch
from transformers.cache_utils import DynamicLayer

layer = DynamicLayer()
keys, values = layer.update(torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 2, 4))
print(
    f"a 1-token key with a 2-token value: accepted, {keys.shape[2]} keys, {values.shape[2]} values"
)
seen = "seen" if keys.shape[2] != values.shape[2] else "no longer seen"
print(
    f"class 3: deviation from the kit's contract, not a defect ({seen}): the per-layer update is "
    "internal, and a model never passes a key and value of different lengths"
)
