"""mlx-lm's per-layer KV caches (``mlx_lm.models.cache``), presented as caches of our protocol.

Tested with mlx-lm 0.32.2 on mlx 0.32.4 (``mlx[cpu]``, Linux CPU; torch 2.13.0). Run the kit on
them with, e.g., ``pytest --pyargs kvcheck --kv-impl kvimpl.mlx:MLXKVCache`` (or
``MLXRotatingKVCache``, ``MLXQuantizedKVCache``, ``MLXQuantizedKVCache4Bit``,
``MLXBatchKVCache``).

Each adapter wraps one mlx-lm cache object and uses only what mlx-lm's models and generation
loop use: ``update_and_fetch(keys, values)``, ``offset``, ``nbytes``, ``is_trimmable()``, the
public ``trim_prompt_cache([cache], n)`` (``trim(n)`` behind the ``is_trimmable()`` gate), and
for the batch cache ``prepare(lengths=..., right_padding=...)`` / ``finalize()`` (exactly as
``BatchGenerator`` feeds a ragged chunk to warm caches), ``left_padding``,
``keys_and_values()``, ``filter(indices)`` and ``extend(other)``. Nothing is validated, clamped
or cast here: whatever the cache accepts, stores, returns or raises is what the kit sees.

The only work done here is the boundary conversion torch <-> mlx, through numpy, dtype for
dtype (float64, float32, float16, and bfloat16 by a bit-exact int16 view, since numpy has no
bfloat16; ``mx.array`` would turn a float64 array into float32 unless told the dtype, so it is
told). An argument that is not a torch tensor is passed to mlx-lm unconverted, as a caller's
list would be. A tensor the conversion cannot hand over (a ``meta`` tensor: mlx has no such
device, and numpy cannot read it) raises torch's own ``TypeError`` from the conversion; that
is a limit of this adapter (mlx arrays carry no device), not a defect of mlx-lm. Returned
arrays are copied out to torch tensors (``np.array``), which the protocol allows.

- ``MLXKVCache`` -> ``KVCache()``, the default cache of every mlx-lm model: a buffer grown in
  steps of 256. ``length`` is ``offset``; ``truncate(L)`` is ``trim_prompt_cache([c],
  length - L)``.
- ``MLXRotatingKVCache`` -> ``RotatingKVCache(max_size, keep)``, the sliding-window layer
  (Gemma, Mistral; and every layer under ``make_prompt_cache(model, max_kv_size=N)``, which
  builds ``RotatingKVCache(max_size=N, keep=4)``). In the single-token path a query attends
  to every row held (``make_mask`` returns no mask), which are the ``keep`` first tokens and
  the ``max_size - keep`` most recent ones including itself: the contract's window W with S
  sinks (section 8.5) is therefore ``max_size = W + S``, ``keep = S``. Without a window the
  spec keeps every row, which a rotating cache cannot promise; the adapter then builds
  ``max_size = spec.max_length`` (what ``max_kv_size`` means), so it holds every row the spec
  asks for and rotates past it. Its returned rows are put into temporal order by the cache's
  own ``_temporal_order`` (the rolled mask ``make_mask`` builds is the same order, applied to
  the scores instead): the protocol asks for rows oldest first.
- ``MLXQuantizedKVCache`` -> ``QuantizedKVCache(group_size=64, bits=8)`` (mlx-lm's defaults;
  ``MLXQuantizedKVCache4Bit``: bits=4, as ``--kv-bits 4``). It returns ``mx.quantize``'s
  (codes, scales, biases) triples, which the adapter dequantizes with mlx's own
  ``mx.dequantize`` (what ``quantized_scaled_dot_product_attention`` computes with). It
  declares its storage (contract 10.1) as ``Quantized(bits, group=64, symmetric=False,
  recent=0)``: affine codes with a scale and a bias per 64 channels of one token's head,
  every row coded at once; ``mx.quantize`` takes head widths that are multiples of the group
  only, which the adapter declares as its domain (``kv_sizes["supports"]``), and float32,
  float16 and bfloat16 only: on the CPU ``mx.quantize`` of a float64 array fails when it is
  evaluated (``[fast::Quantize::eval_cpu] Only supports floating point inputs``). The other
  caches run in float64 too (mlx computes float64 on the CPU, not on the GPU).
- ``MLXBatchKVCache`` -> ``BatchKVCache(left_padding=[0] * B)``, the cache of batched
  generation: rows of their own (contract 8.1) in one left-padded buffer. ``append_rows``
  takes right-padded chunks (``padding = "right"``) and feeds them as ``BatchGenerator``
  does: ``prepare(lengths=counts, right_padding=T - counts)`` when some row brings fewer than
  T, ``update_and_fetch``, then ``finalize()``, which rolls each row's pads to its left. It
  returns the rows held after ``finalize()`` (``keys_and_values()``), and ``valid`` is the
  slot index >= that row's ``left_padding``, the rule of the cache's own ``make_mask``.
  ``row_lengths`` is the cache's per-row ``offset``; ``select_rows`` is ``filter``;
  ``join`` is ``extend``; ``truncate`` trims every row alike (``trim`` has one count).

No adapter keeps state of its own besides the wrapped cache (and the spec, to build a new one):
``reset()`` builds a new cache object, since mlx-lm's caches have no reset (a new prompt gets
``make_prompt_cache`` anew). The CacheSpec is not exposed as ``spec``, so that the reference
model never refuses a call on a cache's behalf, and no move (``export_rows``) is offered.
"""

from __future__ import annotations

from typing import ClassVar

try:
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.models.cache import (
        BatchKVCache,
        KVCache,
        QuantizedKVCache,
        RotatingKVCache,
        trim_prompt_cache,
    )
except ImportError as error:  # mlx-lm is an optional extra of this project
    raise ImportError(
        "kvimpl.mlx adapts mlx-lm's KV caches, which is not installed: "
        "pip install 'kvcache-verify[mlx]'"
    ) from error

import numpy as np
import torch
from torch import Tensor

from kvref import Quantized
from kvref.protocol import CacheSpec

TESTED_WITH = "0.32.2"
MLX_LM_VERSION = mlx_lm.__version__
MLX_VERSION = mx.__version__

_MX_DTYPES = {
    torch.float64: mx.float64,
    torch.float32: mx.float32,
    torch.float16: mx.float16,
    torch.int64: mx.int64,
    torch.int32: mx.int32,
    torch.bool: mx.bool_,
}


def to_mx(x):
    """A torch tensor as an mlx array of the same dtype and bits; anything else as given."""
    if not isinstance(x, Tensor):
        return x
    x = x.detach()
    if x.dtype == torch.bfloat16:
        return mx.array(x.view(torch.int16).numpy()).view(mx.bfloat16)
    return mx.array(x.numpy(), dtype=_MX_DTYPES.get(x.dtype))


def to_torch(a) -> Tensor:
    """An mlx array as a torch tensor of the same dtype and bits (a copy)."""
    if a.dtype == mx.bfloat16:
        return torch.from_numpy(np.array(a.view(mx.int16))).view(torch.bfloat16)
    return torch.from_numpy(np.array(a))


def _pair(keys, values) -> tuple[Tensor, Tensor]:
    return to_torch(keys), to_torch(values)


class _Trimmable:
    """``truncate`` through mlx-lm's public ``trim_prompt_cache``: it trims only where
    ``is_trimmable()`` says so and returns how many tokens it trimmed. A count other than the
    one asked for is mlx-lm's own refusal (0 from a cache that cannot trim, or ``trim``'s clamp
    at ``offset``), reported as the ``ValueError`` the protocol wants; nothing else is checked."""

    cache: object

    def truncate(self, length: int) -> None:
        asked = self.length - length
        trimmed = trim_prompt_cache([self.cache], asked)
        if trimmed != asked:
            raise ValueError(
                f"mlx-lm trimmed {trimmed} of the {asked} tokens asked to truncate a cache of "
                f"length {self.length + trimmed} to {length} "
                f"(is_trimmable() is {self.cache.is_trimmable()})"
            )


class MLXKVCache(_Trimmable):
    """``mlx_lm.models.cache.KVCache``: one buffer per K and V, grown 256 rows at a time."""

    def __init__(self, spec: CacheSpec) -> None:
        self._spec = spec
        self.cache = self._build()

    def _build(self):
        return KVCache()

    @property
    def length(self) -> int:
        return self.cache.offset

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        return _pair(*self.cache.update_and_fetch(to_mx(key), to_mx(value)))

    def reset(self) -> None:
        self.cache = self._build()


class MLXRotatingKVCache(MLXKVCache):
    """``mlx_lm.models.cache.RotatingKVCache(max_size=W + S, keep=S)`` for a window W with S
    sinks; ``max_size = spec.max_length`` without a window (module docstring)."""

    kv_sizes: ClassVar[dict] = {"supports": {"sinks": (0, 1, 2, 4)}}

    def _build(self):
        spec = self._spec
        if spec.window is None:
            return RotatingKVCache(max_size=spec.max_length)
        return RotatingKVCache(max_size=spec.window + spec.sinks, keep=spec.sinks)

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        keys, values = self.cache.update_and_fetch(to_mx(key), to_mx(value))
        # Rows oldest first, by the cache's own reordering (module docstring).
        return _pair(self.cache._temporal_order(keys), self.cache._temporal_order(values))


class MLXQuantizedKVCache(MLXKVCache):
    """``mlx_lm.models.cache.QuantizedKVCache(group_size=64, bits=8)``, its codes dequantized
    by ``mx.dequantize`` at the boundary."""

    bits = 8
    group_size = 64
    kv_sizes: ClassVar[dict] = {
        "supports": {
            "dtypes": ("float32", "float16", "bfloat16"),
            "head_dims": (64, 128, 192, 256),
        }
    }

    def __init__(self, spec: CacheSpec) -> None:
        super().__init__(spec)
        self.kv_storage = Quantized(self.bits, group=self.group_size, symmetric=False, recent=0)

    def _build(self):
        return QuantizedKVCache(group_size=self.group_size, bits=self.bits)

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        keys, values = self.cache.update_and_fetch(to_mx(key), to_mx(value))
        c = self.cache
        return _pair(
            mx.dequantize(*keys, group_size=c.group_size, bits=c.bits),
            mx.dequantize(*values, group_size=c.group_size, bits=c.bits),
        )


class MLXQuantizedKVCache4Bit(MLXQuantizedKVCache):
    """``QuantizedKVCache(group_size=64, bits=4)``: mlx-lm's ``--kv-bits 4``."""

    bits = 4


class MLXBatchKVCache(_Trimmable):
    """``mlx_lm.models.cache.BatchKVCache``: a batch whose rows have lengths of their own, in
    one left-padded buffer (module docstring)."""

    padding = "right"

    def __init__(self, spec: CacheSpec) -> None:
        self._spec = spec
        self.cache = BatchKVCache(left_padding=[0] * spec.batch)

    @property
    def row_lengths(self) -> tuple[int, ...]:
        return tuple(self.cache.offset.tolist())

    @property
    def length(self) -> int:
        return max(self.row_lengths)

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        return _pair(*self.cache.update_and_fetch(to_mx(key), to_mx(value)))

    def append_rows(self, key: Tensor, value: Tensor, counts) -> tuple[Tensor, Tensor, Tensor]:
        t = key.shape[2]
        pads = [t - c for c in counts]
        ragged = max(pads) > 0
        if ragged:
            self.cache.prepare(lengths=list(counts), right_padding=pads)
        self.cache.update_and_fetch(to_mx(key), to_mx(value))
        if ragged:
            self.cache.finalize()
        keys, values = self.cache.keys_and_values()
        slots = mx.arange(keys.shape[2])[None, :]
        valid = slots >= self.cache.left_padding[:, None]
        return to_torch(keys), to_torch(values), to_torch(valid)

    def select_rows(self, indices: Tensor) -> None:
        self.cache.filter(to_mx(indices))

    def join(self, other: MLXBatchKVCache) -> None:
        self.cache.extend(other.cache)

    def reset(self) -> None:
        self.cache = BatchKVCache(left_padding=[0] * self._spec.batch)


__all__ = [
    "MLX_LM_VERSION",
    "MLX_VERSION",
    "TESTED_WITH",
    "MLXBatchKVCache",
    "MLXKVCache",
    "MLXQuantizedKVCache",
    "MLXQuantizedKVCache4Bit",
    "MLXRotatingKVCache",
    "to_mx",
    "to_torch",
]
