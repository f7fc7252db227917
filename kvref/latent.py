"""Multi-head latent attention (MLA, DeepSeek-V2/V3; contract, section 10.2): attention over
the rows an MLA layer caches, one compressed latent and one small rope key per token shared
by every head, on either of its two paths: the "naive" one up-projects the latents into
each head's keys and values, the "absorbed" one folds the up-projections into the query and
the output and attends over the latents themselves. Both take the reference's softmax
attention as ``attend``, so that they compute what it computes.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from kvref.guards import check_output


def latent_attention(
    attend,
    layer: nn.Module,
    path: str,
    q: Tensor,
    rope_keys: Tensor,
    latents: Tensor,
    *args,
    sink_query: Tensor | None = None,
    **kwargs,
) -> Tensor:
    """MLA (contract, section 10.2): ``q`` (B, H, T, nope + rope, its rope channels rotated)
    over the rows an MLA ``layer`` caches, ``rope_keys`` (B, 1, rows, rope) and ``latents``
    (B, 1, rows, latent), on ``path``, through ``attend`` (the reference's ``attention``); the
    rest as ``attention`` takes it. Computed in float64 (MPS: float32), so that the two paths,
    which sum in other orders, round to one result in the model's dtype (they agree to some
    1e-15 before that)."""
    wide = torch.float32 if q.device.type == "mps" else torch.float64
    up_key, up_value = up_projections(layer, wide)
    query, rope_keys, latents = q.to(wide), rope_keys.to(wide), latents.to(wide)
    sink_query = None if sink_query is None else sink_query.to(wide)
    on_path = naive_attention if path == "naive" else absorbed_attention
    mixed = on_path(
        attend, query, rope_keys, latents, up_key, up_value, *args, sink_query=sink_query, **kwargs
    )
    return mixed.to(q.dtype)


def up_projections(layer: nn.Module, wide: torch.dtype) -> tuple[Tensor, Tensor]:
    """An MLA layer's up-projections in ``wide``, per head: (H, nope, latent) for the keys'
    no-rope channels and (H, head_dim, latent) for the values."""
    c = layer.config
    up_key = layer.up_key.weight.to(wide).view(c.num_heads, c.nope_dim, c.latent_dim)
    up_value = layer.up_value.weight.to(wide).view(c.num_heads, c.head_dim, c.latent_dim)
    return up_key, up_value


def naive_attention(attend, query, rope_keys, latents, up_key, up_value, *args, **kwargs) -> Tensor:
    """MLA's naive path: each head's keys, its up-projected latent channels beside the rope
    key, and its values up-projected from the latents, then ``attend`` per head."""
    heads = up_key.shape[0]
    keys = torch.einsum("bxrc,hnc->bhrn", latents, up_key)  # x: the one cached "head"
    keys = torch.cat((keys, rope_keys.expand(-1, heads, -1, -1)), dim=-1)
    values = torch.einsum("bxrc,hdc->bhrd", latents, up_value)
    return attend(query, keys, values, *args, **kwargs)


def absorbed_attention(
    attend, query, rope_keys, latents, up_key, up_value, *args, **kwargs
) -> Tensor:
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
    mixed = attend(absorbed(query), keys, latents, *args, scale=scale, **kwargs)
    return torch.einsum("bhtc,hdc->bhtd", mixed, up_value)


def cache_latent_attention(layer: nn.Module, q: Tensor, k: Tensor, v: Tensor, cache) -> Tensor:
    """MLA's absorbed path computed by the cache (section 10.2, ``attend_latent``): the
    no-rope query folded into the latent space beside the rope channels, in the model's
    dtype; the weighted latents the cache returns, checked, then up-projected per head in
    float64."""
    c = layer.config
    wide = torch.float32 if q.device.type == "mps" else torch.float64
    up_key, up_value = up_projections(layer, wide)
    nope, rope = q.split((c.nope_dim, c.rope_dim), dim=-1)
    folded = torch.einsum("bhtn,hnc->bhtc", nope.to(wide), up_key).to(q.dtype)
    query = torch.cat((folded, rope), dim=-1)
    latents = cache.attend_latent(query, k, v, 1 / math.sqrt(c.query_width))
    check_output(
        layer,
        latents,
        (*q.shape[:3], c.latent_dim),
        q.dtype,
        "attend_latent",
        "the weighted latents",
    )
    return torch.einsum("bhtc,hdc->bhtd", latents.to(wide), up_value).to(q.dtype)
