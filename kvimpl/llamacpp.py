"""llama.cpp, through llama-cpp-python's low-level API, as a ``kvref.engine.SequenceEngine``.

Tested with llama-cpp-python 0.3.36 (vendored llama.cpp commit 0c1e570, "0.5.0-dev"), gguf
0.19.0, torch 2.13.0, CPU. Run the kit on it with ``class TestMine(EngineTests): engine =
kvimpl.llamacpp.engine`` (contract, section 13).

The reference model's own weights are written into a GGUF file of llama.cpp's "llama"
architecture (``write_gguf``): float32 tensors, no tokenizer (``tokenizer.ggml.model`` =
"none", ``llama.vocab_size`` dummy tokens), the output embedding tied (no ``output.weight``:
llama.cpp then uses ``token_embd.weight``), the query and key rows permuted as
convert_hf_to_gguf does (our RoPE pairs channel i with i + D/2, llama.cpp's "llama" rope pairs
2i with 2i + 1). The file is written once per model (its config and weights) into a temporary
directory, and loaded once per file.

An engine is one ``llama_context`` built from the ``EngineSpec``: ``n_seq_max`` = the spec's
sequences, ``n_ctx`` = sequences x max_tokens (llama.cpp rounds each sequence's stream up to
a multiple of 256 cells; one buffer for all with ``kv_unified``), ``n_batch`` = ``n_ubatch``
= max_batch, K and V cached in F32 (``type_k``/``type_v``; ``kv_type="f16"`` for llama.cpp's
default), flash attention off (``flash_attn="on"`` to try it), one thread. Known defects
(docs/found-in-the-wild.md): with ``kv_unified`` a shift of one sequence moves its copies;
flash attention attends an F32 cache at F16; a batch over n_batch aborts the process.

- ``decode(steps)`` -> one ``llama_batch`` of this call's tokens, every step's with its
  sequence id and position and ``logits[i] = 1``, one ``llama_decode``, and then each token's
  row of ``llama_get_logits_ith``. A non-zero return of ``llama_decode`` is raised as a
  ``RuntimeError`` with the return code and llama.cpp's last logged warnings and errors.
  (A step's tokens and positions are zipped strictly: a Step of unequal lengths is the kit's
  malformed input, not llama.cpp's.)
- ``clear()`` -> ``llama_memory_clear(mem, True)``.
- ``remove(s, start, end)`` -> ``llama_memory_seq_rm(mem, s, start, end or -1)``; a False
  return is raised as a ``RuntimeError``.
- ``copy(src, dst)`` -> ``llama_memory_seq_cp(mem, src, dst, -1, -1)``.
- ``shift(s, start, end, delta)`` -> ``llama_memory_seq_add(mem, s, start, end or -1, delta)``.

The adapter validates nothing and keeps no state of its own besides the llama.cpp handles: it
converts at the boundary only (the token ids and positions into the batch's C arrays, each
float32 logit row out of llama.cpp's buffer into a new float32 torch tensor, which is a copy
because llama.cpp overwrites that buffer at the next decode). Whatever llama.cpp accepts,
computes, refuses or returns is what the kit sees.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import tempfile
from collections.abc import Sequence

try:
    import gguf
    import llama_cpp
except ImportError as error:  # llama-cpp-python and gguf are an optional extra
    raise ImportError(
        "kvimpl.llamacpp drives llama.cpp through llama-cpp-python and writes GGUF files "
        "with gguf, which are not installed: pip install 'kvcache-verify[llamacpp]'"
    ) from error

import numpy as np
import torch
from torch import Tensor

from kvref.engine import EngineSpec, Step, not_llama
from kvref.model import ReferenceTransformer

TESTED_WITH = "0.3.36"
LLAMA_CPP_PYTHON_VERSION = llama_cpp.__version__

KV_TYPES = {"f32": llama_cpp.GGML_TYPE_F32, "f16": llama_cpp.GGML_TYPE_F16}
FLASH_ATTN = {
    "off": llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED,
    "on": llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
}

_DIR = tempfile.mkdtemp(prefix="kvimpl-llamacpp-")
_FILES: dict[str, str] = {}  # model digest -> GGUF path
_MODELS: dict[str, object] = {}  # GGUF path -> llama_model pointer (kept for the process)
_ERRORS: list[str] = []  # llama.cpp's last error lines, for the message of a failed call


GGML_LOG_LEVEL_WARN, GGML_LOG_LEVEL_ERROR = 3, 4  # ggml.h's ggml_log_level (not in llama_cpp)


@llama_cpp.llama_log_callback
def _log(level, text, user_data):  # llama.cpp logs to stderr otherwise; keep warnings, errors
    if level in (GGML_LOG_LEVEL_WARN, GGML_LOG_LEVEL_ERROR):
        _ERRORS.append(text.decode(errors="replace").rstrip())
        del _ERRORS[:-8]


llama_cpp.llama_log_set(_log, ctypes.c_void_p())
llama_cpp.llama_backend_init()


def permute_rope_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Rows of a query or key projection, reordered per head from our RoPE layout (channel i
    with i + D/2) to llama.cpp's (2i with 2i + 1), as convert_hf_to_gguf's ``permute``."""
    out_rows = weight.shape[0]
    return (
        weight.reshape(heads, 2, out_rows // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _digest(model: ReferenceTransformer) -> str:
    h = hashlib.sha256(repr(model.config).encode())
    for name, tensor in model.state_dict().items():
        h.update(name.encode())
        h.update(tensor.detach().to(torch.float32).cpu().numpy().tobytes())
    return h.hexdigest()[:20]


def write_gguf(model: ReferenceTransformer, path: str, context_length: int = 1 << 16) -> None:
    """Write ``model`` (a "gqa" model, ``ffn="swiglu"``, no window) as a llama GGUF file."""
    c = model.config
    if named := not_llama(c):  # written anyway, the file would compute another model
        raise ValueError(
            f"llama.cpp's llama architecture has no equivalent of this reference model "
            f'({", ".join(named)}): it needs ModelConfig(ffn="swiglu") with plain GQA'
        )
    weights = {
        name: tensor.detach().to(torch.float32).cpu().numpy()
        for name, tensor in model.state_dict().items()
    }
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(context_length)
    writer.add_embedding_length(c.d_model)
    writer.add_block_count(c.num_layers)
    writer.add_feed_forward_length(c.ffn_dim)
    writer.add_head_count(c.num_heads)
    writer.add_head_count_kv(c.num_kv_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_rope_freq_base(c.rope_base)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(c.vocab_size)
    writer.add_tokenizer_model("none")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tensor("token_embd.weight", weights["embedding.weight"])
    writer.add_tensor("output_norm.weight", weights["final_norm.weight"])
    for n in range(c.num_layers):
        p, b = f"blocks.{n}.", f"blk.{n}."
        query = permute_rope_rows(weights[p + "attention.query.weight"], c.num_heads)
        key = permute_rope_rows(weights[p + "attention.key.weight"], c.num_kv_heads)
        for gguf_name, array in (
            ("attn_norm", weights[p + "attention_norm.weight"]),
            ("attn_q", query),
            ("attn_k", key),
            ("attn_v", weights[p + "attention.value.weight"]),
            ("attn_output", weights[p + "attention.out.weight"]),
            ("ffn_norm", weights[p + "ffn_norm.weight"]),
            ("ffn_gate", weights[p + "ffn_gate.weight"]),
            ("ffn_up", weights[p + "ffn_in.weight"]),
            ("ffn_down", weights[p + "ffn_out.weight"]),
        ):
            writer.add_tensor(f"{b}{gguf_name}.weight", np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def gguf_path(model: ReferenceTransformer) -> str:
    """The GGUF file of ``model``, written on first use."""
    digest = _digest(model)
    if digest not in _FILES:
        path = os.path.join(_DIR, f"{digest}.gguf")
        write_gguf(model, path)
        _FILES[digest] = path
    return _FILES[digest]


def load_model(path: str):
    """``llama_model_load_from_file`` (CPU), once per file."""
    if path not in _MODELS:
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = 0
        loaded = llama_cpp.llama_model_load_from_file(path.encode(), params)
        if not loaded:
            raise RuntimeError(f"llama_model_load_from_file({path!r}) failed: {_ERRORS[-3:]}")
        _MODELS[path] = loaded
    return _MODELS[path]


class LlamaCppEngine:
    """One ``llama_context`` over the reference model's weights (module docstring)."""

    def __init__(
        self,
        model: ReferenceTransformer,
        spec: EngineSpec,
        *,
        kv_type: str = "f32",
        flash_attn: str = "off",
        kv_unified: bool = False,
        n_ctx: int | None = None,
        n_ubatch: int | None = None,
        threads: int = 1,
    ) -> None:
        self.vocab = model.config.vocab_size
        self.model = load_model(gguf_path(model))
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = spec.sequences * spec.max_tokens if n_ctx is None else n_ctx
        params.n_batch = spec.max_batch
        params.n_ubatch = spec.max_batch if n_ubatch is None else n_ubatch
        params.n_seq_max = spec.sequences
        params.n_threads = params.n_threads_batch = threads
        params.type_k = params.type_v = KV_TYPES[kv_type]
        params.flash_attn_type = FLASH_ATTN[flash_attn]
        params.kv_unified = kv_unified
        params.no_perf = True
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError(f"llama_init_from_model failed: {_ERRORS[-3:]}")
        self.mem = llama_cpp.llama_get_memory(self.ctx)

    def decode(self, steps: Sequence[Step]) -> list[Tensor]:
        # A batch the size of this call's tokens, so that no size of the adapter's own
        # limits what llama.cpp is given (its n_batch is its own to enforce).
        total = sum(len(step.tokens) for step in steps)
        batch = llama_cpp.llama_batch_init(max(total, 1), 0, 1)
        try:
            i = 0
            for step in steps:
                for token, position in zip(step.tokens, step.positions, strict=True):
                    batch.token[i] = token
                    batch.pos[i] = position
                    batch.n_seq_id[i] = 1
                    batch.seq_id[i][0] = step.sequence
                    batch.logits[i] = 1
                    i += 1
            batch.n_tokens = i
            del _ERRORS[:]
            code = llama_cpp.llama_decode(self.ctx, batch)
        finally:
            llama_cpp.llama_batch_free(batch)
        if code != 0:
            raise RuntimeError(f"llama_decode returned {code}: {' | '.join(_ERRORS[-3:])}")
        out, i = [], 0
        for step in steps:
            rows = []
            for _ in step.tokens:
                row = llama_cpp.llama_get_logits_ith(self.ctx, i)
                rows.append(np.ctypeslib.as_array(row, shape=(self.vocab,)).copy())
                i += 1
            out.append(torch.from_numpy(np.stack(rows) if rows else np.zeros((0, self.vocab))))
        return out

    def clear(self) -> None:
        llama_cpp.llama_memory_clear(self.mem, True)

    def remove(self, sequence: int, start: int, end: int | None) -> None:
        if not llama_cpp.llama_memory_seq_rm(self.mem, sequence, start, -1 if end is None else end):
            raise RuntimeError(f"llama_memory_seq_rm({sequence}, {start}, {end}) returned false")

    def copy(self, source: int, target: int) -> None:
        llama_cpp.llama_memory_seq_cp(self.mem, source, target, -1, -1)

    def shift(self, sequence: int, start: int, end: int | None, delta: int) -> None:
        llama_cpp.llama_memory_seq_add(self.mem, sequence, start, -1 if end is None else end, delta)

    def __del__(self) -> None:
        if getattr(self, "ctx", None):
            llama_cpp.llama_free(self.ctx)
            self.ctx = None


def engine(model: ReferenceTransformer, spec: EngineSpec) -> LlamaCppEngine:
    """The ``EngineFactory``: F32 K/V, flash attention off, one stream per sequence."""
    return LlamaCppEngine(model, spec)


def engine_f16(model: ReferenceTransformer, spec: EngineSpec) -> LlamaCppEngine:
    """llama.cpp's default K/V type, F16 (lossy: see docs/found-in-the-wild.md)."""
    return LlamaCppEngine(model, spec, kv_type="f16")


def engine_flash(model: ReferenceTransformer, spec: EngineSpec) -> LlamaCppEngine:
    """F32 K/V with flash attention on."""
    return LlamaCppEngine(model, spec, flash_attn="on")


def engine_unified(model: ReferenceTransformer, spec: EngineSpec) -> LlamaCppEngine:
    """F32 K/V in one buffer shared by every sequence (``kv_unified``)."""
    return LlamaCppEngine(model, spec, kv_unified=True)
