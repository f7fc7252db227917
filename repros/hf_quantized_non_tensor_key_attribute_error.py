"""transformers 5.24.0 (optimum-quanto 0.2.7), class 3 (a deviation from the kit's contract,
not a defect): QuantizedLayer refuses a key that is not a tensor with AttributeError.

update reads key_states.shape on its first line (cache_utils.py:837), so a list is refused
with AttributeError where the kit's contract asks for TypeError or ValueError. Nothing
changes; only the exception's type differs, on input no model produces.

Plain transformers, optimum-quanto and torch. Run as
`python repros/hf_quantized_non_tensor_key_attribute_error.py`. Exits 0.
"""

import torch
from transformers.cache_utils import QuantoQuantizedLayer

layer = QuantoQuantizedLayer(nbits=4, q_group_size=4, residual_length=4)
layer.update(torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4))
try:
    layer.update([0.0, 0.0, 0.0, 0.0], torch.randn(1, 1, 1, 4))
    raised = "nothing"
except Exception as error:  # the type is what is shown
    raised = type(error).__name__
print(f"a list as the key: raised {raised}; length still {layer.get_seq_length()}")
seen = "seen" if raised == "AttributeError" else "no longer seen"
print(
    f"class 3: deviation from the kit's contract, not a defect ({seen}): only the exception's "
    "type, on input no model produces"
)
