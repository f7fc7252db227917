"""Hugging Face transformers' quantized per-layer caches, presented as caches of our protocol.

Tested with transformers 5.24.0, optimum-quanto 0.2.7 and hqq 0.2.8.post1 (torch 2.13.0, CPU).
Run the suite on them with, e.g., ``pytest -n 2 --pyargs kvcheck --kv-impl
kvimpl.hf_quantized:HFQuantoLayer`` (or ``HFQuantoLayer2Bit``, ``HFQuantoLayerBeams``,
``HFHQQLayer``).

Each adapter wraps one ``transformers.cache_utils.QuantoQuantizedLayer`` (what
``QuantizedCache(backend="quanto")`` builds per layer; ``HFHQQLayer``: ``HQQQuantizedLayer``)
and, as ``kvimpl/hf.py`` does, uses only its public API: ``update(key_states, value_states)``,
``get_seq_length()``, ``reset()``, its ``keys`` and ``values`` tensors (the full-precision
residual) and, for ``HFQuantoLayerBeams``, ``reorder_cache(beam_idx)``. No input is validated,
copied, cast or clamped here: whatever the layer accepts, stores, returns or raises is what the
suite sees, so every failure on these adapters is the layer's own behaviour. The CacheSpec is
not exposed as ``spec`` (as in ``kvimpl/hf.py``), so the layer itself meets every bad input.

One read goes past the public API, for ``nbytes`` only: the quantized states are held in
``_quantized_keys`` and ``_quantized_values`` (named so by ``BaseQuantizedLayer``'s docstring),
for quanto ``WeightQBitsTensor`` objects whose own ``nbytes`` is that of the full-precision
tensor they stand for. Their real storage (packed codes, scales, shifts) is read through torch's
tensor subclass protocol, ``__tensor_flatten__``, which names the inner tensors (for HQQ, the
codes and the scale and zero tensors of its ``(codes, meta)`` pair); nothing is written.

The settings (all of them the layer's own arguments; the layer is the judge of them):

- ``nbits`` 4 (HF's default), or 2 for ``HFQuantoLayer2Bit``; ``axis_key = axis_value = 0``
  (HF's defaults: quanto groups the flattened (H, T, D) numbers of one batch row in runs of
  ``q_group_size``; ``HFHQQLayer`` differs, see there);
- ``q_group_size``: HF's default 64 where it divides the spec's head_dim, otherwise the largest
  divisor of head_dim below 64 (head_dim 2 to 8: the whole head; 80: 40; 96: 48; 112: 56). Only a
  divisor keeps a group inside one token's head: with 64 on head_dim 96, quanto's runs of 64
  cross from one token into the next, a layout ``kvref.Quantized`` cannot state (and one that
  cannot quantize a single token of one head at all: docs, found in the wild);
- ``residual_length`` 8 instead of HF's 128, so that the kit's sessions (mostly tens of tokens)
  flush the residual into codes many times.

What the layer stores, and the declaration (``kv_storage``) that says it:

- quanto's ``MaxOptimizer`` + ``quantize_weight``: per group, ``scale = (max - min) / (2^nbits -
  1)`` and a float ``shift = -min``, both in the input dtype; ``code = round((x + shift) /
  scale)`` clamped to [0, 2^nbits - 1]; dequantized ``scale * code - shift``. Asymmetric, with a
  zero point: ``Quantized(nbits, group=q_group_size, symmetric=False)``.
- ``recent=0``: no row is guaranteed to stay as given. The first ``update`` quantizes its whole
  prompt at once (the lazy-initialisation branch), and an update that brings the residual to
  ``residual_length`` moves the residual and the new rows into codes and leaves the residual
  empty. The rows given to one call come back as given by that call, and may be in codes at the
  next.
- Not stated by the declaration, and so not allowed for: each flush dequantizes EVERY row and
  quantizes it again (``_quantize(keys_to_return)``), so an old row is re-coded once per flush.
  The kit holds each row to one quantization's bound against the row as given; a re-coding that
  drifts beyond it is reported, and is the layer's doing (quanto's stays within it; HQQ's drifts
  by a few roundings of bfloat16 per flush).

No move is offered (``export_rows``, ``import_rows``: contract, section 11.2), as in
``kvimpl/hf.py``: the layers have no such call, and their rows are codes (a move is lossy).
"""

from __future__ import annotations

try:
    import optimum.quanto  # noqa: F401  (QuantoQuantizedLayer imports it lazily; fail here)
    import transformers
    from transformers.cache_utils import HQQQuantizedLayer, QuantoQuantizedLayer
except ImportError as error:  # transformers and optimum-quanto are an optional extra
    raise ImportError(
        "kvimpl.hf_quantized adapts Hugging Face transformers' quantized cache layers, which need "
        "transformers and optimum-quanto: pip install 'kvcache-verify[hf-quantized]'"
    ) from error

from typing import ClassVar

from torch import Tensor

from kvref.protocol import CacheSpec
from kvref.quantized import Quantized

TESTED_WITH = {"transformers": "5.24.0", "optimum-quanto": "0.2.7", "hqq": "0.2.8.post1"}
TRANSFORMERS_VERSION = transformers.__version__

RESIDUAL_LENGTH = 8
HF_GROUP_SIZE = 64  # QuantizedLayer's default q_group_size


def group_size(head_dim: int) -> int:
    """HF's default q_group_size where it divides ``head_dim``, else the largest divisor of
    ``head_dim`` below it: a group never straddles two tokens."""
    return max(g for g in range(1, min(head_dim, HF_GROUP_SIZE) + 1) if head_dim % g == 0)


def _storage_bytes(held: object) -> int:
    """Bytes ``held`` really holds: a plain tensor's ``nbytes``; for a tensor subclass (quanto's
    quantized tensors, their packed codes), the sum over the inner tensors ``__tensor_flatten__``
    names; for HQQ's ``(codes, meta)`` pair, the tensors in it (the codes, scales and zeros)."""
    if isinstance(held, (tuple, list)):
        return sum(_storage_bytes(part) for part in held)
    if isinstance(held, dict):
        return sum(_storage_bytes(part) for part in held.values())
    if not isinstance(held, Tensor):
        return 0  # None (nothing held yet), or HQQ's metadata (its bits, group size, shape)
    if type(held) is Tensor or not hasattr(held, "__tensor_flatten__"):
        return held.nbytes
    names, _ = held.__tensor_flatten__()
    return sum(_storage_bytes(getattr(held, name)) for name in names)


class HFQuantoLayer:
    """``transformers.cache_utils.QuantoQuantizedLayer``: a full-precision residual of fewer
    than ``residual_length`` rows beside quanto's int codes of the rest."""

    build = QuantoQuantizedLayer  # a class attribute: called as the class, not bound

    nbits = 4
    axis = 0  # HF's default axis_key and axis_value; for quanto, runs of q_group_size numbers

    @staticmethod
    def group(head_dim: int) -> int:
        return group_size(head_dim)

    def __init__(self, spec: CacheSpec) -> None:
        group = self.group(spec.head_dim)
        self.layer = self.build(
            nbits=self.nbits,
            axis_key=self.axis,
            axis_value=self.axis,
            q_group_size=group,
            residual_length=RESIDUAL_LENGTH,
        )
        self.kv_storage = Quantized(self.nbits, group=group, symmetric=False, recent=0)

    @property
    def length(self) -> int:
        return self.layer.get_seq_length()

    @property
    def nbytes(self) -> int:
        layer = self.layer
        held = (layer._quantized_keys, layer._quantized_values, layer.keys, layer.values)
        return sum(_storage_bytes(tensor) for tensor in held)

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        return self.layer.update(key, value)

    def reset(self) -> None:
        self.layer.reset()


class HFQuantoLayer2Bit(HFQuantoLayer):
    """The same layer with ``nbits=2`` (KIVI's setting)."""

    nbits = 2


class HFQuantoLayerBeams(HFQuantoLayer):
    """The same layer, offering beam search's ``reorder`` through ``reorder_cache(beam_idx)``,
    which reorders the residual at once and defers the quantized states' reorder to the next
    ``update`` (transformers composes deferred reorders)."""

    def reorder(self, indices: Tensor) -> None:
        self.layer.reorder_cache(indices)


class HFHQQLayer(HFQuantoLayer):
    """``transformers.cache_utils.HQQQuantizedLayer`` (``QuantizedCache(backend="hqq")``), int4,
    with ``axis_key = axis_value = 1`` and ``q_group_size`` half of what quanto gets (half the
    head_dim up to 128, then 64): two groups or more per token, always an even number.

    - Axis 1, not HF's default 0: for HQQ, axis 1 groups runs of ``q_group_size`` numbers (one
      token's channels), as quanto's axis 0 does, while HQQ's axis 0 groups numbers
      ``numel / q_group_size`` apart, across tokens, heads and batch rows, which no per-token
      declaration can state (docs, found in the wild).
    - An even number of groups: along axis 1 HQQ's 4-bit packing (``pack_4bit_u8``) packs the
      first half of the rows of codes with the second, one row per group, and loses or
      mismatches a row when their number is odd, so that the next update crashes (found in the
      wild). With ``head_dim // 2``-wide groups every token brings an even number.
    - float64 is outside the declared domain: HQQ quantizes ``tensor.float()``, in float32
      whatever the dtype given, so a float64 row comes back with float32's roundings, which a
      bound stated in the storage dtype's roundings does not allow. That is HQQ's design.

    Needs ``hqq`` installed before transformers is imported (``cache_utils`` looks for it
    once); without it the layer's own constructor raises ImportError."""

    build = HQQQuantizedLayer
    axis = 1
    kv_sizes: ClassVar[dict] = {"supports": {"dtypes": ("float32", "bfloat16", "float16")}}

    @staticmethod
    def group(head_dim: int) -> int:
        return group_size(head_dim // 2) if head_dim > 1 else 1


__all__ = [
    "TESTED_WITH",
    "TRANSFORMERS_VERSION",
    "HFHQQLayer",
    "HFQuantoLayer",
    "HFQuantoLayer2Bit",
    "HFQuantoLayerBeams",
    "group_size",
]
