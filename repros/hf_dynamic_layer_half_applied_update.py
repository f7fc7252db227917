"""transformers 5.24.0, class 3 (a deviation from the kit's contract, not a defect):
DynamicLayer.update half-applies an update whose value fails.

update concatenates the keys (cache_utils.py:136) before the values (137); a value that
torch.cat refuses (another batch, device, rank or width) leaves the keys one update longer
than the values until reset(). Only a direct call of the per-layer update can pass such a
value: a model's attention computes its key and value from the same hidden states, so the
two always agree in batch, device and length, and a refused model call (another batch)
fails on the keys first and changes nothing. Bad input to an internal API, so not a defect.

Plain transformers and torch. Run as `python repros/hf_dynamic_layer_half_applied_update.py`.
Exits 0.
"""

import torch
from transformers.cache_utils import DynamicLayer

layer = DynamicLayer()
rows = torch.zeros(1, 1, 1, 4)
layer.update(rows, rows)
try:
    layer.update(rows, torch.zeros(2, 1, 1, 4))  # a value of another batch
except RuntimeError as error:
    print(f"refused: RuntimeError: {str(error)[:70]}")
keys, values = layer.keys, layer.values
print(f"after the refused update: {keys.shape[2]} key rows, {values.shape[2]} value rows")
seen = "seen" if keys.shape[2] != values.shape[2] else "no longer seen"
print(
    f"class 3: deviation from the kit's contract, not a defect ({seen}): only a direct call of the "
    "per-layer update can pass a value that fails where its key did not"
)
