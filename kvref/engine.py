"""An engine under the kit: the model, not the layer, is the unit (contract, section 13).

Where an engine's cache cannot be reached layer by layer (llama.cpp keeps it in C, behind
``llama_decode`` and its memory operations), the kit drives the whole engine by token ids:
each step is a batch of sequences, each with its own tokens at its own positions, and
between steps the engine's own memory operations remove a span of a sequence, copy one
sequence into another or shift a span's positions. The oracle is the reference model's
uncached pass over what each sequence then holds, its tokens at their positions.

An adapter is built by an ``EngineFactory`` from the reference model (whose weights it
converts into the engine's own format) and an ``EngineSpec``. It offers ``decode`` and
``clear``; ``remove``, ``copy`` and ``shift`` it offers by having them, as a layer cache
offers ``truncate`` (``engine_capabilities``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from kvref.model import ModelConfig, ReferenceTransformer

# The memory operations an engine may offer, by the name of its method.
ENGINE_OPERATIONS = ("remove", "copy", "shift")


@dataclass(frozen=True)
class EngineSpec:
    """What the kit will ask of an engine: sequence ids ``0 .. sequences - 1``, none of them
    holding more than ``max_tokens`` tokens, nor any batch more than ``max_batch`` tokens."""

    sequences: int
    max_tokens: int
    max_batch: int

    def __post_init__(self) -> None:
        for name in ("sequences", "max_tokens", "max_batch"):
            number = getattr(self, name)
            if isinstance(number, bool) or not isinstance(number, int) or number < 1:
                raise ValueError(f"EngineSpec.{name} must be an int >= 1, got {number!r}")


@dataclass(frozen=True)
class Step:
    """One sequence's share of a batch: ``tokens`` at ``positions`` (as many, increasing,
    after every position the sequence holds)."""

    sequence: int
    tokens: tuple[int, ...]
    positions: tuple[int, ...]


@runtime_checkable
class SequenceEngine(Protocol):
    """An engine, driven by token ids."""

    def decode(self, steps: Sequence[Step]) -> list[Tensor]:
        """Evaluate one batch, every step in it at once: for each step, in order, the logits
        of its tokens, shaped (len(step.tokens), vocab). Each sequence's new tokens attend to
        what that sequence holds and to one another, causally by position; they then stay
        held (``llama_decode`` with a logit for every token)."""
        ...

    def clear(self) -> None:
        """Forget every sequence (``llama_memory_clear``)."""
        ...

    # Offered by having them (``engine_capabilities``):
    #
    # def remove(self, sequence: int, start: int, end: int | None) -> None:
    #     """Drop the sequence's tokens at positions [start, end); None: to its end
    #     (``llama_memory_seq_rm``). What is left keeps its positions."""
    #
    # def copy(self, source: int, target: int) -> None:
    #     """Make the empty sequence ``target`` hold what ``source`` holds, at the same
    #     positions (``llama_memory_seq_cp(source, target, -1, -1)``); the two then go on
    #     apart."""
    #
    # def shift(self, sequence: int, start: int, end: int | None, delta: int) -> None:
    #     """Add ``delta`` to the positions of the sequence's tokens in [start, end); None: to
    #     its end (``llama_memory_seq_add``). Their keys then attend as if computed there."""


EngineFactory = Callable[[ReferenceTransformer, EngineSpec], SequenceEngine]


def engine_capabilities(engine: object) -> frozenset[str]:
    """The memory operations ``engine`` offers: those of ``ENGINE_OPERATIONS`` it has."""
    return frozenset(name for name in ENGINE_OPERATIONS if callable(getattr(engine, name, None)))


def not_llama(config: ModelConfig) -> list[str]:
    """The settings of ``config`` that a Llama (llama.cpp's "llama" architecture,
    transformers' ``LlamaForCausalLM``) has no equivalent of: empty where a Llama given the
    reference model's weights computes what it computes."""
    unsupported = {
        "ffn": config.ffn != "swiglu",
        "window": config.window is not None,
        "attention": config.attention != "gqa",
        "kv_sources": config.kv_sources is not None,
        "hidden": config.hidden is not None,
    }
    return [name for name, bad in unsupported.items() if bad]


def logits_of(engine_logits: object, step: Step, vocab: int) -> Tensor:
    """``engine_logits`` as the kit judges it: a float tensor shaped (tokens, vocab), or a
    ``TypeError``/``ValueError`` naming what the engine returned instead."""
    if not isinstance(engine_logits, Tensor):
        raise TypeError(f"decode returned {type(engine_logits).__name__}, not a torch.Tensor")
    expected = (len(step.tokens), vocab)
    if tuple(engine_logits.shape) != expected or not engine_logits.is_floating_point():
        raise ValueError(
            f"decode returned logits shaped {tuple(engine_logits.shape)} "
            f"({engine_logits.dtype}) for sequence {step.sequence}, expected {expected} floats"
        )
    return engine_logits.to(torch.float64)
