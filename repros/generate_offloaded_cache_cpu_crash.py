"""transformers 5.24.0: cache_implementation="offloaded" (DynamicCache(offloading=True)) is
accepted for a model on the CPU, then crashes in its first update with torch's
"AssertionError: Torch not compiled with CUDA enabled": Cache.update calls
torch.cuda.default_stream(...) unconditionally when offloading (cache_utils.py:1614, 1617),
although its prefetch stream is the device-agnostic torch.Stream() (line 1545). Nothing
refuses the setting up front, and nothing falls back to a plain cache.

Run on a CPU-only torch, as `python repros/generate_offloaded_cache_cpu_crash.py` (its tiny Llama
from _tiny_llama.py next to it). Exits 1 while the defect is there.
"""

import sys

import torch
from _tiny_llama import tiny_llama_config
from transformers import LlamaForCausalLM

if torch.cuda.is_available():
    sys.exit("run this on a CPU-only torch")
torch.manual_seed(0)
config = tiny_llama_config(pad_token_id=0)
model = LlamaForCausalLM(config).eval()
try:
    out = model.generate(
        input_ids=torch.tensor([[1, 2, 3]]),
        max_new_tokens=2,
        do_sample=False,
        cache_implementation="offloaded",
    )
except AssertionError as error:
    print(
        f"DEFECT: generate(cache_implementation='offloaded') on the CPU raised "
        f"AssertionError: {error}"
    )
    sys.exit(1)
print("fixed: generated", out.tolist())
