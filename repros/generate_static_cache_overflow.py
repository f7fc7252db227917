"""transformers 5.24.0: generate does not hold a StaticCache passed to it to
prompt + max_new_tokens. With max_cache_len=5 for a 4-token prompt and max_new_tokens=3 (6
tokens to hold), it generates, then raises IndexError from index_copy_ at the overflowing
step (the tokens so far lost), and leaves the cache counting 6 tokens in its 5 slots
(StaticLayer.update adds to cumulative_length before it writes), so every later call on it
fails until reset().

Run as `python repros/generate_static_cache_overflow.py` (its tiny Llama from
_tiny_llama.py next to it). Exits 1 while the defect is there.
"""

import sys

import torch
from _tiny_llama import tiny_llama_config
from transformers import LlamaForCausalLM, StaticCache

torch.manual_seed(0)
config = tiny_llama_config()
model = LlamaForCausalLM(config).eval()
cache = StaticCache(config=config, max_cache_len=5)
try:
    model.generate(
        input_ids=torch.tensor([[1, 2, 3, 4]]), max_new_tokens=3, do_sample=False, cache=cache
    )
except IndexError as error:
    print(
        f"DEFECT: generate raised IndexError mid-generation: {error}; the cache now counts "
        f"{int(cache.get_seq_length())} tokens in {cache.layers[0].max_cache_len} slots"
    )
    sys.exit(1)
print("fixed: refused up front or generated within the cache")
