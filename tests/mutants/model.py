"""Broken models: patches of the reference model, each with exactly one bug, run on a
correct cache.

Each is a context manager that patches a function or class attribute of ``kvref.model``, or
of the module beside it where the model looks the name up (``kvref.rope``, ``kvref.shared``),
so the models ``kvcheck.tensors.build_model`` keeps are affected too, and undoes the patch
on exit. Only cached calls are wrong: with no caches, every patched path computes what the
unpatched model does, so the uncached oracle stays right.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from unittest import mock

import torch
from torch import Tensor

from kvref import LayerCache, model, rope, shared, varlen


@contextmanager
def mask_from_chunk_start() -> Iterator[None]:
    """The causal mask is a lower triangle over the chunk alone, as if it started at 0.

    Stands for ``tril(ones(T, T))`` padded to the keys: a one-token decode step on a warm
    cache sees only key 0. Prefill and uncached calls start at 0, so they cannot show it.
    """
    original = model.causal_mask

    def from_chunk_start(
        query_positions: Tensor, key_positions: Tensor, window: int | None = None, sink_end=None
    ) -> Tensor:
        return original(query_positions - query_positions[0], key_positions, window, sink_end)

    with mock.patch.object(model, "causal_mask", from_chunk_start):
        yield


@contextmanager
def rope_restarts_at_zero() -> Iterator[None]:
    """New tokens are rotated from position 0 instead of the cache's length.

    Stands for forgetting the position offset in RoPE: queries ask the wrong relative-position
    question although the cache holds the right keys.
    """
    original = rope.apply_rope

    def restarted(x: Tensor, positions: Tensor, base: float) -> Tensor:
        return original(x, positions - positions[0], base)

    # Every module of the reference that rotates: the model's layers, the re-rotation of a
    # shift (kvref.rope) and the varlen path's unrotated keys (kvref.varlen).
    with ExitStack() as patches:
        for module in (model, rope, varlen):
            patches.enter_context(mock.patch.object(module, "apply_rope", restarted))
        yield


@contextmanager
def rotates_held_keys_again() -> Iterator[None]:
    """Rotates every key the cache returns by its position, though they are stored rotated.

    Stands for models that rotate keys after reading the cache as well as before writing it:
    positions 1 and up are rotated twice.
    """
    original = model.Attention.forward

    def forward(
        self: model.Attention,
        x: Tensor,
        positions: Tensor,
        cache: LayerCache | None,
        rows=None,
        first: int = 0,
        keys: str = "rotated",
    ):
        if cache is not None:
            cache = _RotatingReads(cache, self.config.rope_base)
        return original(self, x, positions, cache, rows, first, keys)

    with mock.patch.object(model.Attention, "forward", forward):
        yield


class _RotatingReads:
    """Passes appends to ``cache`` and rotates the keys it returns (for the mutant above)."""

    def __init__(self, cache: LayerCache, base: float) -> None:
        self.cache, self.base = cache, base

    @property
    def length(self) -> int:
        return self.cache.length

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        keys, values = self.cache.append(key, value)
        positions = torch.arange(keys.shape[2], device=keys.device)
        return rope.apply_rope(keys, positions, self.base), values


@contextmanager
def feeds_prompt_again() -> Iterator[None]:
    """Each decode step feeds the prompt again alongside the cache, returning only the logits
    of the new tokens.

    Stands for a generate loop that passes the whole prompt with an existing cache: the
    prompt is duplicated in the cache and positions shift, while the shapes the caller sees
    stay right.
    """
    original = model.ReferenceTransformer.forward
    prompt: list[Tensor] = []  # the last cold call's tokens

    def forward(self: model.ReferenceTransformer, token_ids: Tensor, caches=None, **kw) -> Tensor:
        if caches is None:
            return original(self, token_ids, **kw)  # uncached calls are the oracle's: right
        if caches[0].length == 0:
            prompt[:] = [token_ids]
            return original(self, token_ids, caches)
        fed = torch.cat((prompt[0], token_ids), dim=1)
        return original(self, fed, caches)[:, -token_ids.shape[1] :]

    with mock.patch.object(model.ReferenceTransformer, "forward", forward):
        yield


@contextmanager
def reader_after_the_append() -> Iterator[None]:
    """A layer that reads another layer's cache puts its queries at the source's length
    after this step's append, not before it: a chunk of T tokens sits T positions late.

    Stands for cross-layer KV sharing reading the shared cache's offset after the source
    layer advanced it (mlx-lm 1702; vllm 43185's class): token-by-token decode is off by
    one position, a chunked prefill by its chunk, and the uncached pass, which has no cache
    to read an offset from, is right.
    """

    def after(self: shared.SharedRows) -> int:
        return self.length

    with mock.patch.object(shared.SharedRows, "offset", property(after)):
        yield


MODEL_MUTANTS = (
    mask_from_chunk_start,
    rope_restarts_at_zero,
    rotates_held_keys_again,
    feeds_prompt_again,
    reader_after_the_append,
)
