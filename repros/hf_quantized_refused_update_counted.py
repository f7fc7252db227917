"""transformers 5.24.0 (optimum-quanto 0.2.7), class 2 (corrupted state after an error the
caller caught): a QuantizedCache counts the tokens of an update that then fails.

QuantizedLayer.update adds the new tokens to cumulative_length on its first line
(cache_utils.py:837), before anything that can fail (the torch.cat at 851-852, the
quantizing at 842 or 855); the fp8 layer does the same (1050). Through the public API: a
model called on a QuantizedCache with a batch of another size raises in the first layer after
that layer has counted; a caller that catches the error and goes on with a valid call gets
wrong logits, with no error. DynamicCache, the default, refuses the same call and changes
nothing. The same fix as StaticLayer's (docs/reports/transformers-refused-update-counted.md).

Plain transformers, optimum-quanto and torch (a tiny random Llama). Run as
`python repros/hf_quantized_refused_update_counted.py`. Exits 1 while the defect is there.
"""

import sys
import warnings

import torch
from transformers import LlamaConfig, LlamaForCausalLM, QuantizedCache

warnings.filterwarnings("ignore")
torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=32,
    hidden_size=32,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    bos_token_id=None,
    eos_token_id=None,
)
model = LlamaForCausalLM(config).eval()
ids = torch.tensor([[1, 2, 3, 4, 5]])
with torch.no_grad():
    cache = QuantizedCache("quanto", config, q_group_size=8, residual_length=4)
    model(ids[:, :4], past_key_values=cache)
    try:
        model(torch.tensor([[5], [5]]), past_key_values=cache)  # a batch of 2
    except RuntimeError as error:
        print(f"batch of 2 refused: RuntimeError: {str(error)[:60]}")
    lengths = [layer.get_seq_length() for layer in cache.layers]
    after = model(ids[:, 4:], past_key_values=cache).logits[0, -1]
    clean = QuantizedCache("quanto", config, q_group_size=8, residual_length=4)
    model(ids[:, :4], past_key_values=clean)
    diff = (after - model(ids[:, 4:], past_key_values=clean).logits[0, -1]).abs().max().item()
print(f"layer lengths after the refused call: {lengths} (4 held)")
wrong = lengths[0] != 4
print(
    f"the next valid call's logits differ by {diff:.2g} from the same call on a cache that "
    "saw no refused call (the same codes; float32 rounding alone gives ~1e-7)"
)
if wrong:
    print("DEFECT (class 2): after a caught error the quantized cache counts a token never stored")
    sys.exit(1)
print("fixed: a refused call leaves the quantized cache as it was")
