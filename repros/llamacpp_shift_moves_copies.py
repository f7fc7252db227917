"""llama.cpp: llama_memory_seq_add on one sequence also moves the tokens it shares with a copy.

With a unified KV buffer (kv_unified = true, or one sequence per context stream), seq_cp
does not copy cells: it adds the target's id to the source's cells. Each cell has ONE
position, and llama_memory_seq_add(mem, seq, ...) changes it for every sequence in the cell
(llama_kv_cells::pos_add, src/llama-kv-cells.h), so shifting the source shifts the copy too:
the copy's positions move, its keys are re-rotated, and a shift below 0 deletes its tokens.
Without kv_unified (a stream per sequence) seq_cp copies the buffer and the copy stays put.

Plain llama-cpp-python + gguf + numpy (a tiny random llama, no tokenizer). Exits 1 while the
defect is there. Tested with llama-cpp-python 0.3.36 (llama.cpp 0c1e570).
"""

import ctypes
import os
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


def positions_after_shift(model, unified):
    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = 512, 16, 16, 2
    params.kv_unified = unified
    params.type_k = params.type_v = llama_cpp.GGML_TYPE_F32
    ctx = llama_cpp.llama_init_from_model(model, params)
    mem = llama_cpp.llama_get_memory(ctx)
    batch = llama_cpp.llama_batch_init(16, 0, 1)
    for i, token in enumerate((1, 2, 3)):  # sequence 0 holds 3 tokens at positions 0..2
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, i, 1, 1
        batch.seq_id[i][0] = 0
    batch.n_tokens = 3
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
    llama_cpp.llama_log_set(quiet, ctypes.c_void_p())
    llama_cpp.llama_backend_init()
    path = os.path.join(tempfile.mkdtemp(), "tiny.gguf")
    write_tiny_llama(path)
    mparams = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(path.encode(), mparams)
    assert model, "the GGUF did not load"
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
    if wrong:
        print("llama_memory_seq_add moved another sequence's tokens (shared KV cells)")
        sys.exit(1)


if __name__ == "__main__":
    main()
