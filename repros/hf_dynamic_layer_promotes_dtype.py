"""transformers 5.24.0, class 3 (a deviation from the kit's contract, not a defect):
DynamicLayer silently promotes rows of another dtype.

DynamicLayer grows by torch.cat (cache_utils.py:136-137), which promotes: float64 rows given
to a float32 layer are accepted and the whole layer becomes float64 (twice the memory), where
StaticLayer refuses them. A model's attention hands its cache keys and values of the model's
own dtype, so only a direct call of the per-layer update can do this: bad input to an
internal API, torch's promotion rule, not a defect.

Plain transformers and torch. Run as `python repros/hf_dynamic_layer_promotes_dtype.py`.
Exits 0.
"""

import torch
from transformers.cache_utils import DynamicLayer

layer = DynamicLayer()
layer.update(torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4))
rows = torch.zeros(1, 1, 1, 4, dtype=torch.float64)
keys, _ = layer.update(rows, rows)
print(f"a float32 layer given float64 rows: accepted, the layer is now {keys.dtype}")
seen = "seen" if keys.dtype == torch.float64 else "no longer seen"
print(
    f"class 3: deviation from the kit's contract, not a defect ({seen}): torch.cat's promotion, "
    "reached only by a direct call of the per-layer update with another dtype"
)
