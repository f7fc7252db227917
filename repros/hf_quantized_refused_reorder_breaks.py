"""transformers 5.24.0 (optimum-quanto 0.2.7), class 3 (a deviation from the kit's contract,
not a defect): a refused QuantizedLayer.reorder_cache leaves the layer failing.

reorder_cache stores the beam index for the quantized states (cache_utils.py:875-877, applied
at the next update) before it reorders the residual (880-882). An index the residual refuses
stays pending, and every later update raises IndexError (counting its tokens); with an empty
residual the same index is not refused at all and the next update raises. Only an index out
of the batch does this, and generate's beam search only passes indices of its own beams:
bad input to an internal call, not a defect.

Plain transformers, optimum-quanto and torch. Run as
`python repros/hf_quantized_refused_reorder_breaks.py`. Exits 0.
"""

import torch
from transformers.cache_utils import QuantoQuantizedLayer


def rows(n):
    return torch.randn(1, 1, n, 4)


layer = QuantoQuantizedLayer(nbits=4, q_group_size=4, residual_length=4)
layer.update(rows(1), rows(1))
layer.update(rows(1), rows(1))  # the residual holds one row
try:
    layer.reorder_cache(torch.tensor([1]))  # beam 1 of a batch of 1
except IndexError as error:
    print(f"reorder_cache([1]) on a batch of 1 refused: IndexError: {error}")
try:
    layer.update(rows(1), rows(1))
    after = "accepted"
except IndexError as error:
    after = f"IndexError: {error}"
print(f"the next update: {after}; the layer now counts {layer.get_seq_length()} (2 held)")
seen = "seen" if after != "accepted" else "no longer seen"
print(
    f"class 3: deviation from the kit's contract, not a defect ({seen}): the index is out of "
    "the batch, which beam search never passes"
)
