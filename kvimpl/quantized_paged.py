"""The paged pool with blocks in 8-bit codes (contract, section 10.1): vLLM's quantized KV
pools, where every block, shared or not, holds codes.

``QuantizedPagedPool`` is a ``kvimpl.paged.PagedPool`` whose blocks hold, for each token slot
and kv head, its keys' and values' codes (uint8, min/max over the head's channels, as
``kvimpl.quantized`` codes a row) and that token's scale and zero point, in float32 (float64
for float64 rows). A token's codes depend on that token alone, so a block's codes never
change once written: copy-on-write, a fork, a prefix hit and a truncate share or keep codes,
never re-code them. Its caches declare ``kv_storage = Quantized(8)``: every row may be in
codes from its append on (no full-precision recent run; a pool's blocks are the only place
a row lives).

What moves and what stays codes:

- a prefix hit (section 9.1) holds the publisher's blocks, so the reader gets the publisher's
  codes, dequantized exactly as the publisher's own reads are;
- ``offload`` copies each block's codes and scales to host memory, and ``restore`` writes
  them back into fresh blocks: the codes it had, not the rows re-coded;
- ``export_rows`` (section 11.2) gives the rows dequantized (a ``CacheRows`` holds rows), and
  an import codes them again; coding a dequantized row again gives back its codes (min and
  max are codes 0 and 255), so a move costs at most the dtype's roundings of the scale.

``kvimpl.quantized_paged:pool`` is the default instance (blocks of 16 tokens). It is not one
of ``kvimpl.CACHES``: the benchmark holds those to the full-precision formula.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from kvimpl.paged import PagedCache, PagedPool, _Group
from kvimpl.quantized import BITS, dequantize, quantize
from kvref.protocol import CacheSpec
from kvref.quantized import Quantized

SCALES = 4  # per token and head: the key's scale and zero point, the value's


@dataclass
class _CodedGroup(_Group):
    """A group whose blocks hold one byte per number and four ``wide`` numbers per token and
    head."""

    @property
    def wide(self) -> torch.dtype:
        # float32 scales (float64 for float64 rows): the bound allows the storage dtype's
        # roundings of them, and a half-precision scale would spend all of it.
        return torch.promote_types(self.dtype, torch.float32)

    @property
    def block_nbytes(self) -> int:
        heads, rows, width = self.shape
        scales = SCALES * torch.empty((), dtype=self.wide).element_size()
        return heads * rows * (width + self.value_width + scales)


class QuantizedPagedPool(PagedPool):
    """A ``PagedPool`` whose blocks hold codes and per-token scales (module docstring)."""

    # Not latent layers: the logits budget of coded rows (kvcheck.asserts.LOSSY_FACTOR) is
    # measured on ordinary layers, and a latent's up-projection spreads one latent's coding
    # error over every head's keys and values, past it (contract, 10.1).
    kv_sizes: ClassVar[dict] = {}

    def __call__(self, spec: CacheSpec) -> QuantizedPagedCache:
        return QuantizedPagedCache(self, spec)

    def __repr__(self) -> str:
        return f"QuantizedPagedPool(block_size={self.block_size}, num_blocks={self.num_blocks})"

    def _make_group(self, shape, value_width: int, dtype, device) -> _Group:
        return _CodedGroup(shape, value_width, dtype, device)

    def _allocate(self, group: _Group, blocks: int) -> tuple[Tensor, ...]:
        heads, size, width = group.shape
        codes = torch.zeros((blocks, heads, size, width), dtype=torch.uint8, device=group.device)
        values = codes.new_zeros((blocks, heads, size, group.value_width))
        scales = [
            torch.zeros((blocks, heads, size, 1), dtype=group.wide, device=group.device)
            for _ in range(SCALES)
        ]
        return codes, values, *scales

    def _column_view(self, ids: list[int]) -> None:
        return None  # codes are no rows: every read and write goes through the two below

    def _write_slots(self, block: int, at: slice, key: Tensor, value: Tensor) -> None:
        segment, slot = self._locate(block)
        key_scale, key_zero, value_scale, value_zero = segment.extra
        for codes, scale, zero, rows in (
            (segment.key, key_scale, key_zero, key),
            (segment.value, value_scale, value_zero, value),
        ):
            coded = quantize(rows, scale.dtype)
            codes[slot, :, at], scale[slot, :, at], zero[slot, :, at] = coded

    def _block_rows(self, block: int) -> tuple[Tensor, Tensor]:
        segment, slot = self._locate(block)
        key_scale, key_zero, value_scale, value_zero = (plane[slot] for plane in segment.extra)
        dtype = segment.group.dtype
        keys = dequantize(segment.key[slot], key_scale, key_zero, dtype)
        values = dequantize(segment.value[slot], value_scale, value_zero, dtype)
        return keys, values

    def _planes_of(self, block: int, device) -> tuple[Tensor, ...]:
        """Copies of everything ``block`` holds (codes and scales), on ``device``."""
        segment, slot = self._locate(block)
        return tuple(plane[slot].to(device, copy=True) for plane in segment.planes)

    def _put_planes(self, block: int, planes: tuple[Tensor, ...]) -> None:
        segment, slot = self._locate(block)
        for plane, held in zip(segment.planes, planes, strict=True):
            plane[slot] = held.to(plane.device)


class QuantizedPagedCache(PagedCache):
    """One layer's rows in coded blocks of a ``QuantizedPagedPool``."""

    kv_storage = Quantized(bits=BITS)  # every row in codes from its append on

    @property
    def nbytes(self) -> int:
        if self._away is not None:  # the blocks' codes and scales, in host memory
            return sum(plane.nbytes for row in self._away for block in row for plane in block)
        return super().nbytes

    def offload(self) -> None:
        """Copy every block's codes and scales to host memory, and give the blocks back."""
        self._usable("offload")
        self._away = [[self.pool._planes_of(block, "cpu") for block in row] for row in self._tables]
        self.pool._release(self._tables)
        self._chain = [[] for _ in self._tables]  # the rows come back in other blocks

    def restore(self) -> None:
        """Fresh blocks holding the codes each had; refuse, changing nothing, without room."""
        if self._away is None:
            raise ValueError("restore: the cache is not offloaded")
        self.pool._refuse_unless_free(sum(len(row) for row in self._away), "restore")
        away, self._away = self._away, None
        for table, blocks in zip(self._tables, away, strict=True):
            table += self.pool._take(self._group, len(blocks))
            for block, planes in zip(table, blocks, strict=True):
                self.pool._put_planes(block, planes)
        self._publish_full_blocks()


# The default instance: ``--kv-impl kvimpl.quantized_paged:pool``.
pool = QuantizedPagedPool()
