"""transformers 5.24.0: generate trusts that a cache passed to it holds a prefix of
input_ids. A DynamicCache or StaticCache left holding 6 tokens of one prompt, passed with a
new unrelated 9-token prompt, makes generate feed only the new prompt's last 3 tokens, at
positions 6-8, attending to the old prompt's keys: the logits and tokens are those of another
text, with no error or warning. (A new prompt shorter than what the cache holds fails with
"cannot reshape tensor of 0 elements", which names neither the cache nor the prompt.) The
cache keeps no token ids, so generate cannot tell a continuation from another prompt.

Run as `python repros/generate_reused_cache_other_prompt.py` (its tiny Llama from
_tiny_llama.py next to it). Exits 1 while the defect is there: the reused cache's logits
differ from a fresh cache's.
"""

import sys

import torch
from _tiny_llama import tiny_llama_config
from transformers import DynamicCache, LlamaForCausalLM, StaticCache

torch.manual_seed(0)
config = tiny_llama_config()
model = LlamaForCausalLM(config).eval()
greedy = dict(do_sample=False, output_logits=True, return_dict_in_generate=True)
prompt = torch.tensor([list(range(9, 18))])
fresh = model.generate(input_ids=prompt, max_new_tokens=3, **greedy)
broken = False
for cache in (DynamicCache(config=config), StaticCache(config=config, max_cache_len=32)):
    model.generate(input_ids=torch.tensor([[1, 2, 3, 4]]), max_new_tokens=3, cache=cache, **greedy)
    reused = model.generate(input_ids=prompt, max_new_tokens=3, cache=cache, **greedy)
    diff = max((a - b).abs().max().item() for a, b in zip(reused.logits, fresh.logits, strict=True))
    print(f"{type(cache).__name__}: largest logit difference from a fresh cache {diff:.3g}")
    broken |= diff > 1e-4
if broken:
    print("DEFECT: a reused cache silently serves another prompt")
    sys.exit(1)
print("fixed")
