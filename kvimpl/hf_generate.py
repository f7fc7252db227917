"""Hugging Face transformers' generation path, driven as an engine (contract, section 13).

Tested with transformers 5.24.0 (torch 2.13.0, CPU). Two things live here:

- ``llama_from_reference(model)``: a ``transformers.LlamaForCausalLM`` built from a small
  ``LlamaConfig`` (no hub download) that computes what the reference model computes, its
  weights copied in by name (a reference model with ``ModelConfig(ffn="swiglu")`` and plain
  GQA, no window, sinks, latent or shared layers: the Llama transformers has). Both use the
  rotate-half RoPE layout, so no row is permuted. transformers computes RMSNorm, RoPE and
  the softmax in float32 whatever the model's dtype, so even a float64 Llama is
  float32-accurate (about 3e-6 from the float64 oracle): it is judged at float32's tolerance.
- ``HFGenerateEngine`` (sdpa attention, transformers' default) and ``HFGenerateEngineEager``:
  ``kvref.engine.SequenceEngine``s over that model in float32 with one ``DynamicCache`` per
  sequence, what ``generate`` builds. ``decode`` runs one ``forward`` per step, the step's
  tokens as ``input_ids`` (batch 1), its positions as ``position_ids`` and the sequence's
  cache as ``cache`` (5.x's name for ``past_key_values``), and returns the logits the model
  returns; ``clear`` forgets the caches. ``HFGenerateEngineCrop`` adds ``remove`` of a
  sequence's tail as ``DynamicCache.crop(-rows)``, the call assisted generation rolls back
  with. transformers has no call to drop a middle span, copy or shift a cache, so no engine
  here offers copy or shift, and a remove that is not of a tail raises
  ``NotImplementedError`` (the adapter does not approximate it).

No validation of its own: the adapters convert at the boundary only (the weights into the
HF model's dtype; the step's ints into ``torch.long`` tensors on its device; the logits come
back as the model returns them). Nothing is checked, copied, clamped or cast besides, so
every wrong logit the kit reports is transformers' own. Positions are passed as given (RoPE
reads them); the causal mask is transformers' own, built by slot in the cache (the query's
offset is the cache's length), which is the kit's mask by position while a sequence's
positions increase, as every step's do. The one piece of state besides the caches, in
``HFGenerateEngineCrop`` alone, is the positions each sequence's rows were given, to turn
``remove``'s position into ``crop``'s count of rows.
"""

from __future__ import annotations

try:
    import transformers
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
except ImportError as error:  # transformers is an optional extra of this project
    raise ImportError(
        "kvimpl.hf_generate drives Hugging Face transformers' generation path, which is not "
        "installed: pip install 'kvcache-verify[hf]'"
    ) from error

from collections.abc import Sequence

import torch
from torch import Tensor

from kvref.engine import EngineSpec, Step, not_llama
from kvref.model import ReferenceTransformer

TESTED_WITH = "5.24.0"
TRANSFORMERS_VERSION = transformers.__version__


def llama_config_of(model: ReferenceTransformer, **overrides) -> LlamaConfig:
    """The ``LlamaConfig`` of the Llama that computes what ``model`` computes."""
    c = model.config
    if named := not_llama(c):
        raise ValueError(
            f"transformers' Llama has no equivalent of this reference model ({', '.join(named)}):"
            f' it needs ModelConfig(ffn="swiglu") with plain GQA and nothing else set'
        )
    settings = dict(
        vocab_size=c.vocab_size,
        hidden_size=c.d_model,
        intermediate_size=c.ffn_dim,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        hidden_act="silu",
        max_position_embeddings=4096,
        rms_norm_eps=model.final_norm.eps,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_base},
        attention_bias=False,
        mlp_bias=False,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )
    settings.update(overrides)
    return LlamaConfig(**settings)


# transformers' parameter name -> the reference model's, per layer and for the whole model.
_LAYER_NAMES = {
    "input_layernorm.weight": "attention_norm.weight",
    "self_attn.q_proj.weight": "attention.query.weight",
    "self_attn.k_proj.weight": "attention.key.weight",
    "self_attn.v_proj.weight": "attention.value.weight",
    "self_attn.o_proj.weight": "attention.out.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_in.weight",
    "mlp.down_proj.weight": "ffn_out.weight",
}


def hf_name_map(num_layers: int) -> dict[str, str]:
    """Every parameter of the HF Llama, named as the reference model names it."""
    names = {
        "model.embed_tokens.weight": "embedding.weight",
        "model.norm.weight": "final_norm.weight",
    }
    for layer in range(num_layers):
        for hf, ours in _LAYER_NAMES.items():
            names[f"model.layers.{layer}.{hf}"] = f"blocks.{layer}.{ours}"
    return names


@torch.no_grad()
def llama_from_reference(
    model: ReferenceTransformer,
    *,
    dtype: torch.dtype | None = None,
    attn_implementation: str = "sdpa",
    **overrides,
) -> LlamaForCausalLM:
    """A ``LlamaForCausalLM`` holding ``model``'s weights, in ``dtype`` (None: the model's),
    on its device, in eval mode, with ``attn_implementation`` ("sdpa", what transformers
    picks by default, or "eager"); ``overrides`` go to its ``LlamaConfig``."""
    config = llama_config_of(model, **overrides)
    config._attn_implementation = attn_implementation
    hf = LlamaForCausalLM(config).to(dtype=dtype or model.dtype, device=model.device)
    ours = dict(model.named_parameters())
    names = hf_name_map(model.config.num_layers)
    theirs = dict(hf.named_parameters())
    untied = set(theirs) - set(names) - {"lm_head.weight"}
    if untied:
        raise RuntimeError(
            f"parameters of transformers' Llama with no counterpart: {sorted(untied)}"
        )
    for hf_name, our_name in names.items():
        theirs[hf_name].copy_(ours[our_name])
    if hf.lm_head.weight.data_ptr() != hf.model.embed_tokens.weight.data_ptr():
        raise RuntimeError("transformers did not tie lm_head to the embedding")
    return hf.eval()


class HFGenerateEngine:
    """transformers' Llama with a ``DynamicCache`` per sequence (module docstring): decode
    and clear, no memory operation."""

    dtype = torch.float32  # what users run it in; the kit judges it at float32's tolerance
    attn_implementation = "sdpa"

    def __init__(self, model: ReferenceTransformer, spec: EngineSpec) -> None:
        self.spec = spec
        self.hf = llama_from_reference(
            model, dtype=self.dtype, attn_implementation=self.attn_implementation
        )
        self.caches: dict[int, DynamicCache] = {}

    @torch.no_grad()
    def decode(self, steps: Sequence[Step]) -> list[Tensor]:
        logits = []
        device = self.hf.device
        for step in steps:
            cache = self.caches.setdefault(step.sequence, DynamicCache(config=self.hf.config))
            tokens = torch.tensor([step.tokens], dtype=torch.long, device=device)
            positions = torch.tensor([step.positions], dtype=torch.long, device=device)
            out = self.hf(input_ids=tokens, position_ids=positions, cache=cache, use_cache=True)
            self.held(step)
            logits.append(out.logits[0])
        return logits

    def held(self, step: Step) -> None:
        """Where the engine keeps books of positions (``HFGenerateEngineCrop``), it notes the
        step's; this one keeps none."""

    def clear(self) -> None:
        self.caches.clear()


class HFGenerateEngineEager(HFGenerateEngine):
    """The same, with transformers' eager attention (its own softmax, its own mask)."""

    attn_implementation = "eager"


class HFGenerateEngineCrop(HFGenerateEngine):
    """The same, offering ``remove`` of a sequence's tail as ``DynamicCache.crop``, the call
    assisted generation rolls back its rejected candidates with. A middle or head span
    raises ``NotImplementedError``: transformers has no call for it (an adapter limit)."""

    def __init__(self, model: ReferenceTransformer, spec: EngineSpec) -> None:
        super().__init__(model, spec)
        # The positions each sequence's cache rows were given, in order: what turns the kit's
        # remove (by position) into crop (a count of rows). transformers keeps no positions
        # in a cache (its mask is by slot), so this is the boundary's conversion.
        self.positions: dict[int, list[int]] = {}

    def held(self, step: Step) -> None:
        self.positions.setdefault(step.sequence, []).extend(step.positions)

    def remove(self, sequence: int, start: int, end: int | None) -> None:
        held = self.positions.get(sequence, [])
        if end is not None and any(position >= end for position in held):
            raise NotImplementedError(
                "transformers' DynamicCache can only crop its tail (a remove up to its end)"
            )
        removed = sum(position >= start for position in held)
        if removed:
            # crop takes the number of rows to drop, negated (transformers 5.24.0).
            self.caches[sequence].crop(-removed)
            del held[-removed:]

    def clear(self) -> None:
        super().clear()
        self.positions.clear()


__all__ = [
    "TESTED_WITH",
    "TRANSFORMERS_VERSION",
    "HFGenerateEngine",
    "HFGenerateEngineCrop",
    "HFGenerateEngineEager",
    "hf_name_map",
    "llama_config_of",
    "llama_from_reference",
]
