"""transformers 5.24.0, class 3 (a deviation from the kit's contract, not a defect):
cache_implementation="offloaded" needs a CUDA device.

DynamicCache(offloading=True) is accepted for a model on the CPU, then its first update raises
torch's "AssertionError: Torch not compiled with CUDA enabled": Cache.update calls
torch.cuda.default_stream(...) when offloading (cache_utils.py:1614, 1617). transformers'
cache guide says so: "Cache offloading requires a GPU" (docs/source/en/kv_cache.md, Offloaded
Cache). A documented requirement met by a late and unclear error: the kit calls that an
unclear refusal, a maintainer a documented limit.

Run on a CPU-only torch, as `python repros/generate_offloaded_cache_cpu_crash.py` (its tiny
Llama from _tiny_llama.py next to it). Exits 0.
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
    seen = f"no longer seen: generated {out.tolist()}"
except AssertionError as error:
    seen = f"seen: the first update raised AssertionError: {error}"
print(
    f"class 3: deviation from the kit's contract, not a defect ({seen}); the offloaded cache "
    "is documented as needing a GPU"
)
