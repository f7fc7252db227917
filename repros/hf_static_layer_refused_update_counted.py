"""transformers 5.24.0, class 2 (corrupted state after an error the caller caught):
StaticLayer.update counts the tokens of an update that then fails.

StaticLayer.update adds the new tokens to cumulative_length (cache_utils.py:483) before
index_copy_ writes them (487). When the write fails, the layer counts tokens it never stored.
Through the public API: a StaticCache called with a batch of another size, or past its
max_cache_len, raises in the first layer after that layer has counted. A caller that catches
the error and goes on with a valid call gets wrong logits with no error (the first layer
writes one position too far, beside an unwritten zero row), or, after an overflow, an
IndexError on every call until reset(). DynamicCache, the default, refuses the same calls and
changes nothing. A model with a sliding window does the same with its DynamicCache:
DynamicSlidingWindowLayer.update counts at line 239, before its torch.cat.

Plain transformers and torch (tiny random models). Run as
`python repros/hf_static_layer_refused_update_counted.py`. Exits 1 while the defect is there.
"""

import contextlib
import sys
import warnings

import torch
from transformers import (
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    StaticCache,
)

warnings.filterwarnings("ignore")
torch.manual_seed(0)
tiny = dict(
    vocab_size=32,
    hidden_size=32,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    bos_token_id=None,
    eos_token_id=None,
)
llama_config = LlamaConfig(**tiny)
mistral_config = MistralConfig(**tiny, sliding_window=16)
llama = LlamaForCausalLM(llama_config).eval()
mistral = MistralForCausalLM(mistral_config).eval()
ids = torch.tensor([[1, 2, 3, 4, 5]])


def after_a_refused_batch(model, cache):
    """Prefill 4 tokens, make a refused call with a batch of 2, then feed token 5 validly:
    how far its logits are from the uncached model's, and the layers' lengths."""
    with torch.no_grad():
        full = model(ids).logits[0, -1]
        model(ids[:, :4], past_key_values=cache)
        try:
            model(torch.tensor([[5], [5]]), past_key_values=cache)
            refusal = "accepted"
        except Exception as error:  # the caller catches whatever it raised
            refusal = type(error).__name__
        lengths = [int(layer.get_seq_length()) for layer in cache.layers]
        logits = model(ids[:, 4:], past_key_values=cache).logits[0, -1]
    return refusal, lengths, (logits - full).abs().max().item()


broken = False
for name, model, cache in (
    ("StaticCache", llama, StaticCache(config=llama_config, max_cache_len=8)),
    ("DynamicCache (sliding window)", mistral, DynamicCache(config=mistral_config)),
    ("DynamicCache (full attention)", llama, DynamicCache(config=llama_config)),
):
    refusal, lengths, diff = after_a_refused_batch(model, cache)
    wrong = diff > 1e-4
    broken |= wrong
    print(
        f"{name}: batch of 2 refused ({refusal}); layer lengths now {lengths} (4 held); "
        f"the next valid call's logits differ by {diff:.2g} -> {'WRONG' if wrong else 'ok'}"
    )

cache = StaticCache(config=llama_config, max_cache_len=4)
with torch.no_grad():
    llama(ids[:, :3], past_key_values=cache)
    with contextlib.suppress(IndexError):
        llama(ids[:, 3:5], past_key_values=cache)  # 5 tokens in 4 slots
    lengths = [int(layer.get_seq_length()) for layer in cache.layers]
    try:
        llama(ids[:, 3:4], past_key_values=cache)  # 4 tokens: fits
        after = "accepted"
    except IndexError as error:
        after = f"IndexError: {error}"
        broken = True
print(
    f"StaticCache(max_cache_len=4) after a refused overflow: lengths {lengths} (3 held); "
    f"a call that fits: {after}"
)
if broken:
    print("DEFECT (class 2): after a caught error the cache counts tokens it never stored")
    sys.exit(1)
print("fixed: a refused call leaves the cache as it was")
