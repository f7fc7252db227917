"""transformers 5.24.0 (optimum-quanto 0.2.7), class 2 (corrupted state after an error the
caller caught): a QuantizedCache whose first update fails cannot be used until reset().

QuantizedLayer.update runs lazy_initialization (is_initialized = True, cache_utils.py:841)
before it quantizes the prompt (842-843). When quantizing fails, no quantized states exist,
yet the layer counts as initialized: every later update raises
AttributeError: 'NoneType' object has no attribute 'dequantize' (and counts its tokens, line
837). Through the public API: quanto groups q_group_size numbers of the flattened keys, so a
one-token prompt of a model with one KV head of width 96 cannot be grouped by the default 64
and the model call raises ValueError; the caller catches it and sends a two-token prompt
(192 numbers, which 64 divides), and that fails too, with an error that names nothing of
the cause. A fresh cache takes the same two-token prompt.

Plain transformers, optimum-quanto and torch (a tiny random Llama). Run as
`python repros/hf_quantized_refused_first_update_breaks.py`. Exits 1 while the defect is there.
"""

import sys
import warnings

import torch
from transformers import LlamaConfig, LlamaForCausalLM, QuantizedCache

warnings.filterwarnings("ignore")
torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=32,
    hidden_size=96,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=1,
    num_key_value_heads=1,
    head_dim=96,
    bos_token_id=None,
    eos_token_id=None,
)
model = LlamaForCausalLM(config).eval()
with torch.no_grad():
    cache = QuantizedCache("quanto", config)  # the defaults: 4 bits, groups of 64
    try:
        model(torch.tensor([[1]]), past_key_values=cache)
    except ValueError as error:
        print(f"a 1-token prompt refused: ValueError: {error}")
    model(torch.tensor([[1, 2]]), past_key_values=QuantizedCache("quanto", config))
    print("a fresh cache takes a 2-token prompt")
    try:
        model(torch.tensor([[1, 2]]), past_key_values=cache)
        broken = None
    except AttributeError as error:
        broken = f"AttributeError: {error}"
if broken:
    print(f"DEFECT (class 2): the cache that refused the first prompt then raised {broken}")
    sys.exit(1)
print("fixed: a refused first update leaves the cache usable")
