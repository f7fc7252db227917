"""A small decoder-only transformer, written to be trusted: the oracle every cache is held to.

Pre-norm blocks (RMSNorm), rotary position embeddings (RoPE), grouped-query attention
(``num_kv_heads`` divides ``num_heads``; equal means ordinary multi-head attention), a SiLU
feed-forward block and a tied output embedding. There is no dropout, so the model is a pure
function of its weights, which come from ``config.seed`` alone (token 0 embeds to zeros, as a
padding token often does: ``ZERO_TOKEN``).

``model(token_ids)`` runs the whole sequence at once. ``model(token_ids, caches=caches)`` runs
only the new tokens: their positions start at the caches' common length, their rotated keys
and values are appended to each layer's cache, and the mask compares absolute positions so
a chunk of several new tokens on a warm cache is masked correctly. ``forward_rows`` gives
each batch row new tokens of its own count, and ``forward_tree`` verifies a tree of draft
tokens in one call, each node seeing the committed tokens, its ancestors and itself alone
(speculative decoding).

This module holds the math a reader reads once, in nanoGPT's order: the config, the norm,
attention, the block and the model. What each call leans on lives beside it, one idea per
module: rotary embeddings (``kvref.rope``), the guards on what the model is handed and what
caches return (``kvref.guards``), rows of their own and their varlen attention
(``kvref.rows``, ``kvref.varlen``), draft trees (``kvref.tree``), latent attention
(``kvref.latent``), layers that read another's cache (``kvref.shared``) and the oracle of a
context shift (``kvref.shift_oracle``).
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

from kvref.checks import (
    check_counts,
    check_tree,
)
from kvref.guards import (
    check_caches,
    check_offered,
    check_output,
    check_returned_row_batch,
    check_returned_rows,
    check_row_caches,
    check_token_ids,
    checked_positions,
    first_position,
)
from kvref.latent import cache_latent_attention, latent_attention
from kvref.layer_caches import (
    reorder_every_layer,
    shift_every_layer,
    truncate_every_layer,
    widest_window_first,
)
from kvref.protocol import (
    KEYS_STORED,
    CacheFactory,
    CacheSpec,
    LayerCache,
    is_count,
    kept_rows,
    keys_stored,
)
from kvref.reprs import short_repr
from kvref.rope import apply_rope
from kvref.rows import RowBatch, row_positions, row_slots
from kvref.shared import SharedReader, SharedRows, caches_as_handed, is_cached
from kvref.tree import TreeBatch, tree_depths, tree_mask, tree_paths
from kvref.varlen import rotating_keys, varlen_attention


@short_repr
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


# The dtypes whose attention the reference computes in float64 (see ``attention``).
HALF_DTYPES = (torch.float16, torch.bfloat16)


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
            check_output(self, mixed, q.shape, q.dtype, "attend", "a tensor shaped like the query")
        elif (
            stored == "rotated"
            and sink_query is None
            and c.attention == "mla"
            and callable(getattr(cache, "attend_latent", None))
        ):
            mixed = cache_latent_attention(self, q, k, v, cache)
        else:
            # Rows, not positions: a cache's first position need not be 0 (section 8.3).
            before = 0 if cache is None else cache.length
            all_k, all_v = (k, v) if cache is None else cache.append(handed, v)
            if cache is not None:
                check_returned_rows(
                    self, all_k, all_v, batch, start=before, end=before + new_tokens
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
        return latent_attention(attention, self, path, q, keys, values, *args, **kwargs)

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
        held = check_returned_row_batch(self, all_k, all_v, valid, q.shape[0], rows)
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
        attended = attend(
            q,
            all_k,
            all_v,
            positions,
            key_positions,
            self.window,
            sink_end=sink_end,
            sink_query=sink_query,
        )
        # A pad slot's query may see no key (a row that brings no token and holds none):
        # nan, read by no one, but a half-precision matmul on the CPU (oneDNN's bfloat16
        # GEMM, measured) can carry a nan in one row of its input into other rows' outputs.
        return attended.masked_fill(~rows.real[:, None, :, None], 0)

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
        check_returned_rows(
            self,
            all_k,
            all_v,
            q.shape[0],
            start=tree.held,
            end=tree.held + nodes,
            call="append_tree",
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


ZERO_TOKEN = 0  # the token whose embedding is all zeros (``ReferenceTransformer``)


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
        # Token 0 embeds to zeros, as a padding token often does: its keys and values are
        # all-zero rows in the first layer (no projection has a bias), which a cache that
        # reads lengths or identity from its rows' contents mistakes for empty slots.
        self.embedding.weight[ZERO_TOKEN] = 0.0

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
        check_token_ids(token_ids, self.config.vocab_size)
        if positions is not None:
            if caches is not None or start_position:
                raise ValueError("positions is for uncached calls that set no start_position")
            at = checked_positions(positions, token_ids.shape[1], self.device)
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
            first = first_position(caches)
            offset = check_caches(self, caches, batch=token_ids.shape[0]) + first
            start_position = first
        logits, _ = self._run(token_ids, caches, offset, start_position)
        return logits

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
        check_token_ids(token_ids, self.config.vocab_size)
        batch, new_tokens = token_ids.shape
        lengths, firsts, padding = check_row_caches(self, caches, batch)
        counts = check_counts(counts, batch, new_tokens)
        real = torch.zeros(batch, new_tokens, dtype=torch.bool, device=self.device)
        for row, count in enumerate(counts):
            real[row, row_slots(padding, new_tokens, count)] = True
        starts = torch.tensor([f + n for f, n in zip(firsts, lengths, strict=True)])
        positions = row_positions(starts.to(self.device), real)
        rows = RowBatch(counts, real, lengths, firsts, pad)
        x = self.embedding(token_ids)
        for cache, block in zip(caches_as_handed(self.config, caches), self.blocks, strict=True):
            at = cache.row_positions(firsts, real) if isinstance(cache, SharedReader) else positions
            x, _, _ = block(x, at, cache, rows)
        logits = self.final_norm(x) @ self.embedding.weight.T
        return logits.masked_fill(~real[..., None], float("nan"))

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
        check_token_ids(token_ids, self.config.vocab_size)
        batch, nodes = token_ids.shape
        parents = check_tree(parents, nodes)
        held = check_caches(self, caches, batch=batch)
        check_offered(caches, "append_tree")
        first = first_position(caches)
        depths = torch.tensor(tree_depths(parents), device=self.device)
        tree = TreeBatch(parents, held, tree_mask(parents, self.device))
        x = self.embedding(token_ids)
        for cache, block in zip(caches_as_handed(self.config, caches), self.blocks, strict=True):
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
        check_token_ids(token_ids, self.config.vocab_size)
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
        """Forget every token at position >= ``length`` in every layer's cache, checked
        before any layer is touched (``kvref.layer_caches.truncate_every_layer``)."""
        truncate_every_layer(self, caches, length)

    def shift(self, caches: Sequence[LayerCache], start, count) -> None:
        """Discard the tokens of indices ``start`` to ``start + count - 1`` in every layer's
        cache, or per row with a tuple each, checked before any layer is touched (a context
        shift, contract section 8.4: ``kvref.layer_caches.shift_every_layer``)."""
        shift_every_layer(self, caches, start, count)

    def widest_window_first(self) -> list[int]:
        """The layers with a cache of their own, widest window first and global layers last
        (``kvref.layer_caches.widest_window_first``)."""
        return widest_window_first(self.config)

    def reorder(self, caches: Sequence[LayerCache], indices: Tensor) -> None:
        """Batch row b of every layer's cache becomes the old row ``indices[b]``, checked
        before any layer is touched (beam search: ``kvref.layer_caches.reorder_every_layer``)."""
        reorder_every_layer(self, caches, indices)

    @torch.no_grad()
    def forward_with_kv(
        self, token_ids: Tensor, *, start_position: int = 0, keys: str = "rotated"
    ) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        """The uncached pass: logits, and each layer's keys and its values, shaped (batch,
        kv_heads, T, head_dim), which is what a cache given ``token_ids`` must hold (from
        position ``start_position``): the keys rotated, or for a cache that keeps them
        ``keys`` "unrotated" (section 8.4), as they were before RoPE."""
        check_token_ids(token_ids, self.config.vocab_size)
        if not is_count(start_position):
            raise ValueError(f"start_position must be an int >= 0, got {start_position!r}")
        if keys not in KEYS_STORED:
            raise ValueError(f"keys must be one of {KEYS_STORED}, got {keys!r}")
        return self._run(token_ids, None, start_position, start_position, keys)

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
