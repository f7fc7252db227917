"""llama.cpp, class 3 (a deviation from the kit's contract, not a defect): in a unified KV
buffer, llama_memory_seq_add on one sequence also moves the tokens it shares with a copy.

With a unified KV buffer (kv_unified = true, or one sequence per context stream), seq_cp
does not copy cells: it adds the target's id to the source's cells. Each cell has ONE
position, and llama_memory_seq_add(mem, seq, ...) changes it for every sequence in the cell
(llama_kv_cells::pos_add, src/llama-kv-cells.h), so shifting the source shifts the copy too:
the copy's positions move, its keys are re-rotated, and a shift below 0 deletes its tokens.
Without kv_unified (a stream per sequence) seq_cp copies the buffer and the copy stays put.
By design: within one stream "no data copy is necessary, we just have to update the cells meta
data" (llama_kv_cache::seq_cp, src/llama-kv-cache.cpp:464-465); kv_unified is documented as
"a unified buffer across the input sequences" for sequences that "share a large prefix"
(include/llama.h:412-414), and seq_add moves "all tokens that belong to the specified
sequence" (llama.h:782), a shared cell included. The kit's contract treats a copy as
independent of its source, hence the deviation.

Plain llama-cpp-python + gguf + numpy (a tiny random llama, no tokenizer, from _tiny_gguf.py
next to this file). Run as `python repros/llamacpp_shift_moves_copies.py`. Exits 0. Written
for llama-cpp-python 0.3.36 (llama.cpp 0c1e570); not run in this revision (no build here).
"""

import llama_cpp
from _tiny_gguf import fill_batch, load_tiny_llama, write_tiny_llama


def positions_after_shift(model, unified):
    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = 512, 16, 16, 2
    params.kv_unified = unified
    params.type_k = params.type_v = llama_cpp.GGML_TYPE_F32
    ctx = llama_cpp.llama_init_from_model(model, params)
    mem = llama_cpp.llama_get_memory(ctx)
    batch = llama_cpp.llama_batch_init(16, 0, 1)
    fill_batch(batch, (1, 2, 3))  # sequence 0 holds 3 tokens at positions 0..2
    assert llama_cpp.llama_decode(ctx, batch) == 0
    llama_cpp.llama_memory_seq_cp(mem, 0, 1, -1, -1)  # sequence 1: a copy of sequence 0
    llama_cpp.llama_memory_seq_add(mem, 0, 0, -1, 5)  # shift sequence 0 ALONE by +5
    seq1 = (llama_cpp.llama_memory_seq_pos_min(mem, 1), llama_cpp.llama_memory_seq_pos_max(mem, 1))
    llama_cpp.llama_memory_seq_add(mem, 0, 0, -1, -100)  # sequence 0 shifted below 0: dropped
    seq1_after_drop = llama_cpp.llama_memory_seq_pos_max(mem, 1)
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    return seq1, seq1_after_drop


def main():
    model = load_tiny_llama(write_tiny_llama())
    wrong = False
    for unified in (False, True):
        (low, high), after_drop = positions_after_shift(model, unified)
        ok = (low, high) == (0, 2) and after_drop == 2
        wrong |= not ok
        print(
            f"kv_unified={unified}: the copy (sequence 1) holds positions {low}..{high} after "
            f"seq_add(0, +5) (expected 0..2); its last position after sequence 0 is shifted "
            f"below 0: {after_drop} (expected 2) -> {'ok' if ok else 'WRONG'}"
        )
    seen = "seen" if wrong else "no longer seen"
    print(
        f"class 3: deviation from the kit's contract, not a defect ({seen}): a unified buffer "
        "shares a copy's cells with its source by design"
    )


if __name__ == "__main__":
    main()
