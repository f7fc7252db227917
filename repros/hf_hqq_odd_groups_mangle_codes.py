"""hqq 0.2.8.post1 under transformers 5.24.0, class 1 (corrupted state in normal use): HQQ's
4-bit packing mangles the codes of a tensor with an odd number of groups, and the quantized
cache then fails every later update.

With axis 1 (what transformers' cache guide recommends for HQQ) HQQ reshapes the flattened
keys to (-1, q_group_size): one row per group (hqq/core/quantize.py:106-111). Its 4-bit packer
ORs the first len // 2 rows into the rest (hqq/core/bitpack.py:24-28, pack_4bit_u8), which for
an odd number of rows broadcasts: 3 rows come back as 4 (the first twice, the others moved),
1 row as none. Quantizing checks only that
q_group_size divides the tensor (quantize.py:94-100). A model with 3 KV heads of width 64
(SmolLM2-135M's shape) has 3 groups of 64 per token, so every odd-length prompt is quantized to
codes of the wrong shape: generate fails at its first decode step (transformers' HQQQuantizedLayer
dequantizes the prompt there), and so does every later call on the cache (each counting its
tokens). An even-length prompt works.

Plain transformers, hqq and torch (a tiny random Llama). Run as
`python repros/hf_hqq_odd_groups_lose_codes.py`. Exits 1 while the defect is there.
"""

import sys
import warnings

import torch
from hqq.core.bitpack import BitPack
from transformers import LlamaConfig, LlamaForCausalLM

warnings.filterwarnings("ignore")
codes = torch.arange(3, dtype=torch.uint8).reshape(3, 1)
packed = BitPack.pack_4bit_u8(codes)
print(
    f"pack_4bit_u8 of 3 rows gives {packed.shape[0]} packed row(s), unpacked to "
    f"{BitPack.unpack_4bit_u8(packed).shape[0]} rows"
)

torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=32,
    hidden_size=96,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=3,
    num_key_value_heads=3,
    head_dim=64,
    bos_token_id=None,
    eos_token_id=None,
)
model = LlamaForCausalLM(config).eval()
cache_config = {"backend": "hqq", "axis_key": 1, "axis_value": 1, "nbits": 4, "q_group_size": 64}
broken = False
for prompt in ([1, 2, 3, 4], [1, 2, 3]):
    try:
        model.generate(
            torch.tensor([prompt]),
            max_new_tokens=3,
            do_sample=False,
            cache_implementation="quantized",
            cache_config=cache_config,
        )
        result = "generated"
    except RuntimeError as error:
        result = f"RuntimeError: {error}"
        broken = True
    print(f"a {len(prompt)}-token prompt, HQQ axis 1: {result}")
if broken:
    print("DEFECT (class 1): HQQ's 4-bit packing mangled the codes of an odd number of groups")
    sys.exit(1)
print("fixed: odd numbers of groups are packed whole")
