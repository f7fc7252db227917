"""transformers 5.24.0, class 2 (corrupted state after an error the caller caught): generate
does not hold a StaticCache passed to it to prompt + max_new_tokens, and the cache it leaves
counts more than it holds.

With max_cache_len=5 for a 4-token prompt and max_new_tokens=3 (6 tokens to hold), generate
starts, then raises IndexError from index_copy_ at the overflowing step (the tokens so far
lost): a cache it creates itself is sized to max_length (generation/utils.py:2963), but a
cache passed in is not checked (its escape route, lines 2253-2267). StaticLayer.update has
counted the refused token first (cache_utils.py:483, before 487), so the cache now counts 6
tokens in its 5 slots, and every later call on it fails too, until reset().

Run as `python repros/generate_static_cache_overflow.py` (its tiny Llama from _tiny_llama.py
next to it). Exits 1 while the defect is there.
"""

import sys
import warnings

import torch
from _tiny_llama import tiny_llama_config
from transformers import LlamaForCausalLM, StaticCache

warnings.filterwarnings("ignore")
torch.manual_seed(0)
config = tiny_llama_config()
model = LlamaForCausalLM(config).eval()
cache = StaticCache(config=config, max_cache_len=5)
prompt = torch.tensor([[1, 2, 3, 4]])
try:
    model.generate(input_ids=prompt, max_new_tokens=3, do_sample=False, cache=cache)
    print("refused up front or generated within the cache")
    sys.exit(0)
except IndexError as error:
    print(f"generate raised mid-generation: IndexError: {error}")
counted, slots = int(cache.get_seq_length()), cache.layers[0].max_cache_len
print(f"the cache now counts {counted} tokens in {slots} slots")
with torch.no_grad():
    try:
        model(torch.tensor([[5]]), past_key_values=cache)
        after = "accepted"
    except IndexError as error:
        after = f"IndexError: {error}"
print(f"one more token on it: {after}")
if after != "accepted" or int(cache.get_seq_length()) > 5:
    print("DEFECT (class 2): the caught error left the cache counting tokens it does not hold")
    sys.exit(1)
print("fixed: the cache is as it was before the refused step")
