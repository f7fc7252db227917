"""transformers 5.24.0 (optimum-quanto 0.2.7), class 3 (a deviation from the kit's contract,
not a defect): QuantizedLayer accepts keys and values of different lengths.

update concatenates keys and values each on its own (cache_utils.py:851-852, 862-863) and checks
nothing, so a value with one token more than its key is stored, and the layer then returns
more value rows than key rows. A model's attention projects its key and value from the same
tokens, so only a direct call of the per-layer update can pass them: bad input to an internal
API, not a defect.

Plain transformers, optimum-quanto and torch. Run as
`python repros/hf_quantized_unequal_lengths.py`. Exits 0.
"""

import torch
from transformers.cache_utils import QuantoQuantizedLayer

layer = QuantoQuantizedLayer(nbits=4, q_group_size=4, residual_length=4)
layer.update(torch.randn(1, 1, 2, 4), torch.randn(1, 1, 2, 4))
keys, values = layer.update(torch.randn(1, 1, 1, 4), torch.randn(1, 1, 2, 4))
print(
    f"a 1-token key with a 2-token value: accepted, returns {keys.shape[2]} keys and "
    f"{values.shape[2]} values"
)
seen = "seen" if keys.shape[2] != values.shape[2] else "no longer seen"
print(
    f"class 3: deviation from the kit's contract, not a defect ({seen}): a model never passes "
    "a key and value of different lengths to the per-layer update"
)
