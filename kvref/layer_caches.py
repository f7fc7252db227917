"""Operations on every layer's cache at once: a rollback (``truncate``), a context shift
(``shift``) and a beam search's reorder (``reorder``), as the reference model offers them.

Each checks every layer's cache and its arguments before it touches any layer, so that a
refusal leaves every layer as it was; where a window layer may lawfully refuse, the layers
are asked widest window first (``widest_window_first``), so that such a refusal too comes
before any layer changed.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from kvref.checks import check_reorder, check_shift, check_truncate, is_row_shift
from kvref.guards import check_caches, check_offered, checked_row_shift
from kvref.protocol import CacheSpec, LayerCache


def truncate_every_layer(model: nn.Module, caches: Sequence[LayerCache], length: int) -> None:
    """Forget every token at position >= ``length`` in every layer's cache of ``model``
    (speculative decoding, regenerate). Checks the caches and ``length`` before touching any
    layer.

    A window layer may refuse when it has dropped a position that the next query needs;
    the widest windows are asked first, so that such a refusal comes before any layer
    changed (layers of one window keep the same positions)."""
    held = check_caches(model, caches, batch=None)
    check_offered(caches, "truncate")
    if isinstance(length, bool) or not isinstance(length, int):
        raise TypeError(f"truncate: length must be an int, got {type(length).__name__}")
    check_truncate(held, length)
    for layer in widest_window_first(model.config):
        caches[layer].truncate(length)


def shift_every_layer(model: nn.Module, caches: Sequence[LayerCache], start, count) -> None:
    """Discard the tokens of indices ``start`` to ``start + count - 1`` in every layer's
    cache and move the later ones down (a context shift, contract section 8.4); with a
    tuple each, row b's ``start[b]`` and ``count[b]`` (a shift per row). Checks the caches
    and the span before touching any layer; a window layer may refuse where the next
    query needs a row it was not bound to keep, the widest asked first."""
    if is_row_shift(start, count):
        start, count = checked_row_shift(model, caches, start, count)
    else:
        held = check_caches(model, caches, batch=None)
        check_offered(caches, "shift")
        check_shift(held, start, count)
    for layer in widest_window_first(model.config):
        caches[layer].shift(start, count)


def reorder_every_layer(model: nn.Module, caches: Sequence[LayerCache], indices: Tensor) -> None:
    """Batch row b of every layer's cache of ``model`` becomes the old row ``indices[b]`` (beam
    search). Checks the caches and ``indices`` before touching any layer."""
    check_caches(model, caches, batch=None)
    check_offered(caches, "reorder")
    if not isinstance(indices, Tensor):
        raise TypeError(f"reorder: indices must be a torch.Tensor, got {type(indices).__name__}")
    # The batch a cache's spec says, else the one the indices imply.
    specs = [getattr(caches[layer], "spec", None) for layer in model.config.cache_layers]
    batches = {spec.batch for spec in specs if isinstance(spec, CacheSpec)}
    batch = batches.pop() if len(batches) == 1 else indices.numel()
    check_reorder(model.cache_spec(batch, 1), indices)
    for layer in model.config.cache_layers:
        caches[layer].reorder(indices)


def widest_window_first(config) -> list[int]:
    """The layers of a model of ``config`` that have a cache of their own, widest window
    first and global layers last: a window layer that must refuse a rollback or a shift then
    refuses before any layer changed (layers of one window keep the same positions, and a
    global layer never needs to refuse)."""
    windows = [config.layer_window(layer) for layer in range(config.num_layers)]
    return sorted(
        config.cache_layers,
        key=lambda layer: (windows[layer] is None, -(windows[layer] or 0)),
    )
