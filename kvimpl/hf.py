"""Hugging Face transformers' per-layer caches, presented as caches of our protocol.

Tested with transformers 5.24.0 (torch 2.13.0, CPU). Run the suite on them with, e.g.,
``pytest -n 2 --kv-impl kvimpl.hf:HFDynamicLayer`` (or any class in ``__all__`` below).

Each adapter wraps one ``transformers.cache_utils`` layer object and uses only its public API:
``update(key_states, value_states)``, ``get_seq_length()``, ``reset()``,
``crop(tokens_to_remove)``, ``reorder_cache(beam_idx)``, ``batch_repeat_interleave(repeats)``,
``batch_select_indices(indices)``, ``activate_past_recording()``, ``offload()``, ``prefetch()``,
its ``keys`` and ``values`` tensors, and (for ``HFStaticLayerEarly``) ``lazy_initialization``.
No input is validated, copied, cast or clamped here: whatever the layer accepts, stores,
returns or raises is what the suite sees, so every failure on these adapters is the layer's own
behaviour.

Full-attention layers:

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

All three offer the kit's two edits (contract, section 4), each one call of the layer:

- ``truncate(length)`` is ``crop(length - self.length)``. Since transformers 5.x (PR #47720)
  ``crop`` takes the number of tokens to REMOVE as a negative int (a positive one is refused);
  this is the count assisted decoding passes (``candidate_generator.py``: ``crop(-(current -
  target))``). The subtraction uses the layer's own length, so a length that lies shows.
- ``reorder(indices)`` is ``reorder_cache(indices)``, what beam search calls.

Two variants reach DynamicLayer's other batch calls, each as a ``reorder``:

- ``HFDynamicLayerSelect``: ``reorder(indices)`` is ``batch_select_indices(indices)``, which
  keeps batch row ``indices[b]`` as row b (repeats allowed), exactly the kit's reorder.
- ``HFDynamicLayerExpand``: ``reorder(indices)`` is ``batch_repeat_interleave(B)`` followed by
  ``batch_select_indices(indices * B)``: the expansion (row r becomes rows r*B .. r*B+B-1) and
  then one copy of each wanted row. transformers' model tests drive the pair the same way
  (DeepSeek-V4.1's ``test_padded_chunked_decode_and_beam_state``: ``batch_repeat_interleave(2)``
  then ``batch_select_indices``). Nothing here can hide a fault of either call: an expansion that
  repeats instead of interleaving, or a selection that picks the wrong rows, gives wrong rows.
  The arithmetic is the adapter's, though, so its verdicts on bad indices (``indices.shape``
  of a list, ``indices * B`` of another dtype) are partly its own: judge bad reorders on the
  other adapters.

Sliding-window layers, as window caches (``CacheSpec.window``, contract rule 7). transformers'
window counts as the kit's: its mask keeps key ``kv_idx`` for query ``q_idx`` when ``kv_idx >
q_idx - sliding_window`` (``masking_utils.sliding_window_overlay``), i.e. keys p - W + 1 .. p,
so ``sliding_window = spec.window`` exactly, with nothing added or taken.

- ``HFDynamicSlidingWindowLayer`` -> ``DynamicSlidingWindowLayer(sliding_window=W)`` (what
  ``DynamicCache(config=...)`` builds for a sliding layer: Mistral, Gemma 2/3, gpt-oss). It
  keeps the last W - 1 rows and ``update`` returns them with the new ones (W - 1 + T, or all
  while fewer), the least rule 7 allows. ``length`` is ``get_seq_length()`` (its
  ``cumulative_length``). ``reorder`` is ``reorder_cache``. No ``truncate``: without past
  recording transformers refuses every ``crop`` once the window is reached (by design, with a
  RuntimeError telling the caller to call ``activate_past_recording`` first), and ``generate``
  crops a sliding cache only after that call; the next class is that path.
- ``HFDynamicSlidingWindowLayerRecording``: the same layer after ``activate_past_recording()``,
  as ``generate`` sets it for assisted decoding and its deferred stop check. It then keeps every
  row until a ``crop`` trims it back to the window, and ``update`` returns the last W - 1 + T
  rows. Offers ``truncate`` (``crop``, as above) and ``reorder``. Its rollbacks fail the kit:
  a second crop with no update between keeps one row too few (docs/found-in-the-wild.md).
- ``HFStaticSlidingWindowLayer`` -> ``StaticSlidingWindowLayer(max_cache_len=spec.max_length,
  sliding_window=W)`` (what ``StaticCache`` builds for a sliding layer): a buffer of
  min(W, max_length) rows, rolled once full. Its ``update`` returns the whole buffer while not
  full (transformers masks the rows past the sequence, as for ``StaticLayer``), and once full
  the W rows it holds (one new token) or the W - 1 + T rows the new queries see; ``append``
  returns the first ``length`` rows of that, as ``HFStaticLayer`` does (a no-op once full,
  where fewer rows come back than the length). ``reorder`` is ``reorder_cache``. No
  ``truncate``: the layer's ``is_croppable`` is False whenever the window is shorter than the
  cache (its ``crop`` cannot bring rolled-out rows back, as its docstring says, and
  ``generate`` refuses to assist-decode with such a cache).
- ``HFStaticSlidingWindowLayerCroppable``: the same layer with its window at least the
  cache's length, as ``StaticCache`` builds it for a sliding layer of a model whose window is
  longer than the generation (Gemma 3's 1024 with ``max_cache_len`` 512): never rolled, so
  ``is_croppable`` is True and assisted decoding crops it. ``truncate`` is ``crop``. It takes
  specs without a window only (``supports: windows False``), which it maps as below.

A window layer has no "no window". For a spec without one (``window=None``: every query sees,
and the cache holds, every row) the sliding adapters take ``sliding_window = spec.max_length +
1``: a window layer keeps the last W - 1 rows between calls, so this is the least window that
keeps all ``max_length`` rows the spec may hold (with ``max_length`` it would keep one fewer,
which the kit's ``nbytes`` rule reports). Past ``max_length`` they are window layers and drop
the oldest rows, which rule 4 forbids a cache without a window; the kit's overflow check (one
append past ``max_length``) still gets every row back from that append, so no check shows it.
A limit of this mapping, not a defect.

Offloading: ``HFDynamicLayerOffloaded`` is ``DynamicLayer`` driven as ``Cache.update`` drives
a layer with ``offloading=True``: ``prefetch()`` before ``update`` (in ``Cache`` the previous
layer's call does it), ``offload()`` after. Without a GPU both move nothing (the layer's device
is the CPU), so on a CPU-only machine it checks only that the calls keep the rows;
``DynamicCache(offloading=True)`` itself needs CUDA streams (docs/found-in-the-wild.md, G2).

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

from typing import ClassVar

try:
    import transformers
    from transformers.cache_utils import (
        DynamicLayer,
        DynamicSlidingWindowLayer,
        StaticLayer,
        StaticSlidingWindowLayer,
    )
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


def _window(spec: CacheSpec) -> int:
    """The ``sliding_window`` of a sliding layer for ``spec``: the spec's window, which counts
    as transformers' does; without one, the least window that keeps all ``max_length`` rows
    (the layer keeps W - 1 between calls)."""
    return spec.max_length + 1 if spec.window is None else spec.window


class _Crop:
    """``truncate`` as the layer's ``crop``, which takes the count to remove, negated."""

    def truncate(self, length: int) -> None:
        self.layer.crop(length - self.length)


class _ReorderCache:
    """``reorder`` as the layer's ``reorder_cache`` (beam search)."""

    def reorder(self, indices: Tensor) -> None:
        self.layer.reorder_cache(indices)


class _GrowingLayer:
    """A dynamic layer's ``length``, ``nbytes``, ``append`` and ``reset``: each one call of
    the layer, ``append`` returning what ``update`` returns (the rows the queries see)."""

    layer: DynamicLayer

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


class HFDynamicLayer(_Crop, _ReorderCache, _GrowingLayer):
    """``transformers.cache_utils.DynamicLayer``: grows by ``torch.cat`` on each update."""

    def __init__(self, spec: CacheSpec) -> None:
        # The layer takes no arguments: it learns dtype, device and shapes from its first update.
        self.layer = DynamicLayer()


class HFDynamicLayerSelect(HFDynamicLayer):
    """``DynamicLayer`` whose ``reorder`` is ``batch_select_indices``."""

    def reorder(self, indices: Tensor) -> None:
        self.layer.batch_select_indices(indices)


class HFDynamicLayerExpand(HFDynamicLayer):
    """``DynamicLayer`` whose ``reorder`` is ``batch_repeat_interleave(B)`` then
    ``batch_select_indices(indices * B)`` (module docstring)."""

    def reorder(self, indices: Tensor) -> None:
        repeats = indices.shape[0]
        self.layer.batch_repeat_interleave(repeats)
        self.layer.batch_select_indices(indices * repeats)


class HFDynamicLayerOffloaded(HFDynamicLayer):
    """``DynamicLayer`` with ``prefetch()`` before and ``offload()`` after each update, as
    ``Cache.update`` does with ``offloading=True`` (module docstring)."""

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        self.layer.prefetch()
        keys, values = self.layer.update(key, value)
        self.layer.offload()
        return keys, values


class _StaticBuffer:
    """A static layer's ``length``, ``nbytes``, ``append`` and ``reset``: the buffer ``update``
    returns, sliced to the layer's own length (module docstring)."""

    layer: StaticLayer

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


class HFStaticLayer(_Crop, _ReorderCache, _StaticBuffer):
    """``transformers.cache_utils.StaticLayer``: one ``max_cache_len`` buffer per K and V."""

    def __init__(self, spec: CacheSpec) -> None:
        # max_cache_len is the one thing StaticLayer must be told; the spec's max_length is
        # "the most tokens this cache will be asked to hold", which is what it means.
        self.layer = StaticLayer(max_cache_len=spec.max_length)


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


class HFDynamicSlidingWindowLayer(_ReorderCache, _GrowingLayer):
    """``transformers.cache_utils.DynamicSlidingWindowLayer``: the last W - 1 rows, grown by
    ``torch.cat`` and trimmed at each update (module docstring)."""

    def __init__(self, spec: CacheSpec) -> None:
        self.layer = DynamicSlidingWindowLayer(sliding_window=_window(spec))


class HFDynamicSlidingWindowLayerRecording(_Crop, HFDynamicSlidingWindowLayer):
    """``DynamicSlidingWindowLayer`` after ``activate_past_recording()``, as ``generate`` sets
    it before it may roll back: ``truncate`` is ``crop``."""

    def __init__(self, spec: CacheSpec) -> None:
        super().__init__(spec)
        self.layer.activate_past_recording()


class HFStaticSlidingWindowLayer(_ReorderCache, _StaticBuffer):
    """``transformers.cache_utils.StaticSlidingWindowLayer``: a buffer of min(W, max_length)
    rows, rolled once full (module docstring). No ``truncate``."""

    def __init__(self, spec: CacheSpec) -> None:
        self.layer = StaticSlidingWindowLayer(
            max_cache_len=spec.max_length, sliding_window=_window(spec)
        )


class HFStaticSlidingWindowLayerCroppable(_Crop, HFStaticSlidingWindowLayer):
    """``StaticSlidingWindowLayer`` whose window is at least the cache's length, the one
    ``crop`` can undo (``is_croppable``): ``truncate`` is ``crop``. Built for specs without a
    window only (module docstring)."""

    # A spec's window would make the layer uncroppable: the kit draws none for it.
    kv_sizes: ClassVar[dict] = {"supports": {"windows": False}}


__all__ = [
    "TESTED_WITH",
    "TRANSFORMERS_VERSION",
    "HFDynamicLayer",
    "HFDynamicLayerExpand",
    "HFDynamicLayerOffloaded",
    "HFDynamicLayerSelect",
    "HFDynamicSlidingWindowLayer",
    "HFDynamicSlidingWindowLayerRecording",
    "HFStaticLayer",
    "HFStaticLayerEarly",
    "HFStaticSlidingWindowLayer",
    "HFStaticSlidingWindowLayerCroppable",
]
