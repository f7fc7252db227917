"""A small decoder-only transformer, written to be trusted: the oracle every cache is held to.

Pre-norm blocks (RMSNorm), rotary position embeddings (RoPE), grouped-query attention
(``num_kv_heads`` divides ``num_heads``; equal means ordinary multi-head attention), a SiLU
feed-forward block and a tied output embedding. There is no dropout, so the model is a pure
function of its weights, which come from ``config.seed`` alone.

``model(token_ids)`` runs the whole sequence at once. ``model(token_ids, caches=caches)`` runs
only the new tokens: their positions start at the caches' common length, their rotated keys
and values are appended to each layer's cache, and the mask compares absolute positions so
a chunk of several new tokens on a warm cache is masked correctly. ``forward_rows`` gives
each batch row new tokens of its own count, and ``forward_tree`` verifies a tree of draft
tokens in one call, each node seeing the committed tokens, its ancestors and itself alone
(speculative decoding).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvref.protocol import (
    KEYS_STORED,
    CacheContractError,
    CacheFactory,
    CacheSpec,
    LayerCache,
    check_counts,
    check_reorder,
    check_shift,
    check_shift_rows,
    check_tree,
    check_truncate,
    is_count,
    is_row_shift,
    kept_rows,
    keys_stored,
    row_slots,
    rows_needed,
    shifts_per_row,
    tree_depths,
)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 4
    head_dim: int = 8
    ffn_dim: int = 64
    rope_base: float = 10_000.0
    seed: int = 0
    window: int | None = None  # sliding-window attention: a query at p sees keys p-W+1..p
    window_layers: Literal["all", "alternate"] = "all"  # every layer, or even layers only
    # StreamingLLM's attention sinks: a window layer's queries also see the session's first
    # ``sinks`` tokens (contract, section 8.5). Only with a window.
    sinks: int = 0
    # Where a query sees its sinks (section 8.5): at the positions they were given, or, as
    # StreamingLLM assigns positions within its cache, just before the query's window.
    sink_positions: Literal["original", "in cache"] = "original"
    # The residual width; None: num_heads x head_dim. Set apart from the heads (as Gemma does,
    # the query and output projections mapping between the two), a model can be small
    # everywhere but where a cache looks: wide heads, many kv heads, on a narrow residual.
    hidden: int | None = None
    # Multi-head latent attention (DeepSeek-V2/V3, contract section 10.2): each token's keys
    # and values come from one compressed latent (``latent_dim`` wide, shared by every head)
    # and one small rope key (``rope_dim``, shared too), which is all a layer's cache holds.
    # A head's key is its up-projected ``nope_dim`` channels beside the rope key, its value
    # ``head_dim`` channels up-projected from the latent. Cached calls take ``mla_path``: the
    # "naive" one up-projects the cached latents, the "absorbed" one folds the up-projections
    # into the query and the output and attends over the latents; uncached calls are naive.
    attention: Literal["gqa", "mla"] = "gqa"
    latent_dim: int = 16
    rope_dim: int = 4
    nope_dim: int = 8
    mla_path: Literal["naive", "absorbed"] = "naive"
    # Layers that read another layer's cache (cross-layer KV sharing, section 10.3): one entry
    # per layer, None for a layer with a cache of its own, or the earlier layer whose cache
    # it reads (a layer with one of its own, of the same window). None: every layer has one.
    kv_sources: tuple[int | None, ...] | None = None
    # The feed-forward block: "silu", down(silu(in(x))), or "swiglu", down(silu(gate(x)) *
    # in(x)) as Llama has it, so that an engine's own Llama (llama.cpp, transformers; contract
    # section 13) can be given exactly this model's weights.
    ffn: Literal["silu", "swiglu"] = "silu"

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "ffn_dim",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden is not None and (isinstance(self.hidden, bool) or self.hidden < 1):
            raise ValueError(f"ModelConfig.hidden must be None or an int >= 1, got {self.hidden!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads ({self.num_kv_heads}) must divide num_heads ({self.num_heads})"
            )
        if self.head_dim % 2 and self.attention != "mla":  # MLA rotates its rope_dim alone
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.window is not None and (isinstance(self.window, bool) or self.window < 1):
            raise ValueError(f"window must be None or an int >= 1, got {self.window!r}")
        if isinstance(self.sinks, bool) or not isinstance(self.sinks, int) or self.sinks < 0:
            raise ValueError(f"sinks must be an int >= 0, got {self.sinks!r}")
        if self.sinks and self.window is None:
            raise ValueError(f"sinks is {self.sinks}: attention sinks need a window")
        if self.sink_positions not in ("original", "in cache"):
            raise ValueError(
                f'sink_positions must be "original" or "in cache", got {self.sink_positions!r}'
            )
        if self.window_layers not in ("all", "alternate"):
            raise ValueError(
                f"window_layers must be 'all' or 'alternate', got {self.window_layers!r}"
            )
        if self.ffn not in ("silu", "swiglu"):
            raise ValueError(f'ffn must be "silu" or "swiglu", got {self.ffn!r}')
        self._check_latent()
        self._check_kv_sources()

    def _check_latent(self) -> None:
        if self.attention not in ("gqa", "mla"):
            raise ValueError(f'attention must be "gqa" or "mla", got {self.attention!r}')
        if self.mla_path not in ("naive", "absorbed"):
            raise ValueError(f'mla_path must be "naive" or "absorbed", got {self.mla_path!r}')
        if self.attention == "gqa":
            return
        for name in ("latent_dim", "rope_dim", "nope_dim"):
            if not is_count(getattr(self, name)) or getattr(self, name) < 1:
                raise ValueError(
                    f"ModelConfig.{name} must be an int >= 1, got {getattr(self, name)!r}"
                )
        if self.rope_dim % 2:
            raise ValueError(f"rope_dim must be even for RoPE, got {self.rope_dim}")
        if self.num_kv_heads != 1:
            raise ValueError(
                f"an MLA layer caches one latent and one rope key for every head: num_kv_heads "
                f"must be 1, got {self.num_kv_heads}"
            )

    def _check_kv_sources(self) -> None:
        if self.kv_sources is None:
            return
        sources = self.kv_sources
        if not isinstance(sources, tuple) or len(sources) != self.num_layers:
            raise ValueError(
                f"kv_sources must be a tuple of {self.num_layers} entries (one per layer), got "
                f"{sources!r}"
            )
        for layer, source in enumerate(sources):
            if source is None:
                continue
            if not is_count(source) or source >= layer:
                raise ValueError(
                    f"kv_sources[{layer}] is {source!r}: a layer reads an earlier layer's cache"
                )
            if sources[source] is not None:
                raise ValueError(
                    f"kv_sources[{layer}] is {source}, which reads layer {sources[source]}'s "
                    f"cache itself: a layer reads one that has a cache of its own"
                )
            if (self.layer_window(source), self.layer_sinks(source)) != (
                self.layer_window(layer),
                self.layer_sinks(layer),
            ):
                raise ValueError(
                    f"kv_sources[{layer}] is {source}, a layer of another window or sinks: a "
                    f"reader attends over its source's rows, so the two must agree"
                )

    def source_of(self, layer: int) -> int | None:
        """The layer whose cache layer ``layer`` reads, or None where it has one of its own."""
        return None if self.kv_sources is None else self.kv_sources[layer]

    @property
    def cache_layers(self) -> list[int]:
        """The layers with a cache of their own (every layer, without ``kv_sources``)."""
        return [layer for layer in range(self.num_layers) if self.source_of(layer) is None]

    @property
    def key_width(self) -> int:
        """The width of a key row a layer's cache holds: the rope key's in MLA."""
        return self.rope_dim if self.attention == "mla" else self.head_dim

    @property
    def value_width(self) -> int:
        """The width of a value row a layer's cache holds: the latent's in MLA."""
        return self.latent_dim if self.attention == "mla" else self.head_dim

    @property
    def query_width(self) -> int:
        """The width of one query head: in MLA its no-rope channels and its rope channels."""
        return self.nope_dim + self.rope_dim if self.attention == "mla" else self.head_dim

    def layer_window(self, layer: int) -> int | None:
        """Layer ``layer``'s window: every layer's (Mistral-style), or with ``alternate`` the
        even layers' while the odd ones attend globally (Gemma-style hybrids)."""
        if self.window_layers == "alternate" and layer % 2:
            return None
        return self.window

    def layer_sinks(self, layer: int) -> int:
        """Layer ``layer``'s attention sinks: the config's on a window layer, else none."""
        return 0 if self.layer_window(layer) is None else self.sinks

    @property
    def d_model(self) -> int:
        """The residual width: ``hidden``, or num_heads x head_dim when it is None."""
        return self.num_heads * self.head_dim if self.hidden is None else self.hidden

    @property
    def attention_width(self) -> int:
        """The width of all query heads side by side (what the output projection takes)."""
        return self.num_heads * self.head_dim


def rope_cos_sin(positions: Tensor, head_dim: int, base: float, dtype: torch.dtype):
    """cos and sin of the rotation angles, each shaped (T, head_dim // 2): rows of a table
    of every position below a power of two (``rope_table``), or computed for these positions
    alone where they reach past ``ROPE_TABLE_POSITIONS``."""
    low, high = (int(end) for end in positions.aminmax())
    if low < 0 or high >= ROPE_TABLE_POSITIONS:
        return rope_angles_cos_sin(positions, head_dim, base, dtype)
    rows = max(64, 1 << high.bit_length())
    cos, sin = rope_table(rows, head_dim, base, dtype, positions.device)
    return cos[positions], sin[positions]


# A model's step recomputed cos and sin for every position, a fifth of a small model's step;
# a table per width, base, dtype and device serves every step, and a position's rotation is
# then one value whichever call computes it. Positions from this one on are computed per call
# (a table of them takes 16 MiB at head_dim 256 in float64, and a worker may keep dozens).
ROPE_TABLE_POSITIONS = 1 << 13


@functools.lru_cache(maxsize=64)
def rope_table(rows: int, head_dim: int, base: float, dtype: torch.dtype, device: torch.device):
    """``rope_angles_cos_sin`` of positions 0 to ``rows`` - 1."""
    with torch.inference_mode(False), torch.no_grad():  # a plain tensor, whoever asks first
        positions = torch.arange(rows, device=device)
        return rope_angles_cos_sin(positions, head_dim, base, dtype)


def rope_angles_cos_sin(positions: Tensor, head_dim: int, base: float, dtype: torch.dtype):
    """cos and sin of the rotation angles of ``positions``, computed in float64."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device)
    inverse_frequencies = base ** (-exponents / head_dim)
    angles = positions.to(torch.float64)[..., None] * inverse_frequencies
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: Tensor, positions: Tensor, base: float) -> Tensor:
    """Rotate x (B, H, T, head_dim) by its absolute positions, (T,) shared by every batch row
    or (B, T) a row's own; channel i pairs with i + D/2."""
    cos, sin = rope_cos_sin(positions, x.shape[-1], base, x.dtype)
    if positions.ndim == 2:  # per row: broadcast over the heads
        cos, sin = cos[:, None], sin[:, None]
    first, second = x.chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)


def rerotate(keys: Tensor, delta: int, base: float) -> Tensor:
    """``keys`` (..., T, head_dim), rotated at their positions, rotated on by ``delta``
    positions (negative: back), computed in float64 and rounded once into their dtype: RoPE's
    rotations add, so a key rotated at p becomes the key rotated at p + delta (contract,
    section 8.4: a context shift moves the keys after the span it discards)."""
    if not keys.shape[-2]:
        return keys.clone()
    wide = torch.float32 if keys.device.type == "mps" else torch.float64  # MPS: no float64
    positions = torch.full((keys.shape[-2],), delta, device=keys.device)
    return apply_rope(keys.to(wide), positions, base).to(keys.dtype)


def shifted_rows(
    keys: Tensor, values: Tensor, start: int, count: int, base: float, stored: str = "rotated"
) -> tuple[Tensor, Tensor]:
    """What a cache holding ``keys`` and ``values`` (B, H_kv, rows, D) should hold after
    ``shift(start, count)``: the span gone, the keys after it rotated back by ``count``
    positions (``rerotate``; kept as they are where they are ``stored`` "unrotated"), the
    values moved as they are."""
    after = slice(start + count, None)
    moved = keys[:, :, after]
    if stored == "rotated":
        moved = rerotate(moved, -count, base)
    return (
        torch.cat((keys[:, :, :start], moved), dim=2),
        torch.cat((values[:, :, :start], values[:, :, after]), dim=2),
    )


class HeldRows:
    """A trusted cache that starts out holding given rows, every layer its own: the oracle
    after a context shift (contract, section 8.4), where what a cache should hold is no
    uncached pass's. It keeps every row (the model's mask applies a window)."""

    def __init__(
        self, keys: Tensor, values: Tensor, first_position: int = 0, keys_stored="rotated"
    ) -> None:
        self.keys, self.values, self.first_position = keys, values, first_position
        self.keys_stored = keys_stored  # as the cache under test keeps them

    @property
    def length(self) -> int:
        return self.keys.shape[2]

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        self.keys = torch.cat((self.keys, key), dim=2)
        self.values = torch.cat((self.values, value), dim=2)
        return self.keys, self.values

    def reset(self) -> None:
        self.keys, self.values = self.keys[:, :, :0], self.values[:, :, :0]


def causal_mask(
    query_positions: Tensor,
    key_positions: Tensor,
    window: int | None = None,
    sink_end: int | Tensor | None = None,
) -> Tensor:
    """(T, keys) booleans, or (B, T, keys) for positions of each batch row's own ((B, T) and
    (B, keys)): a query at absolute position p sees the keys at positions <= p, wherever its
    chunk starts (a tril over the chunk alone is wrong on a warm cache), and with a window only
    those > p - window, and the sinks: those below ``sink_end`` (an int, or (B,) per row)."""
    keys, queries = key_positions[..., None, :], query_positions[..., :, None]
    allowed = keys <= queries
    if window is not None:
        recent = keys > queries - window
        if sink_end is not None:
            if isinstance(sink_end, Tensor) and sink_end.ndim:
                sink_end = sink_end[:, None, None]
            recent |= keys < sink_end
        allowed &= recent
    return allowed


def attention(
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    query_positions: Tensor,
    key_positions: Tensor,
    window: int | None = None,
    valid: Tensor | None = None,
    sink_end: int | Tensor | None = None,
    sink_query: Tensor | None = None,
    visible: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """Softmax attention of ``query`` (B, H, T, D) over ``keys`` and ``values`` (B, H_kv,
    rows, D) at the given absolute positions, (T,) and (rows,) or each batch row's own (B, T)
    and (B, rows): causal, windowed if ``window`` (beside the sinks below ``sink_end``, section
    8.5), scaled by 1/sqrt(D). Query head h reads kv
    head h // (H // H_kv) (grouped-query attention). With ``valid`` (B, rows) booleans, the
    rows it marks False are no keys at all: masked, and their values zeroed, so that a pad of
    nan a cache keeps costs nothing (0 x nan is nan). A query that sees no key gives nan.
    With ``sink_query`` (the query rotated where it sits relative to its sinks, section 8.5),
    the scores of the keys below ``sink_end`` are taken with it. With ``visible`` (T, rows)
    or (B, T, rows) booleans, query i sees only the rows it marks True for it, beside the
    causal mask (a draft tree's node sees its own ancestors, section 9.2): a row one query may
    not see, another may, so its value is zeroed for that query alone. ``scale`` replaces
    1/sqrt(D) where the query is not what the scores were defined on (MLA's absorbed path)."""
    group = query.shape[1] // keys.shape[1]
    if group > 1:
        # Skipped for ordinary multi-head attention: repeat_interleave copies even when
        # group is 1, and at long contexts that copy costs more than the attention.
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
    # In half precision, scores, softmax and sums in float64, rounded once at the end: in
    # float32 a chunk of 5 queries sums in another order than the 37 of the uncached pass,
    # and a rounding flip that no cache caused would reach the logits (measured: 2.8 x the
    # uncached run's error at a position, float16, head_dim 128). float64 sums round to the
    # same half-precision value whatever the chunk; a cache's attend still sums in float32.
    exact = query.dtype in HALF_DTYPES and query.device.type != "mps"  # MPS has no float64
    wide = torch.float64 if exact else at_least_float32(query.dtype)
    scale = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = (query.to(wide) @ keys.to(wide).transpose(-2, -1)) * scale
    if sink_query is not None:
        below = sink_end[:, None] if isinstance(sink_end, Tensor) and sink_end.ndim else sink_end
        sinks = key_positions < below  # (rows,) or (B, rows)
        sinks = sinks[:, None, None, :] if sinks.ndim == 2 else sinks
        at_sinks = sink_query.to(wide) @ keys.to(wide).transpose(-2, -1)
        scores = torch.where(sinks, at_sinks * scale, scores)
    allowed = causal_mask(query_positions, key_positions, window, sink_end)
    if allowed.ndim == 3:  # per row: broadcast over the heads
        allowed = allowed[:, None]
    if valid is not None:
        allowed = allowed & valid[:, None, None, :]
        values = values.masked_fill(~valid[:, None, :, None], 0)
    if visible is not None:
        allowed = allowed & (visible[:, None] if visible.ndim == 3 else visible)
    weights = F.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    if visible is None:
        return (weights @ values.to(wide)).to(query.dtype)
    # Each query sums values of its own: (B, H, T, rows, D), every row it may not see zeroed.
    seen_values = values.to(wide)[:, :, None].masked_fill(~allowed[..., None], 0)
    return (weights[..., None, :] @ seen_values).squeeze(-2).to(query.dtype)


HALF_DTYPES = (torch.float16, torch.bfloat16)


def varlen_attention(
    attend,
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    query_positions: Tensor,
    key_positions: Tensor,
    *args,
    valid: Tensor,
    sink_end: int | Tensor | None = None,
    sink_query: Tensor | None = None,
    **kwargs,
) -> Tensor:
    """``attend`` (``attention``, or MLA's over latents) as a varlen kernel computes it
    (flash-attn's ``cu_seqlens``, contract section 8.2): batch row b over only the rows
    ``valid[b]`` marks, (B, rows), taken as a slice where they are one run (right or left
    padding) and gathered where they are not, the other slots never read. The result of
    ``attend(..., valid=valid)``, the dense masked path, within rounding (the sums run over
    fewer terms), at each row's own cost: the dense path attends every row over the longest
    row's slots. A row with no valid rows takes the dense path: its queries see no key (nan).
    ``sink_end`` (B,) and ``sink_query`` are split by row with the rest."""
    per_row = []
    for row in range(query.shape[0]):
        one = slice(row, row + 1)
        own = {"sink_query": None if sink_query is None else sink_query[one], **kwargs}
        per_row_sinks = isinstance(sink_end, Tensor) and sink_end.ndim
        own["sink_end"] = sink_end[one] if per_row_sinks else sink_end
        slots = valid_slots(valid[row])
        if slots is None:
            slots, own["valid"] = slice(None), valid[one]
        keys_seen, values_seen = keys[one, :, slots], values[one, :, slots]
        seen_at = (query_positions[one], key_positions[one, slots])
        per_row.append(attend(query[one], keys_seen, values_seen, *seen_at, *args, **own))
    return torch.cat(per_row)


def rotating_keys(attend, base: float, query: Tensor, keys: Tensor, *args, **kwargs) -> Tensor:
    """``attend`` over ``keys`` kept unrotated (section 8.4), rotated first at
    ``key_positions``: on the varlen path, each row's own rows alone, not its pads."""
    values, query_positions, key_positions, *rest = args
    rotated = apply_rope(keys, key_positions.clamp(min=0), base)  # a pad's position is any
    return attend(query, rotated, values, query_positions, key_positions, *rest, **kwargs)


def valid_slots(valid: Tensor) -> slice | Tensor | None:
    """The slots ``valid`` (rows,) marks: a slice where they are one run (a view, no copy),
    else their indices; None where there are none."""
    slots = valid.nonzero().flatten()
    if not slots.numel():
        return None
    first, last = int(slots[0]), int(slots[-1])
    return slice(first, last + 1) if last - first + 1 == slots.numel() else slots


def latent_attention(
    layer: Attention,
    path: str,
    q: Tensor,
    rope_keys: Tensor,
    latents: Tensor,
    *args,
    sink_query: Tensor | None = None,
    **kwargs,
) -> Tensor:
    """MLA (contract, section 10.2): ``q`` (B, H, T, nope + rope, its rope channels rotated)
    over the rows an MLA layer caches, ``rope_keys`` (B, 1, rows, rope) and ``latents`` (B, 1,
    rows, latent), on ``path``; the rest as ``attention`` takes it. Computed in float64 (MPS:
    float32), so that the two paths, which sum in other orders, round to one result in the
    model's dtype (they agree to some 1e-15 before that)."""
    wide = torch.float32 if q.device.type == "mps" else torch.float64
    c = layer.config
    up_key = layer.up_key.weight.to(wide).view(c.num_heads, c.nope_dim, c.latent_dim)
    up_value = layer.up_value.weight.to(wide).view(c.num_heads, c.head_dim, c.latent_dim)
    query, rope_keys, latents = q.to(wide), rope_keys.to(wide), latents.to(wide)
    sink_query = None if sink_query is None else sink_query.to(wide)
    attend = naive_attention if path == "naive" else absorbed_attention
    mixed = attend(
        query, rope_keys, latents, up_key, up_value, *args, sink_query=sink_query, **kwargs
    )
    return mixed.to(q.dtype)


def naive_attention(query, rope_keys, latents, up_key, up_value, *args, **kwargs) -> Tensor:
    """MLA's naive path: each head's keys, its up-projected latent channels beside the rope
    key, and its values up-projected from the latents, then ``attention`` per head."""
    heads = up_key.shape[0]
    keys = torch.einsum("bxrc,hnc->bhrn", latents, up_key)  # x: the one cached "head"
    keys = torch.cat((keys, rope_keys.expand(-1, heads, -1, -1)), dim=-1)
    values = torch.einsum("bxrc,hdc->bhrd", latents, up_value)
    return attention(query, keys, values, *args, **kwargs)


def absorbed_attention(query, rope_keys, latents, up_key, up_value, *args, **kwargs) -> Tensor:
    """MLA's absorbed path (what decode kernels take): each head's no-rope query folded into
    the latent space (q W_UK), scores over the latents and the rope keys side by side, the
    latents summed as values, and the head's value projection applied to the sum."""
    nope = up_key.shape[1]

    def absorbed(q: Tensor | None) -> Tensor | None:
        if q is None:
            return None
        folded = torch.einsum("bhtn,hnc->bhtc", q[..., :nope], up_key)
        return torch.cat((folded, q[..., nope:]), dim=-1)

    kwargs["sink_query"] = absorbed(kwargs.get("sink_query"))
    keys = torch.cat((latents, rope_keys), dim=-1)
    scale = 1 / math.sqrt(query.shape[-1])  # the scores' width: nope + rope
    mixed = attention(absorbed(query), keys, latents, *args, scale=scale, **kwargs)
    return torch.einsum("bhtc,hdc->bhtd", mixed, up_value)


class SharedRows:
    """A layer's cache as the model hands it to that layer where later layers read it
    (contract, section 10.3): appends (``append``, ``append_rows``, ``append_tree``) pass
    through, and what the call returned is kept for this step's readers, the very tensors
    (rule 2 keeps them valid until the cache's next call), with the length, or each row's,
    the cache held before it. In an uncached pass there is no cache, and the rows are the
    pass's own keys and values."""

    def __init__(self, cache: LayerCache | None) -> None:
        self.cache = cache
        self.before = 0  # the cache's length before this step's append
        self.rows_before: tuple[int, ...] = ()  # each row's, before this step's append_rows
        self.rows: tuple[Tensor, ...] | None = None

    @property
    def keys_stored(self) -> str:
        return "rotated" if self.cache is None else keys_stored(self.cache)

    @property
    def length(self) -> int:
        return 0 if self.cache is None else self.cache.length

    @property
    def offset(self) -> int:
        """Where a reader's queries start, after the session's first position: at the
        positions this step's new rows were given, the length before the append."""
        return self.before

    @property
    def row_offsets(self) -> tuple[int, ...]:
        """Where each row's reader queries start, after that row's first position: at the
        positions this step's new rows were given, the row lengths before ``append_rows``."""
        return self.rows_before

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        self.before = self.length
        self.rows = (key, value) if self.cache is None else self.cache.append(key, value)
        return self.rows

    def append_rows(self, key: Tensor, value: Tensor, counts) -> tuple[Tensor, Tensor, Tensor]:
        self.rows_before = tuple(self.cache.row_lengths)
        self.rows = self.cache.append_rows(key, value, counts)
        return self.rows

    def append_tree(self, key: Tensor, value: Tensor, parents) -> tuple[Tensor, Tensor]:
        self.before = self.length
        self.rows = self.cache.append_tree(key, value, parents)
        return self.rows


class SharedReader:
    """What a layer that reads another's cache is handed in its place: appends nothing, and
    gets back the rows its source's append of this step returned (rule 2 keeps them valid
    until the source's next call, which comes after every reader)."""

    def __init__(self, shared: SharedRows) -> None:
        self.shared = shared

    @property
    def keys_stored(self) -> str:
        return self.shared.keys_stored

    @property
    def length(self) -> int:
        return self.shared.before

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        return self.shared.rows

    def append_rows(self, key: Tensor, value: Tensor, counts) -> tuple[Tensor, Tensor, Tensor]:
        return self.shared.rows  # the source's keys, values and valid, each row masked by its own

    def append_tree(self, key: Tensor, value: Tensor, parents) -> tuple[Tensor, Tensor]:
        return self.shared.rows

    def row_positions(self, firsts: Sequence[int], real: Tensor) -> Tensor:
        """(B, T) positions of this reader's queries in ``forward_rows``: row b's from its
        first position plus its source's row length before this step's ``append_rows``."""
        offsets = self.shared.row_offsets
        starts = [first + offset for first, offset in zip(firsts, offsets, strict=True)]
        return row_positions(torch.tensor(starts, device=real.device), real)

    def tree_positions(self, first: int, depths: Tensor) -> Tensor:
        """(T,) positions of this reader's draft nodes: node i at its source's length before
        ``append_tree`` plus its depth, as the source's node i."""
        return first + self.shared.offset + depths

    def tree_batch(self, tree: TreeBatch) -> TreeBatch:
        """The draft as this reader verifies it: its source's, under the same tree mask (a
        sibling seen would leak another branch into a node's logits)."""
        return tree


def is_cached(cache: object) -> bool:
    """Whether the rows a layer attends over come from a cache (not an uncached pass)."""
    if isinstance(cache, SharedReader):
        cache = cache.shared
    return cache is not None and not (isinstance(cache, SharedRows) and cache.cache is None)


def at_least_float32(dtype: torch.dtype) -> torch.dtype:
    """float32 for half precision, else ``dtype``: half-precision models take norms in
    float32, as real ones do (attention, in float64: ``attention``). It also keeps their
    results independent of how many tokens a call holds (torch's half-precision rsqrt and exp
    take other paths for other sizes), so that a cached run differs from an uncached one only
    by what its cache did; and torch's half-precision matmuls on the CPU are slow."""
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: Tensor) -> Tensor:
        wide = x.to(at_least_float32(x.dtype))
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


def rows_laid_out(rows: Sequence[Tensor], padding: str, device=None) -> tuple[Tensor, list[int]]:
    """Token ids for ``forward_rows``: row b's new tokens ``rows[b]`` (none allowed) in the
    slots ``padding`` says, pads token 0; and the count per row."""
    counts = [len(tokens) for tokens in rows]
    width = max(1, *counts)
    laid = torch.zeros(len(rows), width, dtype=torch.long, device=device)
    for row, tokens in enumerate(rows):
        laid[row, row_slots(padding, width, counts[row])] = tokens
    return laid, counts


def row_positions(starts: Tensor, real: Tensor) -> Tensor:
    """(B, T) positions of a call of ``forward_rows``: a real slot's is its row's next one
    (``starts``, (B,)) plus its index among the row's new tokens, wherever padding puts them;
    a pad's is any (its keys are poisoned, its logits nan)."""
    return (starts[:, None] + real.cumsum(dim=1) - 1).clamp(min=0)


@dataclass(frozen=True)
class RowBatch:
    """How one call of ``ReferenceTransformer.forward_rows`` lays its rows out (contract,
    section 8.1): row b brings ``counts[b]`` new tokens, in the slots ``real`` marks, after
    the ``lengths[b]`` its caches hold from position ``firsts[b]``; pad slots carry ``pad``."""

    counts: tuple[int, ...]
    real: Tensor  # (B, T) booleans: the slots that hold a row's new tokens
    lengths: tuple[int, ...]
    firsts: tuple[int, ...]
    pad: float


def tree_paths(parents: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """Each draft node's path (contract, section 9.2): its root, ..., its parent, itself."""
    paths: list[tuple[int, ...]] = []
    for node, parent in enumerate(parents):
        paths.append((*(paths[parent] if parent >= 0 else ()), node))
    return tuple(paths)


def tree_mask(parents: Sequence[int], device=None) -> Tensor:
    """(T, T) booleans: ``[i, j]`` where node j is node i or one of its ancestors, the only
    draft nodes node i sees (section 9.2)."""
    nodes = len(parents)
    seen = torch.zeros(nodes, nodes, dtype=torch.bool, device=device)
    for node, path in enumerate(tree_paths(parents)):
        seen[node, list(path)] = True
    return seen


@dataclass(frozen=True)
class TreeBatch:
    """How one call of ``ReferenceTransformer.forward_tree`` lays its draft nodes out
    (contract, section 9.2): node i's parent is ``parents[i]`` (-1: the last committed
    token), after the ``held`` tokens the caches hold, and it sees the nodes ``seen[i]``
    marks (``tree_mask``)."""

    parents: tuple[int, ...]
    held: int
    seen: Tensor  # (T, T) booleans


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.config = config
        self.layer = layer
        self.window = config.layer_window(layer)
        self.sinks = config.layer_sinks(layer)
        c = config
        # What the cache is handed: the keys (in MLA, the rope key) and the values (the latent).
        self.query = nn.Linear(c.d_model, c.num_heads * c.query_width, bias=False)
        self.key = nn.Linear(c.d_model, c.num_kv_heads * c.key_width, bias=False)
        self.value = nn.Linear(c.d_model, c.num_kv_heads * c.value_width, bias=False)
        self.out = nn.Linear(c.attention_width, c.d_model, bias=False)
        if c.attention == "mla":  # each head's no-rope key channels and value, from the latent
            self.up_key = nn.Linear(c.latent_dim, c.num_heads * c.nope_dim, bias=False)
            self.up_value = nn.Linear(c.latent_dim, c.num_heads * c.head_dim, bias=False)

    def forward(
        self,
        x: Tensor,
        positions: Tensor,
        cache: LayerCache | None,
        rows: RowBatch | TreeBatch | None = None,
        first: int = 0,
        keys: str = "rotated",
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Return the attention output and the new tokens' keys (rotated, or with ``keys``
        "unrotated" as they were before RoPE) and values; with ``rows`` a ``RowBatch``, through
        ``append_rows`` with each row's own positions (``positions`` (B, T)); a ``TreeBatch``,
        through ``append_tree``, each draft node at its depth. ``first`` is the position of
        the session's first token (where its sinks are)."""
        c = self.config
        batch, new_tokens, _ = x.shape

        def heads(projected: Tensor, count: int) -> Tensor:  # (B, T, count x D) to (B, count, T, D)
            return projected.view(batch, new_tokens, count, -1).transpose(1, 2)

        q = heads(self.query(x), c.num_heads)
        unrotated = heads(self.key(x), c.num_kv_heads)
        v = heads(self.value(x), c.num_kv_heads)
        firsts = rows.firsts if isinstance(rows, RowBatch) else first
        sink_query = self._sink_query(q, positions, firsts)
        q = self._rotate_query(q, positions)
        k = apply_rope(unrotated, positions, c.rope_base)
        # What the cache is handed: keys rotated at their positions, never rotated again; or,
        # to a cache that keeps them unrotated (section 8.4), as they are, the model rotating
        # what it returns at their current positions.
        stored = "rotated" if cache is None else keys_stored(cache)
        handed = k if stored == "rotated" else unrotated
        if isinstance(rows, TreeBatch):
            mixed = self._attend_tree(q, handed, v, positions, cache, rows, first, sink_query)
        elif rows is not None:
            mixed = self._attend_rows(q, handed, v, positions, cache, rows, sink_query)
        elif (
            stored == "rotated"
            and sink_query is None
            and c.attention == "gqa"  # an MLA cache holds no per-head keys to attend over
            and callable(getattr(cache, "attend", None))
        ):
            # The cache computes attention itself (a paged kernel, say): no rows come back.
            mixed = cache.attend(q, k, v)
            self._check_attended(mixed, q)
        elif (
            stored == "rotated"
            and sink_query is None
            and c.attention == "mla"
            and callable(getattr(cache, "attend_latent", None))
        ):
            mixed = self._attend_latent(q, k, v, cache)
        else:
            # Rows, not positions: a cache's first position need not be 0 (section 8.3).
            before = 0 if cache is None else cache.length
            all_k, all_v = (k, v) if cache is None else cache.append(handed, v)
            if cache is not None:
                self._check_returned_rows(
                    all_k, all_v, batch, start=before, end=before + new_tokens
                )
            # The keys held are the sinks, then the most recent ones, ending at the last new
            # position (without a window and with caches: every one from the first position).
            if is_cached(cache):
                end = int(positions[-1]) + 1
                kept = kept_rows(self.sinks, all_k.shape[-2], end - first)
                key_positions = first + torch.tensor(kept, dtype=torch.long, device=x.device)
            else:  # the keys are this call's tokens, at their positions (gaps and all)
                key_positions = positions
            if stored == "unrotated":
                all_k = apply_rope(all_k, key_positions, c.rope_base)
            mixed = self._attention(
                is_cached(cache),
                q,
                all_k,
                all_v,
                positions,
                key_positions,
                self.window,
                sink_end=first + self.sinks,
                sink_query=sink_query,
            )
        mixed = mixed.transpose(1, 2).reshape(batch, new_tokens, c.attention_width)
        return self.out(mixed), k if keys == "rotated" else unrotated, v

    def _sink_query(self, q: Tensor, positions: Tensor, first) -> Tensor | None:
        """With sinks at their positions in the cache (section 8.5): ``q`` (not yet rotated)
        rotated as far back as its sinks sit closer to it, else None. StreamingLLM numbers a
        query's keys by their slots, sinks first: the window keeps its distance from the
        query, and sink j sits just before the window, at index j + max(0, i - W + 1 - S)
        for the query at index i; the scores depending on the distance alone, that is the
        query rotated max(0, i - W + 1 - S) positions back against the sinks as given."""
        if not self.sinks or self.config.sink_positions == "original":
            return None
        firsts = torch.as_tensor(first, device=positions.device)
        index = positions - (firsts[:, None] if firsts.ndim else firsts)
        gap = (index - (self.window - 1) - self.sinks).clamp(min=0)
        return self._rotate_query(q, (positions - gap).clamp(min=0))

    def _rotate_query(self, q: Tensor, positions: Tensor) -> Tensor:
        """``q`` rotated at ``positions``: every channel, or in MLA its rope channels alone."""
        if self.config.attention == "gqa":
            return apply_rope(q, positions, self.config.rope_base)
        nope, rope = q.split((self.config.nope_dim, self.config.rope_dim), dim=-1)
        return torch.cat((nope, apply_rope(rope, positions, self.config.rope_base)), dim=-1)

    def _attention(self, cached: bool, q: Tensor, keys: Tensor, values: Tensor, *args, **kwargs):
        """``attention`` over the rows a cache returned (``cached``) or the uncached pass's:
        per head over them, or in MLA over what they hold (``latent_attention``)."""
        if self.config.attention == "gqa":
            return attention(q, keys, values, *args, **kwargs)
        path = self.config.mla_path if cached else "naive"
        return latent_attention(self, path, q, keys, values, *args, **kwargs)

    def _attend_rows(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        positions: Tensor,
        cache,
        rows: RowBatch,
        sink_query: Tensor | None = None,
    ) -> Tensor:
        """Hand the new rows to ``append_rows``, pads poisoned, and attend each batch row over
        the rows it marks valid, at that row's positions."""
        pads = ~rows.real[:, None, :, None]
        all_k, all_v, valid = cache.append_rows(
            k.masked_fill(pads, rows.pad), v.masked_fill(pads, rows.pad), rows.counts
        )
        held = self._check_returned_row_batch(all_k, all_v, valid, q.shape[0], rows)
        # A row's valid rows are its sinks, then its most recent ones, ending at its last new
        # position.
        firsts = torch.tensor(rows.firsts, device=q.device)
        totals = torch.tensor(
            [length + count for length, count in zip(rows.lengths, rows.counts, strict=True)],
            device=q.device,
        )
        index = valid.cumsum(dim=1) - 1  # each valid slot's index among its row's
        sinks = held.clamp(max=self.sinks)[:, None]
        kept = torch.where(index < sinks, index, (totals - held)[:, None] + index)
        key_positions = firsts[:, None] + kept
        sink_end = firsts + self.sinks
        # Ragged rows attend as a varlen kernel does, each over its own rows alone (section
        # 8.2: the dense masked path would attend every row over the longest row's slots);
        # rows of one length, no slot a pad, in one batched call.
        attend = functools.partial(self._attention, True)
        if keys_stored(cache) == "unrotated":  # each row's keys at its own positions
            attend = functools.partial(rotating_keys, attend, self.config.rope_base)
        if not bool(valid.all()):
            attend = functools.partial(varlen_attention, attend, valid=valid)
        return attend(
            q,
            all_k,
            all_v,
            positions,
            key_positions,
            self.window,
            sink_end=sink_end,
            sink_query=sink_query,
        )

    def _attend_tree(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        positions: Tensor,
        cache,
        tree: TreeBatch,
        first: int,
        sink_query: Tensor | None = None,
    ) -> Tensor:
        """Hand the draft nodes to ``append_tree`` and attend each node over the committed rows
        (by position: causal, within the window) and its own ancestors and itself alone."""
        nodes = len(tree.parents)
        all_k, all_v = cache.append_tree(k, v, tree.parents)
        self._check_returned_rows(
            all_k, all_v, q.shape[0], start=tree.held, end=tree.held + nodes, call="append_tree"
        )
        # The rows returned: the sinks and a recent run of the committed ones, then every node.
        kept = torch.tensor(
            kept_rows(self.sinks, all_k.shape[-2], tree.held + nodes), device=q.device
        )
        committed, node = kept < tree.held, (kept - tree.held).clamp(min=0)
        key_positions = torch.where(committed, first + kept, positions[node])
        if keys_stored(cache) == "unrotated":
            all_k = apply_rope(all_k, key_positions, self.config.rope_base)
        visible = committed | tree.seen[:, node]  # (nodes, rows)
        return self._attention(
            True,
            q,
            all_k,
            all_v,
            positions,
            key_positions,
            self.window,
            sink_end=first + self.sinks,
            sink_query=sink_query,
            visible=visible,
        )

    def _check_returned_row_batch(
        self, keys: object, values: object, valid: object, batch: int, rows: RowBatch
    ) -> Tensor:
        """What append_rows returned: keys and values (B, H_kv, L, D), ``valid`` (B, L)
        booleans marking, per row, all its rows (or with a window at least the last W - 1
        before the new ones and the new ones); returns the count per row."""
        c = self.config
        shaped = (
            isinstance(valid, Tensor)
            and self._rows_shaped(keys, values, batch)
            and valid.dtype == torch.bool
            and valid.shape == (batch, keys.shape[2])
            and keys.dtype == values.dtype == self.out.weight.dtype
            and valid.device == keys.device
        )
        if not shaped:
            got = [
                f"{tuple(t.shape)} {t.dtype}" if isinstance(t, Tensor) else type(t).__name__
                for t in (keys, values, valid)
            ]
            raise CacheContractError(
                f"layer {self.layer}: append_rows must return keys and values shaped ({batch}, "
                f"{c.num_kv_heads}, rows, {self._widths}) in {self.out.weight.dtype} and valid "
                f"booleans ({batch}, rows) on their device; it returned keys {got[0]}, values "
                f"{got[1]} and valid {got[2]}"
            )
        held = valid.sum(dim=1)
        for row, (length, count) in enumerate(zip(rows.lengths, rows.counts, strict=True)):
            end = length + count
            fewest = rows_needed(self.window, end, count, self.sinks)
            if not fewest <= int(held[row]) <= end:
                want = f"{end}" if fewest == end else f"{fewest} to {end}"
                raise CacheContractError(
                    f"layer {self.layer}: row {row} held {length} tokens and got {count} more "
                    f"(its neighbours: {list(rows.lengths)} held, {list(rows.counts)} new), so "
                    f"append_rows must mark {want} of its rows valid; it marked {int(held[row])}"
                )
        return held

    def _attend_latent(self, q: Tensor, k: Tensor, v: Tensor, cache) -> Tensor:
        """MLA's absorbed path computed by the cache (section 10.2): the no-rope query folded
        into the latent space beside the rope channels, in the model's dtype; the weighted
        latents the cache returns, up-projected per head in float64."""
        c = self.config
        wide = torch.float32 if q.device.type == "mps" else torch.float64
        up_key = self.up_key.weight.to(wide).view(c.num_heads, c.nope_dim, c.latent_dim)
        up_value = self.up_value.weight.to(wide).view(c.num_heads, c.head_dim, c.latent_dim)
        nope, rope = q.split((c.nope_dim, c.rope_dim), dim=-1)
        folded = torch.einsum("bhtn,hnc->bhtc", nope.to(wide), up_key).to(q.dtype)
        query = torch.cat((folded, rope), dim=-1)
        latents = cache.attend_latent(query, k, v, 1 / math.sqrt(c.query_width))
        self._check_output(
            latents, (*q.shape[:3], c.latent_dim), q.dtype, "attend_latent", "the weighted latents"
        )
        return torch.einsum("bhtc,hdc->bhtd", latents.to(wide), up_value).to(q.dtype)

    def _check_attended(self, mixed: object, query: Tensor) -> None:
        self._check_output(
            mixed, query.shape, query.dtype, "attend", "a tensor shaped like the query"
        )

    def _check_output(
        self, result: object, shape, dtype: torch.dtype, call: str, what: str
    ) -> None:
        """What a cache's own attention (``call``) returned is a tensor of ``shape`` in
        ``dtype``; else a ``CacheContractError`` saying what it returned."""
        if isinstance(result, Tensor) and result.shape == tuple(shape) and result.dtype == dtype:
            return
        got = (
            f"{tuple(result.shape)} {result.dtype}"
            if isinstance(result, Tensor)
            else type(result).__name__
        )
        raise CacheContractError(
            f"layer {self.layer}: {call} must return {what}, {tuple(shape)} in {dtype}; it "
            f"returned {got}"
        )

    def _rows_shaped(self, keys: object, values: object, batch: int) -> bool:
        """Keys and values of this layer, as many of each: (batch, kv_heads, rows, width), the
        keys' width and the values' their own (in MLA, the rope key's and the latent's)."""
        c = self.config
        return (
            isinstance(keys, Tensor)
            and isinstance(values, Tensor)
            and keys.ndim == values.ndim == 4
            and keys.shape[:3] == values.shape[:3]
            and keys.shape[:2] == (batch, c.num_kv_heads)
            and (keys.shape[3], values.shape[3]) == (c.key_width, c.value_width)
        )

    @property
    def _widths(self) -> str:
        """The width of a returned row, for a message: head_dim, or in MLA the two widths."""
        c = self.config
        if c.key_width == c.value_width:
            return str(c.key_width)
        return f"{c.key_width} for keys and {c.value_width} for values"

    def _check_returned_rows(
        self,
        keys: Tensor,
        values: Tensor,
        batch: int,
        *,
        start: int,
        end: int,
        call: str = "append",
    ) -> None:
        """What append (or ``call``) returned is a run of the most recent rows: all ``end`` of
        them, or with a window at least the last W - 1 before the new ones and the new ones."""
        c = self.config
        new_tokens = end - start
        fewest = rows_needed(self.window, end, new_tokens, self.sinks)
        ok = self._rows_shaped(keys, values, batch) and fewest <= keys.shape[2] <= end
        if not ok:
            rows = f"{end}" if fewest == end else f"{fewest} to {end}"
            window = "" if self.window is None else f" (window {self.window})"
            if self.sinks:
                window = f" (window {self.window} and {self.sinks} sinks)"
            raise CacheContractError(
                f"layer {self.layer}: the caches' length was {start} before this call, so "
                f"after appending {new_tokens} tokens {call} must return {rows} rows{window}, "
                f"shaped ({batch}, {c.num_kv_heads}, rows, {self._widths}); it returned keys "
                f"{tuple(keys.shape)} and values {tuple(values.shape)}"
            )


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.d_model)
        self.attention = Attention(config, layer)
        self.ffn_norm = RMSNorm(config.d_model)
        self.ffn_in = nn.Linear(config.d_model, config.ffn_dim, bias=False)
        self.ffn_out = nn.Linear(config.ffn_dim, config.d_model, bias=False)
        # Made last, so that a "silu" model's weights are drawn as they always were.
        if config.ffn == "swiglu":
            self.ffn_gate = nn.Linear(config.d_model, config.ffn_dim, bias=False)

    def forward(
        self,
        x: Tensor,
        positions: Tensor,
        cache: LayerCache | None,
        rows: RowBatch | TreeBatch | None = None,
        first: int = 0,
        keys: str = "rotated",
    ):
        normed = self.attention_norm(x)
        attended, k, v = self.attention(normed, positions, cache, rows, first, keys)
        x = x + attended
        return x + self.feed_forward(x), k, v

    def feed_forward(self, x: Tensor) -> Tensor:
        """The block's feed-forward branch on the residual ``x`` (its norm first), to be added
        to it: down(silu(in(n))), or with ``ffn="swiglu"`` down(silu(gate(n)) * in(n))."""
        normed = self.ffn_norm(x)
        hidden = self.ffn_in(normed)
        if hasattr(self, "ffn_gate"):
            hidden = F.silu(self.ffn_gate(normed)) * hidden
        else:
            hidden = F.silu(hidden)
        return self.ffn_out(hidden)


class ReferenceTransformer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype: torch.dtype = torch.float64,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config, layer) for layer in range(config.num_layers))
        self.final_norm = RMSNorm(config.d_model)
        self._init_weights()
        self.to(dtype=dtype, device=device)
        self.eval()

    @torch.no_grad()
    def _init_weights(self) -> None:
        # Drawn in float64 from the config's seed alone, so a float32 model is the float64
        # model rounded, and no test depends on the global random state.
        generator = torch.Generator().manual_seed(self.config.seed)
        for name, parameter in self.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator, dtype=torch.float64)
            if name.endswith("norm.weight"):
                parameter.copy_(1.0 + 0.1 * noise)  # not all ones, so a skipped norm shows
            elif name == "embedding.weight":
                parameter.copy_(noise)
            else:
                parameter.copy_(noise / math.sqrt(parameter.shape[1]))

    @property
    def dtype(self) -> torch.dtype:
        return self.embedding.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embedding.weight.device

    def cache_spec(self, batch: int, max_length: int, *, layer: int = 0) -> CacheSpec:
        """The CacheSpec layer ``layer``'s cache is built from (layers differ in window only)."""
        for name, number in (("batch", batch), ("max_length", max_length)):
            if isinstance(number, bool) or not isinstance(number, int) or number < 1:
                raise ValueError(f"{name} must be a positive int, got {number!r}")
        c = self.config
        return CacheSpec(
            batch,
            c.num_kv_heads,
            c.key_width,
            max_length,
            self.dtype,
            self.device,
            window=c.layer_window(layer),
            sinks=c.layer_sinks(layer),
            rope_base=c.rope_base,
            value_dim=c.value_width if c.attention == "mla" else None,
        )

    def new_caches(
        self, factory: CacheFactory, *, batch: int, max_length: int
    ) -> list[LayerCache | None]:
        """One fresh cache per layer, each built from its layer's CacheSpec; None for a layer
        that reads another's (``kv_sources``)."""
        return [
            None
            if self.config.source_of(layer) is not None
            else factory(self.cache_spec(batch, max_length, layer=layer))
            for layer in range(self.config.num_layers)
        ]

    @torch.no_grad()
    def forward(
        self,
        token_ids: Tensor,
        caches: Sequence[LayerCache] | None = None,
        *,
        start_position: int = 0,
        positions: Tensor | None = None,
    ) -> Tensor:
        """Logits shaped (batch, T, vocab) for the T tokens given, after those in the caches.

        Without caches the tokens sit at ``start_position`` onwards; RoPE is relative, so the
        logits do not depend on it (a property the tests check). With caches they start at
        the caches' common length. ``positions`` (uncached calls only): each token's own, T
        increasing ints, gaps allowed; the oracle of an engine whose memory operations leave
        a sequence's positions apart (contract, section 13).
        """
        self._check_token_ids(token_ids)
        if positions is not None:
            if caches is not None or start_position:
                raise ValueError("positions is for uncached calls that set no start_position")
            at = self._checked_positions(positions, token_ids.shape[1])
            logits, _ = self._run(token_ids, None, int(at[0]), int(at[0]), positions=at)
            return logits
        if isinstance(start_position, bool) or not isinstance(start_position, int):
            raise TypeError(f"start_position must be an int, got {type(start_position).__name__}")
        if start_position < 0:
            raise ValueError(f"start_position must be >= 0, got {start_position}")
        if caches is None:
            offset = start_position
        elif start_position:
            raise ValueError("start_position is for uncached calls; caches set their own")
        else:
            first = self._first_position(caches)
            offset = self._check_caches(caches, batch=token_ids.shape[0]) + first
            start_position = first
        logits, _ = self._run(token_ids, caches, offset, start_position)
        return logits

    @staticmethod
    def _first_position(caches: Sequence[LayerCache]) -> int:
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

    @torch.no_grad()
    def forward_rows(
        self,
        token_ids: Tensor,
        counts: Sequence[int],
        caches: Sequence[LayerCache],
        *,
        pad: float = float("nan"),
    ) -> Tensor:
        """Logits (batch, T, vocab) for a batch whose rows bring ``counts[b]`` new tokens each
        (contract, section 8.1), through caches that offer ``append_rows``: row b's tokens sit
        in the slots of ``token_ids`` the caches' ``padding`` says (the first ``counts[b]``,
        or with ``"left"`` the last), at positions from its ``first_position`` plus its
        ``row_lengths`` on. Pad slots give nan logits, and their keys and values reach the
        caches as ``pad``, so that a pad let into attention shows. A layer that reads another's
        cache (``kv_sources``) attends over what its source's ``append_rows`` returned, each
        row at its own positions (section 10.3)."""
        self._check_token_ids(token_ids)
        batch, new_tokens = token_ids.shape
        lengths, firsts, padding = self._check_row_caches(caches, batch)
        counts = check_counts(counts, batch, new_tokens)
        real = torch.zeros(batch, new_tokens, dtype=torch.bool, device=self.device)
        for row, count in enumerate(counts):
            real[row, row_slots(padding, new_tokens, count)] = True
        starts = torch.tensor([f + n for f, n in zip(firsts, lengths, strict=True)])
        positions = row_positions(starts.to(self.device), real)
        rows = RowBatch(counts, real, lengths, firsts, pad)
        x = self.embedding(token_ids)
        for cache, block in zip(self._shared_caches(caches), self.blocks, strict=True):
            at = cache.row_positions(firsts, real) if isinstance(cache, SharedReader) else positions
            x, _, _ = block(x, at, cache, rows)
        logits = self.final_norm(x) @ self.embedding.weight.T
        return logits.masked_fill(~real[..., None], float("nan"))

    def _shared_caches(self, caches: Sequence[LayerCache | None]) -> list:
        """Each layer's cache as its block is handed it (section 10.3): its own; wrapped in
        ``SharedRows`` where later layers read it; for a reader, a ``SharedReader`` of its
        source's in place of its None."""
        c = self.config
        read = {c.source_of(layer) for layer in range(c.num_layers)} - {None}
        handed: list = []
        for layer, cache in enumerate(caches):
            source = c.source_of(layer)
            if source is not None:
                cache = SharedReader(handed[source])
            elif layer in read:
                cache = SharedRows(cache)
            handed.append(cache)
        return handed

    def _check_row_caches(
        self, caches: Sequence[LayerCache], batch: int
    ) -> tuple[tuple[int, ...], tuple[int, ...], str]:
        """Caches with per-row lengths, consistent across layers: their row lengths, first
        positions and padding, checked before any is touched."""
        # The batch from row_lengths, not a spec's: rows leave and join (select_rows, join).
        self._check_caches(caches, batch=None)
        self._check_offered(caches, "append_rows")
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

    @torch.no_grad()
    def forward_tree(
        self, token_ids: Tensor, parents: Sequence[int], caches: Sequence[LayerCache]
    ) -> Tensor:
        """Logits (batch, T, vocab) of T draft nodes verified as a tree (contract, section 9.2),
        through caches that offer ``append_tree``: node i is a child of node ``parents[i]`` (an
        earlier one, or -1 for the last committed token) and sits at position L + depth(i)
        after the L tokens the caches hold. Node i attends the committed rows and its own
        ancestors and itself, nothing else, so its logits are the uncached model's on the
        committed tokens and its path's (``forward_tree_uncached``). The caches then hold L + T
        rows until ``commit_tree``."""
        self._check_token_ids(token_ids)
        batch, nodes = token_ids.shape
        parents = check_tree(parents, nodes)
        held = self._check_caches(caches, batch=batch)
        self._check_offered(caches, "append_tree")
        first = self._first_position(caches)
        depths = torch.tensor(tree_depths(parents), device=self.device)
        tree = TreeBatch(parents, held, tree_mask(parents, self.device))
        x = self.embedding(token_ids)
        for cache, block in zip(self._shared_caches(caches), self.blocks, strict=True):
            at, drafted = first + held + depths, tree
            if isinstance(cache, SharedReader):  # at its source's nodes, under the same mask
                at, drafted = cache.tree_positions(first, depths), cache.tree_batch(tree)
            x, _, _ = block(x, at, cache, drafted, first)
        return self.final_norm(x) @ self.embedding.weight.T

    @torch.no_grad()
    def forward_tree_uncached(
        self, history: Tensor, token_ids: Tensor, parents: Sequence[int], *, start_position=0
    ) -> Tensor:
        """The oracle of ``forward_tree``: (batch, T, vocab), node i's logits the uncached
        model's on ``history`` (batch, L: the committed tokens, from ``start_position``) then
        the tokens of node i's path (``tree_paths``), at its last position. One uncached pass
        over every leaf's path, the leaves side by side in one batch (right-padded: a causal
        model's earlier positions never see the padding)."""
        self._check_token_ids(token_ids)
        batch, nodes = token_ids.shape
        parents = check_tree(parents, nodes)
        paths = tree_paths(parents)
        leaves = [path for node, path in enumerate(paths) if node not in parents]
        deepest = max(len(path) for path in leaves)
        laid = torch.zeros(len(leaves), batch, deepest, dtype=token_ids.dtype, device=self.device)
        for leaf, path in enumerate(leaves):
            laid[leaf, :, : len(path)] = token_ids[:, list(path)]
        held = history.shape[1]
        tokens = torch.cat((history.expand(len(leaves), *history.shape), laid), dim=2)
        logits = self(tokens.flatten(0, 1), start_position=start_position)[:, held:]
        logits = logits.unflatten(0, (len(leaves), batch))
        by_node = logits.new_empty(batch, nodes, logits.shape[-1])
        for leaf, path in enumerate(leaves):
            by_node[:, list(path)] = logits[leaf, :, : len(path)]
        return by_node

    def truncate(self, caches: Sequence[LayerCache], length: int) -> None:
        """Forget every token at position >= ``length`` in every layer's cache (speculative
        decoding, regenerate). Checks the caches and ``length`` before touching any layer.

        A window layer may refuse when it has dropped a position that the next query needs;
        the widest windows are asked first, so that such a refusal comes before any layer
        changed (layers of one window keep the same positions)."""
        held = self._check_caches(caches, batch=None)
        self._check_offered(caches, "truncate")
        if isinstance(length, bool) or not isinstance(length, int):
            raise TypeError(f"truncate: length must be an int, got {type(length).__name__}")
        check_truncate(held, length)
        for layer in self.widest_window_first():
            caches[layer].truncate(length)

    def shift(self, caches: Sequence[LayerCache], start, count) -> None:
        """Discard the tokens of indices ``start`` to ``start + count - 1`` in every layer's
        cache and move the later ones down (a context shift, contract section 8.4); with a
        tuple each, row b's ``start[b]`` and ``count[b]`` (a shift per row). Checks the caches
        and the span before touching any layer; a window layer may refuse where the next
        query needs a row it was not bound to keep, the widest asked first."""
        if is_row_shift(start, count):
            start, count = self._checked_row_shift(caches, start, count)
        else:
            held = self._check_caches(caches, batch=None)
            self._check_offered(caches, "shift")
            check_shift(held, start, count)
        for layer in self.widest_window_first():
            caches[layer].shift(start, count)

    def _checked_row_shift(self, caches: Sequence[LayerCache], starts, counts):
        """A shift per row's tuples, checked against every layer's rows (each declaring
        ``shift_per_row``) before any is touched."""
        self._check_offered(caches, "shift")
        first = next((cache for cache in caches if cache is not None), None)
        batch = len(getattr(first, "row_lengths", ()))
        lengths, _, _ = self._check_row_caches(caches, batch)
        for layer, cache in enumerate(caches):
            if cache is not None and not shifts_per_row(cache):
                raise CacheContractError(
                    f"layer {layer}: {type(cache).__name__} declares no shift per row "
                    f"(shift_per_row = True beside append_rows and shift, section 8.4)"
                )
        return check_shift_rows(lengths, starts, counts)

    def widest_window_first(self) -> list[int]:
        """The layers, widest window first and global layers last: a window layer that must
        refuse a rollback or a shift then refuses before any layer changed (layers of one
        window keep the same positions, and a global layer never needs to refuse)."""
        windows = [self.config.layer_window(layer) for layer in range(self.config.num_layers)]
        return sorted(
            self.config.cache_layers,
            key=lambda layer: (windows[layer] is None, -(windows[layer] or 0)),
        )

    def reorder(self, caches: Sequence[LayerCache], indices: Tensor) -> None:
        """Batch row b of every layer's cache becomes the old row ``indices[b]`` (beam
        search). Checks the caches and ``indices`` before touching any layer."""
        self._check_caches(caches, batch=None)
        self._check_offered(caches, "reorder")
        if not isinstance(indices, Tensor):
            raise TypeError(
                f"reorder: indices must be a torch.Tensor, got {type(indices).__name__}"
            )
        # The batch a cache's spec says, else the one the indices imply.
        specs = [getattr(caches[layer], "spec", None) for layer in self.config.cache_layers]
        batches = {spec.batch for spec in specs if isinstance(spec, CacheSpec)}
        batch = batches.pop() if len(batches) == 1 else indices.numel()
        check_reorder(self.cache_spec(batch, 1), indices)
        for layer in self.config.cache_layers:
            caches[layer].reorder(indices)

    @staticmethod
    def _check_offered(caches: Sequence[LayerCache], capability: str) -> None:
        for layer, cache in enumerate(caches):
            if cache is not None and not callable(getattr(cache, capability, None)):
                raise CacheContractError(
                    f"layer {layer}: {type(cache).__name__} offers no {capability}()"
                )

    @torch.no_grad()
    def forward_with_kv(
        self, token_ids: Tensor, *, start_position: int = 0, keys: str = "rotated"
    ) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        """The uncached pass: logits, and each layer's keys and its values, shaped (batch,
        kv_heads, T, head_dim), which is what a cache given ``token_ids`` must hold (from
        position ``start_position``): the keys rotated, or for a cache that keeps them
        ``keys`` "unrotated" (section 8.4), as they were before RoPE."""
        self._check_token_ids(token_ids)
        if not is_count(start_position):
            raise ValueError(f"start_position must be an int >= 0, got {start_position!r}")
        if keys not in KEYS_STORED:
            raise ValueError(f"keys must be one of {KEYS_STORED}, got {keys!r}")
        return self._run(token_ids, None, start_position, start_position, keys)

    def _checked_positions(self, positions: object, tokens: int) -> Tensor:
        if not isinstance(positions, Tensor) or positions.dtype != torch.long:
            raise TypeError(f"positions must be a torch.long tensor, got {positions!r}")
        if positions.shape != (tokens,):
            raise ValueError(f"positions must be shaped ({tokens},), got {tuple(positions.shape)}")
        if tokens and (int(positions[0]) < 0 or bool((positions.diff() <= 0).any())):
            raise ValueError(f"positions must be increasing ints >= 0, got {positions.tolist()}")
        return positions.to(self.device)

    def _run(
        self,
        token_ids: Tensor,
        caches: Sequence[LayerCache] | None,
        offset: int,
        first: int,
        keys: str = "rotated",
        positions: Tensor | None = None,
    ):
        """The tokens at positions ``offset`` onwards (or, uncached, at ``positions``), in a
        session whose first token sat at ``first`` (its sinks); each layer's new keys
        (rotated or not, ``keys``) and values."""
        c = self.config
        new_tokens = token_ids.shape[1]
        if positions is None:
            positions = torch.arange(offset, offset + new_tokens, device=self.device)
        x = self.embedding(token_ids)
        keys_and_values = []
        read = {c.source_of(layer) for layer in range(c.num_layers)} - {None}
        shared: dict[int, SharedRows] = {}  # a source layer's rows of this step, for its readers
        for layer, block in enumerate(self.blocks):
            source, at = c.source_of(layer), positions
            if source is not None:
                cache = SharedReader(shared[source])
                if caches is not None:  # queries at the positions the source's rows were given
                    at = first + shared[source].offset + torch.arange(new_tokens, device=x.device)
            else:
                cache = None if caches is None else caches[layer]
                if layer in read:
                    cache = shared[layer] = SharedRows(cache)
            x, k, v = block(x, at, cache, first=first, keys=keys)
            keys_and_values.append((k, v) if source is None else keys_and_values[source])
        logits = self.final_norm(x) @ self.embedding.weight.T  # tied output embedding
        return logits, keys_and_values

    def _check_token_ids(self, token_ids: object) -> None:
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
        if low < 0 or high >= self.config.vocab_size:
            raise ValueError(
                f"token id out of the vocabulary [0, {self.config.vocab_size}): "
                f"ids range from {low} to {high}"
            )

    def _check_caches(self, caches: Sequence[LayerCache], *, batch: int | None) -> int:
        """Reject inconsistent caches before any is touched; return their common length.
        With ``batch`` None, a cache's spec is checked for everything but the batch."""
        if not isinstance(caches, Sequence) or isinstance(caches, str):
            raise TypeError(f"caches must be a sequence of caches, got {type(caches).__name__}")
        layers = self.config.num_layers
        if len(caches) != layers:
            raise CacheContractError(
                f"wrong number of caches: {layers} layers need {layers}, got {len(caches)}"
            )
        for layer, cache in enumerate(caches):
            source = self.config.source_of(layer)
            if source is not None and cache is not None:
                raise CacheContractError(
                    f"layer {layer} reads layer {source}'s cache (kv_sources), but was handed a "
                    f"cache of its own ({type(cache).__name__}); its entry must be None"
                )
            if source is None and cache is None:
                raise CacheContractError(
                    f"layer {layer}: no cache (None), and it reads no other layer's (kv_sources)"
                )
        owned = self.config.cache_layers
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
            wanted = self.cache_spec(batch or spec.batch, max(lengths[0], 1), layer=layer)
            # Not the window: a cache may ignore it and keep everything (the mask applies it).
            for field in ("batch", "kv_heads", "head_dim", "value_width", "dtype"):
                if getattr(spec, field) != getattr(wanted, field):
                    raise CacheContractError(
                        f"layer {layer}: cache built for {field} {getattr(spec, field)}, but this "
                        f"call needs {field} {getattr(wanted, field)}"
                    )
        return lengths[0]
