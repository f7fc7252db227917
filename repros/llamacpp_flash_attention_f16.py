"""llama.cpp, class 3 (a deviation from the kit's contract, not a defect): with flash
attention on, an F32 KV cache is attended at F16 precision.

A context asked for type_k = type_v = GGML_TYPE_F32 and flash_attn_type = ENABLED casts its
keys and values to F16 before ggml_flash_attn_ext (src/llama-graph.cpp, build_attn_mha:
"if (k->type == GGML_TYPE_F32) k = ggml_cast(ctx0, k, GGML_TYPE_F16)", the same for v): its
logits are those of an F16 cache, bit for bit, and off from the flash-off F32 context's by
about 1e-3 of the largest logit, where F32 rounding alone gives about 1e-7. By design: the
cast was added so as not to write F32 flash-attention kernels ("We now cast them to F16 to
avoid adding full FA support for F32 types", ggml-org/llama.cpp#12825), and CUDA's F32
support converts to F16 the same way (#16546); the comment above the cast names the case it
was written for (no KV cache, e.g. embeddings). The kit holds an F32 cache to F32's tolerance,
hence the deviation.

Plain llama-cpp-python + gguf + numpy (a tiny random llama, no tokenizer, from _tiny_gguf.py
next to this file). Run as `python repros/llamacpp_flash_attention_f16.py`. Exits 0. Written
for llama-cpp-python 0.3.36 (llama.cpp 0c1e570); not run in this revision (no build here).
"""

import llama_cpp
import numpy as np
from _tiny_gguf import VOCAB, fill_batch, load_tiny_llama, write_tiny_llama


def logits(model, kv_type, flash):
    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = 256, 32, 32, 1
    params.type_k = params.type_v = kv_type
    params.flash_attn_type = (
        llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        if flash
        else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    )
    ctx = llama_cpp.llama_init_from_model(model, params)
    batch = llama_cpp.llama_batch_init(32, 0, 1)
    tokens = np.random.default_rng(1).integers(0, VOCAB, 24)
    fill_batch(batch, tokens)
    assert llama_cpp.llama_decode(ctx, batch) == 0
    out = np.stack(
        [
            np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), shape=(VOCAB,)).copy()
            for i in range(len(tokens))
        ]
    )
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    return out


def main():
    model = load_tiny_llama(write_tiny_llama())
    f32, f16 = llama_cpp.GGML_TYPE_F32, llama_cpp.GGML_TYPE_F16
    exact = logits(model, f32, flash=False)
    flash_f32, flash_f16 = logits(model, f32, flash=True), logits(model, f16, flash=True)
    scale = np.abs(exact).max()
    gap = np.abs(flash_f32 - exact).max() / scale
    same_as_f16 = np.array_equal(flash_f32, flash_f16)
    print(f"flash on, F32 cache vs flash off, F32 cache: {gap:.2e} of the largest logit")
    print(f"flash on, F32 cache == flash on, F16 cache, bit for bit: {same_as_f16}")
    seen = "seen" if gap > 1e-5 or same_as_f16 else "no longer seen"
    print(
        f"class 3: deviation from the kit's contract, not a defect ({seen}): flash attention "
        "computes in F16 by design (ggml-org/llama.cpp#12825)"
    )


if __name__ == "__main__":
    main()
