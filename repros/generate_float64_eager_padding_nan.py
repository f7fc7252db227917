"""transformers 5.24.0, class 1 (wrong results in normal use): a float64 Llama with eager
attention returns NaN logits for every left-padded row of a batch (generate with the dynamic
or the static cache, or one forward).

The eager mask fills masked slots with torch.finfo(float64).min (masking_utils.py:615-617);
eager_attention_forward adds it to the scores and takes the softmax with
dtype=torch.float32 (models/llama/modeling_llama.py:197), which turns -1.8e308 into -inf. A
pad query sees only masked slots: its row is all -inf and its softmax NaN; the pad slot's
NaN keys and values in the next layer then reach every query of that row. sdpa, and eager
in float32, give finite logits equal to the row generated alone.

Run as `python repros/generate_float64_eager_padding_nan.py` (its tiny Llama from
_tiny_llama.py next to it). Exits 1 while the defect is there.
"""

import sys

import torch
from _tiny_llama import PAD, tiny_llama_config
from transformers import LlamaForCausalLM

torch.manual_seed(0)
config = tiny_llama_config(tie_word_embeddings=True)
ids = torch.tensor([[PAD, PAD, 1, 2, 3], [4, 5, 6, 7, 8]])
mask = (ids != PAD).long()
broken = False
for attn, dtype in (("eager", torch.float64), ("eager", torch.float32), ("sdpa", torch.float64)):
    config._attn_implementation = attn
    model = LlamaForCausalLM(config).to(dtype).eval()
    for cache in ("dynamic", "static"):
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=2,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            cache_implementation=cache,
            pad_token_id=PAD,
        )
        nan_rows = [row for row in range(2) if torch.isnan(out.logits[0][row]).any()]
        print(f"{attn:5} {dtype!s:13} {cache:7}: rows with NaN logits: {nan_rows}")
        broken |= bool(nan_rows)
if broken:
    print("DEFECT (class 1): NaN logits for the left-padded row (float64, eager attention)")
    sys.exit(1)
print("fixed: every row finite")
