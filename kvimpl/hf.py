"""Hugging Face transformers' per-layer caches, presented as caches of our protocol.

Tested with transformers 5.24.0 (torch 2.13.0, CPU). Run the suite on them with, e.g.,
``pytest -n 2 --kv-impl kvimpl.hf:HFDynamicLayer`` (or ``HFStaticLayer``, ``HFStaticLayerEarly``).

Each adapter wraps one ``transformers.cache_utils`` layer object and uses only its public API:
``update(key_states, value_states)``, ``get_seq_length()``, ``reset()``, its ``keys`` and
``values`` tensors, and (for ``HFStaticLayerEarly``) ``lazy_initialization``. No input is
validated, copied, cast or clamped here: whatever the layer accepts, stores, returns or raises
is what the suite sees, so every failure on these adapters is the layer's own behaviour.

- ``HFDynamicLayer`` -> ``DynamicLayer()`` (what ``DynamicCache`` builds per layer, the default
  cache of ``generate``). ``append`` is ``update`` and returns what it returns (the whole
  ``torch.cat``-grown tensors); ``length`` is ``get_seq_length()``; ``reset`` is ``reset()``;
  ``nbytes`` is ``keys.nbytes + values.nbytes`` (0 while the layer holds no tensors).
- ``HFStaticLayer`` -> ``StaticLayer(max_cache_len=spec.max_length)`` (what ``StaticCache``
  builds per layer), lazily initialised by its first ``update`` as ``StaticCache`` does by
  default. ``length`` is ``int(get_seq_length())``; ``nbytes`` is its preallocated buffers.
  ``append`` returns the first ``length`` rows of the buffers ``update`` returns (see below).
- ``HFStaticLayerEarly`` -> the same ``StaticLayer``, initialised ahead of time from the spec's
  batch, kv_heads, head_dim, dtype and device through ``lazy_initialization`` with a zero-row
  tensor, exactly as ``Cache.early_initialization`` does (the ``torch.export`` path). The
  layer then knows the shapes it holds before the first append, as a spec-built cache does.

Two translations, both forced by the protocol and both unable to hide a defect:
- ``StaticLayer.update`` returns its whole ``max_cache_len`` buffer by design: transformers
  masks the rows past the sequence with the causal mask (``get_mask_sizes`` gives
  ``max_cache_len`` keys, the query positions decide which are seen). The protocol wants only
  the rows held, so the adapter slices the buffer to the layer's OWN ``get_seq_length()``,
  which is exactly what that mask lets attention see. A length that lies then shows as the
  wrong number of rows or as wrong (zero) rows, never as a correct answer.
- ``StaticLayer.get_seq_length()`` returns the layer's live ``cumulative_length`` tensor (a
  python 0 before initialisation); the protocol and our model need a plain int, so ``length``
  converts it with ``int()`` at each read. The value is the layer's own, unchanged.

No adapter keeps state of its own besides the wrapped layer (and ``max_length`` for the static
buffer size): the layer tracks its length itself (``StaticLayer`` no longer takes a
``cache_position`` in 5.x; it counts with ``cumulative_length``), so the adapter tracks none.
The CacheSpec is deliberately NOT exposed as a ``spec`` attribute: the reference model would
then refuse a batch/heads/dtype mismatch before any layer sees it, hiding how the layers
themselves handle it. For the same reason the adapters offer no move (``export_rows``,
``import_rows``: contract, section 11.2): transformers' layers have no such call, and one
written here would be this adapter's code, not the layer's.
"""

from __future__ import annotations

try:
    import transformers
    from transformers.cache_utils import DynamicLayer, StaticLayer
except ImportError as error:  # transformers is an optional extra of this project
    raise ImportError(
        "kvimpl.hf adapts Hugging Face transformers' cache layers, which is not installed: "
        "pip install 'kvcache-verify[hf]'"
    ) from error

import torch
from torch import Tensor

from kvref.protocol import CacheSpec

TESTED_WITH = "5.24.0"
TRANSFORMERS_VERSION = transformers.__version__


def _reserved(layer) -> int:
    """Bytes of the layer's key and value tensors; 0 while it holds none (before its first
    update, and after DynamicLayer.reset, which drops them)."""
    if layer.keys is None or layer.values is None:
        return 0
    return layer.keys.nbytes + layer.values.nbytes


class HFDynamicLayer:
    """``transformers.cache_utils.DynamicLayer``: grows by ``torch.cat`` on each update."""

    def __init__(self, spec: CacheSpec) -> None:
        # The layer takes no arguments: it learns dtype, device and shapes from its first update.
        self.layer = DynamicLayer()

    @property
    def length(self) -> int:
        return self.layer.get_seq_length()

    @property
    def nbytes(self) -> int:
        return _reserved(self.layer)

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        return self.layer.update(key, value)

    def reset(self) -> None:
        self.layer.reset()


class HFStaticLayer:
    """``transformers.cache_utils.StaticLayer``: one ``max_cache_len`` buffer per K and V."""

    def __init__(self, spec: CacheSpec) -> None:
        # max_cache_len is the one thing StaticLayer must be told; the spec's max_length is
        # "the most tokens this cache will be asked to hold", which is what it means.
        self.layer = StaticLayer(max_cache_len=spec.max_length)

    @property
    def length(self) -> int:
        # get_seq_length() hands out the live counter tensor (it changes under a caller who
        # kept it); int() reads its value now. Nothing else is done to it.
        return int(self.layer.get_seq_length())

    @property
    def nbytes(self) -> int:
        return _reserved(self.layer)

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        keys, values = self.layer.update(key, value)
        # update returns the whole buffer; transformers' causal mask shows attention only the
        # rows before the layer's own length, and so does this slice (module docstring).
        held = self.length
        return keys[:, :, :held], values[:, :, :held]

    def reset(self) -> None:
        self.layer.reset()


class HFStaticLayerEarly(HFStaticLayer):
    """``StaticLayer`` initialised ahead of time from the spec, as ``Cache.early_initialization``
    does: the buffers exist, with the spec's shapes, dtype and device, before the first append."""

    def __init__(self, spec: CacheSpec) -> None:
        super().__init__(spec)
        # The zero-row tensor Cache.early_initialization builds: it carries every dimension
        # but the length, and the dtype and device, and allocates nothing itself.
        shape = (spec.batch, spec.kv_heads, 0, spec.head_dim)
        fake = torch.zeros(shape, dtype=spec.dtype, device=spec.device)
        self.layer.lazy_initialization(fake, fake)


__all__ = [
    "TESTED_WITH",
    "TRANSFORMERS_VERSION",
    "HFDynamicLayer",
    "HFStaticLayer",
    "HFStaticLayerEarly",
]
