"""transformers 5.24.0 (optimum-quanto 0.2.7), class 1 (corrupted state in normal use):
Cache.early_initialization on a QuantizedCache leaves layers that cannot take an update.

Cache.early_initialization (cache_utils.py:1719-1754, public: "useful for our export
recipes") calls lazy_initialization on every layer whose supports_early_init is True.
QuantizedLayer inherits True (CacheLayerMixin, line 28), but it builds its quantized states
only on the lazy path of update (841-843), which is then skipped: the first model call
raises AttributeError: 'NoneType' object has no attribute 'dequantize' (and counts its
tokens). The fp8 backend raises in early_initialization itself (amax of an empty tensor).

Plain transformers, optimum-quanto and torch (a tiny random Llama). Run as
`python repros/hf_quantized_early_initialization.py`. Exits 1 while the defect is there.
"""

import sys
import warnings

import torch
from transformers import LlamaConfig, LlamaForCausalLM, QuantizedCache

warnings.filterwarnings("ignore")
torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=32,
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    bos_token_id=None,
    eos_token_id=None,
)
model = LlamaForCausalLM(config).eval()
cache = QuantizedCache("quanto", config, q_group_size=64, residual_length=4)
cache.early_initialization(1, 2, 64, torch.float32, torch.device("cpu"))
try:
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]), past_key_values=cache)
    failure = None
except AttributeError as error:
    failure = f"AttributeError: {error}"
if failure:
    print(
        f"DEFECT (class 1): the first call on an early-initialized QuantizedCache raised {failure}"
    )
    sys.exit(1)
print("fixed: an early-initialized QuantizedCache takes its first update")
