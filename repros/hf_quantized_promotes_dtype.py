"""transformers 5.24.0 (optimum-quanto 0.2.7), class 3 (a deviation from the kit's contract,
not a defect): QuantizedLayer silently promotes rows of another dtype.

The residual and the returned rows grow by torch.cat (cache_utils.py:851-852, 862-863), which
promotes: float64 rows given to a float32 layer are accepted and every row it returns is
float64 from then on. A model hands its cache rows of its own dtype, so only a direct call of
the per-layer update can do this: torch's promotion rule on bad input to an internal API.

Plain transformers, optimum-quanto and torch. Run as
`python repros/hf_quantized_promotes_dtype.py`. Exits 0.
"""

import torch
from transformers.cache_utils import QuantoQuantizedLayer

layer = QuantoQuantizedLayer(nbits=4, q_group_size=4, residual_length=4)
layer.update(torch.randn(1, 1, 2, 4), torch.randn(1, 1, 2, 4))
rows = torch.randn(1, 1, 1, 4, dtype=torch.float64)
layer.update(rows, rows)
keys, _ = layer.update(torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4))
print(
    f"float64 rows given to a float32 layer: accepted; a later float32 update returns {keys.dtype}"
)
seen = "seen" if keys.dtype == torch.float64 else "no longer seen"
print(
    f"class 3: deviation from the kit's contract, not a defect ({seen}): torch.cat's promotion, "
    "reached only by a direct call of the per-layer update with another dtype"
)
