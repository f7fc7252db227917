"""llama.cpp, class 1 (normal use of the public API kills the process): llama_decode aborts
on a batch larger than the context's n_batch, and n_batch can be smaller than asked for.

llama.h documents llama_decode's return values, "-1 - invalid input batch" among them; a
batch of more tokens than the context's n_batch instead fails GGML_ASSERT(n_tokens_all <=
cparams.n_batch) in llama_context::decode (src/llama-context.cpp), which calls abort(): the
caller's whole process dies (SIGABRT) with no chance to handle it, where every other
invalid batch returns -1. n_batch is documented as the "logical maximum batch size that can
be submitted to llama_decode" (llama.h:367), but llama_init_from_model caps it at the n_ctx
asked for (src/llama-context.cpp:246) before it rounds n_ctx up to 256 (line 290): n_ctx = 8,
n_batch = 16 gives a 256-token context whose n_batch is 8, so a caller that checks its batches
against the n_batch it set (here 12 tokens against 16) is aborted.

Plain llama-cpp-python + gguf + numpy (a tiny random llama, no tokenizer, from _tiny_gguf.py
next to this file): the decode runs in a child process, this script run again with the GGUF's
path. Run as `python repros/llamacpp_oversized_batch_aborts.py`. Exits 1 while the defect is
there. Written for llama-cpp-python 0.3.36 (llama.cpp 0c1e570); not run in this revision (no
build here).
"""

import subprocess
import sys

import llama_cpp
from _tiny_gguf import VOCAB, fill_batch, load_tiny_llama, write_tiny_llama


def child(path):
    model = load_tiny_llama(path)
    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = 8, 16, 16, 1
    ctx = llama_cpp.llama_init_from_model(model, params)
    batch = llama_cpp.llama_batch_init(16, 0, 1)
    print("n_ctx", llama_cpp.llama_n_ctx(ctx), "n_batch", llama_cpp.llama_n_batch(ctx), flush=True)
    fill_batch(batch, [i % VOCAB for i in range(12)])  # 12 tokens: within the n_batch asked for
    print("llama_decode returned", llama_cpp.llama_decode(ctx, batch), flush=True)


def main():
    if len(sys.argv) > 1:
        child(sys.argv[1])
        return
    path = write_tiny_llama()
    run = subprocess.run([sys.executable, __file__, path], capture_output=True, text=True)
    said = [
        line
        for line in (run.stdout + run.stderr).splitlines()
        if "GGML_ASSERT" in line or "returned" in line or "n_batch" in line
    ]
    print(f"child exit status {run.returncode}: {said}")
    if run.returncode != 0:
        print("DEFECT (class 1): llama_decode aborted the process instead of returning -1")
        sys.exit(1)
    print("fixed: llama_decode returned instead of aborting")


if __name__ == "__main__":
    main()
