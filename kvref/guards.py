"""The reference model's guards: checks of what it is handed and of what a cache hands back.

Before any layer's cache is touched, the model rejects what it cannot run on: token ids
outside the vocabulary, caches that break the protocol or do not fit the call (the wrong
number of them, one object for two layers, layers of other lengths, a spec for another
batch), a capability a cache does not offer. After a cache's call, it rejects rows that
break the contract (the wrong number, shape or dtype) before attending over them. Each
raises ``CacheContractError`` (or, for the caller's own arguments, ``TypeError`` or
``ValueError``) with a message naming the layer and the problem; the model's own modules
keep the math, these checks keep it honest.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from kvref.capabilities import shifts_per_row
from kvref.checks import check_shift_rows
from kvref.protocol import (
    KEYS_STORED,
    CacheContractError,
    CacheSpec,
    LayerCache,
    is_count,
    keys_stored,
    rows_needed,
)
from kvref.rows import RowBatch


def check_returned_rows(
    layer: nn.Module,
    keys: Tensor,
    values: Tensor,
    batch: int,
    *,
    start: int,
    end: int,
    call: str = "append",
) -> None:
    """What append (or ``call``) returned to the Attention ``layer`` is a run of the most
    recent rows: all ``end`` of them, or with a window at least the last W - 1 before the new
    ones and the new ones."""
    c = layer.config
    new_tokens = end - start
    fewest = rows_needed(layer.window, end, new_tokens, layer.sinks)
    ok = rows_shaped(c, keys, values, batch) and fewest <= keys.shape[2] <= end
    if not ok:
        rows = f"{end}" if fewest == end else f"{fewest} to {end}"
        window = "" if layer.window is None else f" (window {layer.window})"
        if layer.sinks:
            window = f" (window {layer.window} and {layer.sinks} sinks)"
        raise CacheContractError(
            f"layer {layer.layer}: the caches' length was {start} before this call, so "
            f"after appending {new_tokens} tokens {call} must return {rows} rows{window}, "
            f"shaped ({batch}, {c.num_kv_heads}, rows, {row_widths(c)}); it returned keys "
            f"{tuple(keys.shape)} and values {tuple(values.shape)}"
        )


def check_returned_row_batch(
    layer: nn.Module, keys: object, values: object, valid: object, batch: int, rows: RowBatch
) -> Tensor:
    """What append_rows returned to the Attention ``layer``: keys and values (B, H_kv, L, D),
    ``valid`` (B, L) booleans marking, per row, all its rows (or with a window at least the
    last W - 1 before the new ones and the new ones); returns the count per row."""
    c = layer.config
    shaped = (
        isinstance(valid, Tensor)
        and rows_shaped(c, keys, values, batch)
        and valid.dtype == torch.bool
        and valid.shape == (batch, keys.shape[2])
        and keys.dtype == values.dtype == layer.out.weight.dtype
        and valid.device == keys.device
    )
    if not shaped:
        got = [
            f"{tuple(t.shape)} {t.dtype}" if isinstance(t, Tensor) else type(t).__name__
            for t in (keys, values, valid)
        ]
        raise CacheContractError(
            f"layer {layer.layer}: append_rows must return keys and values shaped ({batch}, "
            f"{c.num_kv_heads}, rows, {row_widths(c)}) in {layer.out.weight.dtype} and valid "
            f"booleans ({batch}, rows) on their device; it returned keys {got[0]}, values "
            f"{got[1]} and valid {got[2]}"
        )
    held = valid.sum(dim=1)
    for row, (length, count) in enumerate(zip(rows.lengths, rows.counts, strict=True)):
        end = length + count
        fewest = rows_needed(layer.window, end, count, layer.sinks)
        if not fewest <= int(held[row]) <= end:
            want = f"{end}" if fewest == end else f"{fewest} to {end}"
            raise CacheContractError(
                f"layer {layer.layer}: row {row} held {length} tokens and got {count} more "
                f"(its neighbours: {list(rows.lengths)} held, {list(rows.counts)} new), so "
                f"append_rows must mark {want} of its rows valid; it marked {int(held[row])}"
            )
    return held


def check_output(
    layer: nn.Module, result: object, shape, dtype: torch.dtype, call: str, what: str
) -> None:
    """What a cache's own attention (``call``) returned to the Attention ``layer`` is a
    tensor of ``shape`` in ``dtype``; else a ``CacheContractError`` saying what it returned."""
    if isinstance(result, Tensor) and result.shape == tuple(shape) and result.dtype == dtype:
        return
    got = (
        f"{tuple(result.shape)} {result.dtype}"
        if isinstance(result, Tensor)
        else type(result).__name__
    )
    raise CacheContractError(
        f"layer {layer.layer}: {call} must return {what}, {tuple(shape)} in {dtype}; it "
        f"returned {got}"
    )


def rows_shaped(config, keys: object, values: object, batch: int) -> bool:
    """Keys and values of a layer of a model of ``config``, as many of each: (batch, kv_heads,
    rows, width), the keys' width and the values' their own (in MLA, the rope key's and the
    latent's)."""
    c = config
    return (
        isinstance(keys, Tensor)
        and isinstance(values, Tensor)
        and keys.ndim == values.ndim == 4
        and keys.shape[:3] == values.shape[:3]
        and keys.shape[:2] == (batch, c.num_kv_heads)
        and (keys.shape[3], values.shape[3]) == (c.key_width, c.value_width)
    )


def row_widths(config) -> str:
    """The width of a returned row, for a message: head_dim, or in MLA the two widths."""
    c = config
    if c.key_width == c.value_width:
        return str(c.key_width)
    return f"{c.key_width} for keys and {c.value_width} for values"


def check_token_ids(token_ids: object, vocab_size: int) -> None:
    """Token ids the model can embed: an int tensor (batch, T), not empty, each in the
    vocabulary."""
    if not isinstance(token_ids, Tensor):
        raise TypeError(f"token_ids must be a torch.Tensor, got {type(token_ids).__name__}")
    if token_ids.ndim != 2:
        raise ValueError(
            f"token_ids must have rank 2 (batch, T), got shape {tuple(token_ids.shape)}"
        )
    if token_ids.dtype not in (torch.int64, torch.int32):  # what nn.Embedding takes
        raise ValueError(f"token_ids must have dtype int64 or int32, got {token_ids.dtype}")
    if token_ids.numel() == 0:
        raise ValueError(f"token_ids is empty: shape {tuple(token_ids.shape)}")
    low, high = int(token_ids.min()), int(token_ids.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(
            f"token id out of the vocabulary [0, {vocab_size}): ids range from {low} to {high}"
        )


def checked_positions(positions: object, tokens: int, device: torch.device) -> Tensor:
    """The positions of an uncached call's ``tokens`` tokens (increasing ints >= 0), on
    ``device``."""
    if not isinstance(positions, Tensor) or positions.dtype != torch.long:
        raise TypeError(f"positions must be a torch.long tensor, got {positions!r}")
    if positions.shape != (tokens,):
        raise ValueError(f"positions must be shaped ({tokens},), got {tuple(positions.shape)}")
    if tokens and (int(positions[0]) < 0 or bool((positions.diff() <= 0).any())):
        raise ValueError(f"positions must be increasing ints >= 0, got {positions.tolist()}")
    return positions.to(device)


def first_position(caches: Sequence[LayerCache]) -> int:
    """Where the caches' first token sits (contract, section 8.3): their
    ``first_position``, 0 for a cache without one; every layer and row the same."""
    firsts = set()
    for cache in caches:
        if cache is None:  # a layer that reads another's cache
            continue
        first = getattr(cache, "first_position", 0)
        firsts.update((first,) if isinstance(first, int) else tuple(first))
    if len(firsts) > 1 or not all(is_count(first) for first in firsts):
        raise CacheContractError(
            f"the caches' first positions are {sorted(firsts, key=str)}: one int >= 0 for "
            f"every layer and row is needed here (rows of their own: forward_rows)"
        )
    return firsts.pop() if firsts else 0


def check_offered(caches: Sequence[LayerCache], capability: str) -> None:
    """Every layer's cache offers ``capability`` (has the method)."""
    for layer, cache in enumerate(caches):
        if cache is not None and not callable(getattr(cache, capability, None)):
            raise CacheContractError(
                f"layer {layer}: {type(cache).__name__} offers no {capability}()"
            )


def check_caches(model: nn.Module, caches: Sequence[LayerCache], *, batch: int | None) -> int:
    """Reject inconsistent caches for ``model`` before any is touched; return their common length.
    With ``batch`` None, a cache's spec is checked for everything but the batch."""
    if not isinstance(caches, Sequence) or isinstance(caches, str):
        raise TypeError(f"caches must be a sequence of caches, got {type(caches).__name__}")
    layers = model.config.num_layers
    if len(caches) != layers:
        raise CacheContractError(
            f"wrong number of caches: {layers} layers need {layers}, got {len(caches)}"
        )
    for layer, cache in enumerate(caches):
        source = model.config.source_of(layer)
        if source is not None and cache is not None:
            raise CacheContractError(
                f"layer {layer} reads layer {source}'s cache (kv_sources), but was handed a "
                f"cache of its own ({type(cache).__name__}); its entry must be None"
            )
        if source is None and cache is None:
            raise CacheContractError(
                f"layer {layer}: no cache (None), and it reads no other layer's (kv_sources)"
            )
    owned = model.config.cache_layers
    first_layer_of: dict[int, int] = {}
    stored = [keys_stored(caches[layer]) for layer in owned]
    for index, layer in enumerate(owned):
        cache = caches[layer]
        if stored[index] not in KEYS_STORED:
            raise CacheContractError(
                f"layer {layer}: keys_stored is {stored[index]!r}, neither "
                f'"rotated" nor "unrotated" (contract, section 8.4)'
            )
        if id(cache) in first_layer_of:
            raise CacheContractError(
                f"the same cache object is used for layers {first_layer_of[id(cache)]} and "
                f"{layer}; each layer needs a cache of its own (a layer that reads another's "
                f"declares it in ModelConfig.kv_sources, its entry None)"
            )
        first_layer_of[id(cache)] = layer
    if len(set(stored)) > 1:
        raise CacheContractError(
            f"inconsistent layer caches: keys_stored by layer {stored}; every layer's cache "
            f"must keep keys the same way (contract, section 8.4)"
        )
    lengths = [caches[layer].length for layer in owned]
    for layer, length in zip(owned, lengths, strict=True):
        if isinstance(length, bool) or not isinstance(length, int) or length < 0:
            raise CacheContractError(
                f"layer {layer}: cache.length must be an int >= 0, got {length!r}"
            )
    if len(set(lengths)) > 1:
        problem = "some layers are empty and some are not" if 0 in lengths else "lengths differ"
        raise CacheContractError(
            f"inconsistent layer caches: {problem}; lengths by layer {lengths}"
        )
    for layer in owned:
        cache = caches[layer]
        # `spec` is not part of the protocol, but a cache that exposes one lets the model
        # reject a mismatch before layer 0 has appended anything.
        spec = getattr(cache, "spec", None)
        if not isinstance(spec, CacheSpec):
            continue
        wanted = model.cache_spec(batch or spec.batch, max(lengths[0], 1), layer=layer)
        # Not the window: a cache may ignore it and keep everything (the mask applies it).
        for field in ("batch", "kv_heads", "head_dim", "value_width", "dtype"):
            if getattr(spec, field) != getattr(wanted, field):
                raise CacheContractError(
                    f"layer {layer}: cache built for {field} {getattr(spec, field)}, but this "
                    f"call needs {field} {getattr(wanted, field)}"
                )
    return lengths[0]


def check_row_caches(
    model: nn.Module, caches: Sequence[LayerCache], batch: int
) -> tuple[tuple[int, ...], tuple[int, ...], str]:
    """Caches with per-row lengths, consistent across layers: their row lengths, first
    positions and padding, checked before any is touched."""
    # The batch from row_lengths, not a spec's: rows leave and join (select_rows, join).
    check_caches(model, caches, batch=None)
    check_offered(caches, "append_rows")
    seen = []
    for layer, cache in enumerate(caches):
        if cache is None:  # a layer that reads another's cache (kv_sources)
            continue
        lengths = tuple(getattr(cache, "row_lengths", ()))
        first = getattr(cache, "first_position", 0)
        firsts = (first,) * batch if isinstance(first, int) else tuple(first)
        padding = getattr(cache, "padding", "right")
        problems = []
        if len(lengths) != batch or not all(is_count(n) for n in lengths):
            problems.append(f"row_lengths {lengths!r} is not {batch} ints >= 0")
        if len(firsts) != batch or not all(is_count(n) for n in firsts):
            problems.append(f"first_position {first!r} is not an int >= 0 or {batch} of them")
        if padding not in ("left", "right"):
            problems.append(f'padding {padding!r} is neither "left" nor "right"')
        if problems:
            raise CacheContractError(f"layer {layer}: {'; '.join(problems)}")
        seen.append((lengths, firsts, padding))
    if len(set(seen)) > 1:
        raise CacheContractError(
            "inconsistent layer caches: row lengths, first positions or padding differ "
            f"by layer: {seen}"
        )
    return seen[0]


def checked_row_shift(model: nn.Module, caches: Sequence[LayerCache], starts, counts):
    """A shift per row's tuples, checked against every layer's rows (each declaring
    ``shift_per_row``) before any is touched."""
    check_offered(caches, "shift")
    first = next((cache for cache in caches if cache is not None), None)
    batch = len(getattr(first, "row_lengths", ()))
    lengths, _, _ = check_row_caches(model, caches, batch)
    for layer, cache in enumerate(caches):
        if cache is not None and not shifts_per_row(cache):
            raise CacheContractError(
                f"layer {layer}: {type(cache).__name__} declares no shift per row "
                f"(shift_per_row = True beside append_rows and shift, section 8.4)"
            )
    return check_shift_rows(lengths, starts, counts)
