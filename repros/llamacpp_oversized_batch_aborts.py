"""llama.cpp: llama_decode aborts the process on a batch larger than n_batch.

llama.h documents llama_decode's return values, "-1 - invalid input batch" among them; a
batch of more tokens than the context's n_batch instead fails GGML_ASSERT(n_tokens_all <=
cparams.n_batch) in llama_context::decode (src/llama-context.cpp), which calls abort(): the
caller's whole process dies (SIGABRT) with no chance to handle it. (n_batch is also capped
at the n_ctx asked for, before n_ctx is rounded up to 256: n_ctx = 8, n_batch = 16 gives 8.)

Plain llama-cpp-python + gguf + numpy (a tiny random llama, no tokenizer): the decode runs
in a child process. Exits 1 while the defect is there. Tested with llama-cpp-python 0.3.36
(llama.cpp 0c1e570).
"""

import ctypes
import os
import subprocess
import sys
import tempfile

import gguf
import llama_cpp
import numpy as np

VOCAB, D, HEADS, FFN = 16, 8, 2, 16


def write_tiny_llama(path):
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "llama")
    for add, value in (
        (w.add_context_length, 256),
        (w.add_embedding_length, D),
        (w.add_block_count, 1),
        (w.add_feed_forward_length, FFN),
        (w.add_head_count, HEADS),
        (w.add_head_count_kv, HEADS),
        (w.add_layer_norm_rms_eps, 1e-6),
        (w.add_rope_freq_base, 10000.0),
        (w.add_vocab_size, VOCAB),
    ):
        add(value)
    w.add_tokenizer_model("none")

    def t(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    w.add_tensor("token_embd.weight", t(VOCAB, D))
    w.add_tensor("output_norm.weight", np.ones(D, np.float32))
    for name, shape in (
        ("attn_norm", (D,)),
        ("ffn_norm", (D,)),
        ("attn_q", (D, D)),
        ("attn_k", (D, D)),
        ("attn_v", (D, D)),
        ("attn_output", (D, D)),
        ("ffn_gate", (FFN, D)),
        ("ffn_up", (FFN, D)),
        ("ffn_down", (D, FFN)),
    ):
        w.add_tensor(
            f"blk.0.{name}.weight", np.ones(shape, np.float32) if len(shape) == 1 else t(*shape)
        )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@llama_cpp.llama_log_callback
def quiet(level, text, data):
    pass


def child(path):
    llama_cpp.llama_log_set(quiet, ctypes.c_void_p())
    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(
        path.encode(), llama_cpp.llama_model_default_params()
    )
    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = 256, 8, 8, 1
    ctx = llama_cpp.llama_init_from_model(model, params)
    batch = llama_cpp.llama_batch_init(16, 0, 1)
    for i in range(12):  # 12 tokens, n_batch 8
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = i % VOCAB, i, 1, 1
        batch.seq_id[i][0] = 0
    batch.n_tokens = 12
    print("llama_decode returned", llama_cpp.llama_decode(ctx, batch), flush=True)


def main():
    if len(sys.argv) > 1:
        child(sys.argv[1])
        return
    path = os.path.join(tempfile.mkdtemp(), "tiny.gguf")
    write_tiny_llama(path)
    run = subprocess.run([sys.executable, __file__, path], capture_output=True, text=True)
    said = [
        line
        for line in (run.stdout + run.stderr).splitlines()
        if "GGML_ASSERT" in line or "returned" in line
    ]
    print(f"child exit status {run.returncode}: {said}")
    if run.returncode != 0:
        print("llama_decode aborted the process instead of returning -1 (invalid input batch)")
        sys.exit(1)


if __name__ == "__main__":
    main()
