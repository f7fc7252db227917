"""A preallocated cache whose ``attend`` is torch's ``scaled_dot_product_attention``.

The storage is ``PreallocatedCache``'s; ``attend`` writes the new rows, then runs one fused
attention over the rows its queries can see, masked by absolute position (``mask``: the causal
edge of a warm cache, and the window). Which kernel runs is pinned, never left to torch's
fallback, so that a run holds that kernel to the contract:

- on CUDA, the flash or the memory-efficient backend (``SDPBackend.FLASH_ATTENTION``,
  ``EFFICIENT_ATTENTION``): float16 and bfloat16 only, and head widths that are multiples of
  8 up to 256;
- elsewhere, the math backend: every floating dtype and head width. Half precision is
  upcast to float32 and rounded once at the end (the contract's accumulation rule).

The cache declares that domain (``kv_sizes``, a function of the kit's device), so that
``--kv-device cuda`` draws only what the fused kernels take and says what it left out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvimpl.preallocated import PreallocatedCache
from kvref.checks import check_attend

FUSED = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)
# Head widths the fused CUDA kernels take, of those the kit draws: multiples of 8 to 256.
FUSED_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 256)


def backends(device: torch.device) -> tuple[SDPBackend, ...]:
    return FUSED if device.type == "cuda" else (SDPBackend.MATH,)


def supported(device: torch.device) -> dict:
    """The domain of the backends this cache selects on ``device`` (``kv_sizes``)."""
    if device.type == "cuda":
        return {"supports": {"dtypes": ("float16", "bfloat16"), "head_dims": FUSED_HEAD_DIMS}}
    return {}  # the math backend: everything the kit draws


class SdpaCache(PreallocatedCache):
    kv_sizes = staticmethod(supported)

    def attend(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        start = self._length
        new = check_attend(self.spec, start, query, key, value, capacity=self.spec.max_length)
        keys, values = self.append(key, value)
        end = start + new
        window = self.spec.window
        first = 0 if window is None else max(0, start - window + 1)  # the oldest key seen
        keys, values = keys[:, :, first:], values[:, :, first:]
        group = query.shape[1] // keys.shape[1]
        if group > 1:  # one kv head per group of query heads, for every backend
            keys = keys.repeat_interleave(group, dim=1)
            values = values.repeat_interleave(group, dim=1)
        fused = query.device.type == "cuda"
        wide = query.dtype if fused else torch.promote_types(query.dtype, torch.float32)
        with sdpa_kernel(list(backends(query.device))):
            output = F.scaled_dot_product_attention(
                query.to(wide),
                keys.to(wide),
                values.to(wide),
                attn_mask=mask(start, end, first, window, query.device),
            )
        return output.to(query.dtype)


def mask(start: int, end: int, first: int, window: int | None, device: torch.device):
    """Which keys (positions ``first`` to ``end`` - 1) each query (``start`` to ``end`` - 1)
    sees: all of them for one query without a window (no mask: the flash kernel takes it);
    on CUDA without a window, the causal edge of a warm cache for a chunk
    (``causal_lower_right``, which flash takes too); else a boolean mask (the math backend
    takes any, the memory-efficient kernel takes it with a window)."""
    if window is None and end - start == 1:
        return None
    if window is None and device.type == "cuda":
        # Imported here, and on CUDA only: torch.nn.attention.bias imports torch._dynamo,
        # some 2 s that every process importing kvimpl, or building this cache on the CPU
        # (where the math backend takes the boolean mask below), would pay.
        from torch.nn.attention.bias import causal_lower_right

        return causal_lower_right(end - start, end - first)
    asking = torch.arange(start, end, device=device)[:, None]
    seen = torch.arange(first, end, device=device)[None, :]
    causal = seen <= asking
    return causal if window is None else causal & (seen > asking - window)
