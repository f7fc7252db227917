"""transformers 5.24.0 (hqq 0.2.8.post1), class 1 (wrong results in normal use): with the HQQ
backend's default axis, a sequence's quantized cache depends on the other sequences of its
batch.

QuantizedCache("hqq", ...) and generate(cache_implementation="quantized",
cache_config={"backend": "hqq"}) default to axis_key = axis_value = 0 (cache_utils.py:956-957).
Along axis 0 HQQ reshapes the flattened keys to (q_group_size, -1) and takes min and max down
each column (hqq/core/quantize.py:107-119): a group is q_group_size numbers spread across the
whole tensor, batch rows included. So batched generation gives a prompt other logits than the
same prompt alone, and a sequence of large magnitude coarsens another's codes.
transformers' cache guide recommends axis 1 for HQQ (docs/source/en/kv_cache.md), which keeps
each group inside one token's head; the default is quanto's axis.

Plain transformers, hqq and torch (a tiny random Llama). Run as
`python repros/hf_hqq_default_axis_mixes_batch_rows.py`. Exits 1 while the defect is there.
"""

import sys
import warnings

import torch
from transformers import LlamaConfig, LlamaForCausalLM

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
greedy = dict(
    max_new_tokens=3,
    do_sample=False,
    output_logits=True,
    return_dict_in_generate=True,
    cache_implementation="quantized",
)
diffs = {}
for axis in (None, 1):
    cache_config = {"backend": "hqq", "nbits": 4, "q_group_size": 64, "residual_length": 1}
    if axis is not None:
        cache_config.update(axis_key=axis, axis_value=axis)
    alone = model.generate(torch.tensor([[1, 2, 3, 4]]), cache_config=cache_config, **greedy)
    batch = model.generate(
        torch.tensor([[1, 2, 3, 4], [9, 8, 7, 6]]), cache_config=cache_config, **greedy
    )
    diffs[axis] = max(
        (a[0] - b[0]).abs().max().item() for a, b in zip(alone.logits, batch.logits, strict=True)
    )
    name = "default axis (0)" if axis is None else f"axis {axis}"
    print(f"{name}: prompt 0's logits alone and beside prompt 1 differ by {diffs[axis]:.2g}")
if diffs[None] > 1e-4:
    print("DEFECT (class 1): with HQQ's default axis a sequence's cache depends on its batch")
    sys.exit(1)
print("fixed: a prompt's logits do not depend on its batch")
