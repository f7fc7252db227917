"""transformers 5.24.0, class 1 (wrong results in normal use): a cache passed to generate
that holds exactly the prompt makes generate feed the whole prompt again.

generate feeds only the tokens past the cache's length: next_sequence_length = prompt length -
cache length (generation/utils.py:4323), then input_ids[:, -next_sequence_length:] (line
700). When the cache holds the whole prompt (a prompt prefilled with a forward call, as the
cache guide's prompt-reuse recipe does for a prefix, then passed to generate unchanged) that
count is 0, and input_ids[:, -0:] is the whole prompt: it is fed again after itself, at
positions 6-11, and the cache grows from 6 to 13. The logits are those of the prompt
repeated, with no error. A prompt that extends the cache works.

Also shown, and not defects: a prompt longer than the cache but not extending it is served
silently (generate cannot tell: the cache keeps no token ids, and the guide asks for the
cached prefix), and a shorter one fails with "cannot reshape tensor of 0 elements", an
unclear refusal of bad input.

Run as `python repros/generate_reused_cache_other_prompt.py` (its tiny Llama from
_tiny_llama.py next to it). Exits 1 while the defect is there.
"""

import sys
import warnings

import torch
from _tiny_llama import tiny_llama_config
from transformers import DynamicCache, LlamaForCausalLM, StaticCache

warnings.filterwarnings("ignore")
torch.manual_seed(0)
config = tiny_llama_config()
model = LlamaForCausalLM(config).eval()
greedy = dict(max_new_tokens=2, do_sample=False, output_logits=True, return_dict_in_generate=True)
prompt = torch.tensor([[3, 4, 5, 6, 7, 8]])
fresh = model.generate(input_ids=prompt, **greedy)


def largest_difference(out):
    return max((a - b).abs().max().item() for a, b in zip(out.logits, fresh.logits, strict=True))


broken = False
for cache in (DynamicCache(config=config), StaticCache(config=config, max_cache_len=32)):
    name = type(cache).__name__
    with torch.no_grad():
        model(prompt, past_key_values=cache)  # the cache now holds exactly the prompt
    held = int(cache.get_seq_length())
    out = model.generate(input_ids=prompt, past_key_values=cache, **greedy)
    diff = largest_difference(out)
    wrong = diff > 1e-4
    broken |= wrong
    print(
        f"{name} holding the {held}-token prompt, passed with it: it now holds "
        f"{int(cache.get_seq_length())} tokens; logits differ from a fresh cache's by "
        f"{diff:.2g} -> {'WRONG' if wrong else 'ok'}"
    )

cache = DynamicCache(config=config)
model.generate(input_ids=torch.tensor([[1, 2, 3, 4]]), max_new_tokens=2, cache=cache)
other = model.generate(input_ids=torch.tensor([list(range(9, 17))]), cache=cache, **greedy)
print(
    "not a defect: a 5-token cache of another text passed with an unrelated 8-token prompt "
    f"serves it silently (only its last 3 tokens are fed; {len(other.logits)} steps generated)"
)
try:
    model.generate(input_ids=torch.tensor([[1, 2]]), cache=cache, max_new_tokens=1)
    shorter = "accepted"
except RuntimeError as error:
    shorter = f"RuntimeError: {error}"
print(f"not a defect: a prompt shorter than the cache: {shorter}")
if broken:
    print("DEFECT (class 1): a cache holding exactly the prompt makes generate feed it again")
    sys.exit(1)
print("fixed: a cache holding the prompt is continued from it")
