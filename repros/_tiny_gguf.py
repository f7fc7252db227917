"""The tiny random llama the llamacpp_*.py repros run, and their llama.cpp set-up.

Not a repro: the llamacpp_*.py scripts next to it import it (run as `python
repros/<name>.py`, the script's directory is on sys.path). Plain llama-cpp-python + gguf +
numpy, no kit: one block, no tokenizer, weights drawn from a fixed seed.
"""

import ctypes
import os
import tempfile

import gguf
import llama_cpp
import numpy as np

VOCAB, D, HEADS, FFN = 16, 8, 2, 16


def write_tiny_llama():
    """Write the tiny llama as a GGUF in a fresh temporary directory and return its path."""
    path = os.path.join(tempfile.mkdtemp(), "tiny.gguf")
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
    return path


@llama_cpp.llama_log_callback
def quiet(level, text, data):
    pass


def load_tiny_llama(path):
    """Silence llama.cpp's log, start its backend and load the GGUF at path."""
    llama_cpp.llama_log_set(quiet, ctypes.c_void_p())
    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(
        path.encode(), llama_cpp.llama_model_default_params()
    )
    assert model, "the GGUF did not load"
    return model


def fill_batch(batch, tokens):
    """Put tokens in batch at positions 0, 1, ... of sequence 0, each asking for its logits."""
    for i, token in enumerate(tokens):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = int(token), i, 1, 1
        batch.seq_id[i][0] = 0
    batch.n_tokens = len(tokens)
