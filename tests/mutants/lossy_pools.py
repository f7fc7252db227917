"""Broken coded caches (docs/contract.md, section 10.1, "everywhere a row is compared"): the
built-in coded paged pool (``kvimpl/quantized_paged.py``) with one bug in how its codes are
shared, restored or read by another request, and the independent coded cache of rows of
their own (``tests/independent/residual_rows_cache.py``) with one in its per-row residual.
As in ``tests/mutants/paged.py``, the first paragraph of each docstring names the bug and
the second the real failure it stands for."""

from __future__ import annotations

import torch
from torch import Tensor

from kvimpl.paged import PagedCache
from kvimpl.quantized import LEVELS, quantize
from kvimpl.quantized_paged import QuantizedPagedCache, QuantizedPagedPool
from tests.independent.residual_rows_cache import RECENT, ResidualRowsCache


class _MutantCodedPool(QuantizedPagedPool):
    """A coded pool whose caches are ``cache_class``; named after its class in the table."""

    cache_class = QuantizedPagedCache

    @property
    def __name__(self) -> str:
        return type(self).__name__

    def __call__(self, spec) -> QuantizedPagedCache:
        return self.cache_class(self, spec)


class ScaleSharedAcrossRequests(_MutantCodedPool):
    """The pool codes every token of every cache with one scale and zero point per kv head
    and part, taken from the first token it ever coded: later tokens outside that range are
    clipped.

    Stands for one scale shared across requests and tenants: a per-layer k_scale computed
    once from the first batch and reused (vllm 27232's calculated KV scales), and KIVI 18,
    where the batch's rows shared their scales and quality fell with batch size.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._shared: dict[tuple, tuple[Tensor, Tensor]] = {}  # (group, part) -> scale, zero

    def _write_slots(self, block: int, at: slice, key: Tensor, value: Tensor) -> None:
        segment, slot = self._locate(block)
        key_scale, key_zero, value_scale, value_zero = segment.extra
        shared = self._shared
        for part, (codes, scale, zero, rows) in enumerate(
            (
                (segment.key, key_scale, key_zero, key),
                (segment.value, value_scale, value_zero, value),
            )
        ):
            first = (id(segment.group), part)
            if first not in shared:  # the first token this pool codes for this shape
                shared[first] = quantize(rows[:, :1], scale.dtype)[1:]
            step, low = shared[first]
            wide = rows.to(scale.dtype)
            codes[slot, :, at] = ((wide - low) / step).round().clamp(0, LEVELS).to(torch.uint8)
            scale[slot, :, at], zero[slot, :, at] = step, low


class _CodesAgainOnRestore(QuantizedPagedCache):
    # The built-in full-precision pool's swap out: the rows decoded to the host.
    offload = PagedCache.offload
    nbytes = PagedCache.nbytes

    def restore(self) -> None:
        PagedCache.restore(self)
        for table in self._tables:  # coded again, by the staging layout's scale
            for block in table:
                code_with_one_scale(self.pool, block)


class RestoreCodesAgain(_MutantCodedPool):
    """``offload`` keeps the rows decoded, and ``restore`` codes them again with new scales,
    one min/max per kv head over each block where they were coded per token: every swap
    moves the rows, and the drift adds up over preemptions.

    Stands for a swap path that dequantizes to the host and re-quantizes on the way back
    with the layout of its staging buffer (a KV offload connector moving fp8 or int8 blocks
    through a full-precision buffer and a per-block scale), re-rounding a request's whole
    history at every preemption.
    """

    cache_class = _CodesAgainOnRestore


class HitCodedWithReadersScale(_MutantCodedPool):
    """A prefix hit codes the publisher's rows again with the reader's scale: one min/max
    per kv head over the whole block, where the publisher coded each token by its own range.

    Stands for a reader that decodes a shared quantized block with a scale of its own rather
    than the one the block was written with (sglang 36644: chunked prefill read fp8 keys and
    values written by earlier chunks; vllm 3234: the prefix-caching kernel read an fp8 cache
    it did not know the layout of).
    """

    def lookup_prefix(self, caches, tokens: Tensor, *, salt=None) -> int:
        found = super().lookup_prefix(caches, tokens, salt=salt)
        hit = found // self.block_size
        for cache in caches:
            for table in cache._tables:
                for block in table[:hit]:
                    code_with_one_scale(self, block)
        return found


def code_with_one_scale(pool: QuantizedPagedPool, block: int) -> None:
    """Code ``block``'s rows again with one scale and zero point per kv head and part over
    the whole block."""
    segment, slot = pool._locate(block)
    key_scale, key_zero, value_scale, value_zero = segment.extra
    rows = pool._block_rows(block)
    for codes, scale, zero, held in zip(
        (segment.key, segment.value),
        (key_scale, value_scale),
        (key_zero, value_zero),
        rows,
        strict=True,
    ):
        wide = held.to(scale.dtype)
        low = wide.amin(dim=(1, 2), keepdim=True)
        step = (wide.amax(dim=(1, 2), keepdim=True) - low) / LEVELS
        step = torch.where(step > 0, step, torch.ones_like(step))
        codes[slot] = ((wide - low) / step).round().clamp(0, LEVELS).to(torch.uint8)
        scale[slot], zero[slot] = step.expand_as(scale[slot]), low.expand_as(zero[slot])


class RecentRunOfAnotherRow(ResidualRowsCache):
    """Every row's residual is counted from the first row's length: a row shorter than the
    first has its recent tokens coded, one longer keeps old ones exact.

    Stands for one sample's length applied to every row of a batch (lalamo 242: compaction
    used one sample's cache_len for all rows; KIVI 18: the residual and scales were shared by
    the batch's rows).
    """

    def _residual_start(self, row: int) -> int:
        return max(0, self._lengths[0] - RECENT)


LOSSY_POOL_MUTANTS = (
    ScaleSharedAcrossRequests(),
    RestoreCodesAgain(),
    HitCodedWithReadersScale(),
    RecentRunOfAnotherRow,
)
