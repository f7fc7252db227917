"""Style 10: the radix prefix pool (style 9) with its blocks in 8-bit codes, symmetric, one
absmax scale per group of ``GROUP`` channels of each token (contract, section 10.1).

Written from the contract, in another style than the built-in coded pool
(``kvimpl/quantized_paged.py``, min/max codes with a zero point per token): here codes are
signed, round(x / scale) clamped to [-127, 127] with scale = absmax / 127 per group of 4
channels (the last group the channels left), and the slab's two planes are objects that
code on write and decode on read, so the radix pool's own gathers and scatters run on codes
unchanged. What the contract asks of a coded pool, and how this one meets it:

- a token's codes depend on that token alone, so a shared or published block is never coded
  again: a prefix hit reads the publisher's codes, decoded as the publisher reads them;
- a copy (copy-on-write) copies codes and scales, never decoded rows;
- ``offload`` keeps the blocks' codes and scales on the CPU, and ``restore`` writes them back
  into fresh blocks: the codes it had.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvref.quantized import Quantized
from tests.independent.radix_prefix_pool import (
    RadixInputError,
    RadixPrefixCache,
    RadixPrefixPool,
    _give_back,
    _storage_key,
)

BITS = 8
TOP = 2 ** (BITS - 1) - 1  # 127
GROUP = 4


class _CodedPlane:
    """Codes (N, H, size, D) int8 and scales (N, H, size, groups) of one part of a slab,
    indexed as the tensor of rows it stands for."""

    def __init__(self, codes: Tensor, scales: Tensor, group: int, dtype: torch.dtype) -> None:
        self.codes, self.scales, self.group, self.dtype = codes, scales, group, dtype

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def __getitem__(self, index) -> Tensor:
        codes, scales = self.codes[index], self.scales[index]
        widths = _widths(codes.shape[-1], self.group)
        pieces = codes.to(scales.dtype).split(widths, dim=-1)
        rows = [piece * scales[..., g : g + 1] for g, piece in enumerate(pieces)]
        return torch.cat(rows, dim=-1).to(self.dtype)

    def __setitem__(self, index, rows: Tensor) -> None:
        wide = rows.to(self.scales.dtype)
        pieces = wide.split(_widths(rows.shape[-1], self.group), dim=-1)
        absmax = torch.stack([piece.abs().amax(-1) for piece in pieces], dim=-1)
        scales = torch.where(absmax > 0, absmax / TOP, torch.ones_like(absmax))
        codes = [
            (piece / scales[..., g : g + 1]).round().clamp(-TOP, TOP)
            for g, piece in enumerate(pieces)
        ]
        self.codes[index] = torch.cat(codes, dim=-1).to(torch.int8)
        self.scales[index] = scales


def _widths(width: int, group: int) -> list[int]:
    return [min(group, width - start) for start in range(0, width, group)]


class _CodedSlab:
    """The radix pool's slab, its keys and values held as ``_CodedPlane``s."""

    def __init__(self, heads: int, rows: int, width: int, dtype, device, limit: int) -> None:
        self.limit, self.group = limit, min(GROUP, width)
        wide = torch.float64 if dtype == torch.float64 else torch.float32
        groups = len(_widths(width, self.group))
        self.keys, self.values = (
            _CodedPlane(
                torch.zeros((0, heads, rows, width), dtype=torch.int8, device=device),
                torch.zeros((0, heads, rows, groups), dtype=wide, device=device),
                self.group,
                dtype,
            )
            for _ in range(2)
        )

    def planes(self) -> list[Tensor]:
        return [self.keys.codes, self.keys.scales, self.values.codes, self.values.scales]

    def hold(self, block: int) -> None:
        size = self.keys.shape[0]
        if block < size:
            return
        grown = min(self.limit, max(block + 1, 2 * size, 8))
        for plane in (self.keys, self.values):
            for name in ("codes", "scales"):
                old = getattr(plane, name)
                new = old.new_zeros((grown, *old.shape[1:]))
                new[:size] = old
                setattr(plane, name, new)

    def copy(self, source: int, target: int) -> None:
        for plane in (self.keys, self.values):
            plane.codes[target] = plane.codes[source]
            plane.scales[target] = plane.scales[source]


class CodedRadixPool(RadixPrefixPool):
    """A radix prefix pool whose blocks hold codes (module docstring)."""

    def __call__(self, spec) -> CodedRadixCache:
        return CodedRadixCache(self, spec)

    def with_blocks(self, num_blocks: int, *, block_hash=None) -> CodedRadixPool:
        return CodedRadixPool(self.block_size, num_blocks)

    def _slab(self, spec) -> _CodedSlab:
        key = ("coded", *_storage_key(spec))
        if key not in self._slabs:
            self._slabs[key] = _CodedSlab(
                spec.kv_heads, self.block_size, spec.head_dim, spec.dtype, spec.device, self.room
            )
        return self._slabs[key]


class CodedRadixCache(RadixPrefixCache):
    def __init__(self, pool: CodedRadixPool, spec) -> None:
        super().__init__(pool, spec)
        self.kv_storage = Quantized(bits=BITS, group=self._slab.group, symmetric=True)

    @property
    def nbytes(self) -> int:
        if self._host is not None:
            return sum(plane.nbytes for plane in self._host)
        one = sum(plane[0].nbytes for plane in self._slab.planes()) if self._tables[0] else 0
        return one * sum(len(table) for table in self._tables)

    def fork(self) -> CodedRadixCache:
        self._not_offloaded("fork")
        child = CodedRadixCache(self.pool, self.spec)  # the base's fork builds its own class
        for row, table in enumerate(self._tables):
            for block in table:
                self.pool._share(block)
            child._tables[row].extend(table)
        child._anchors = [list(anchors) for anchors in self._anchors]
        child._tokens = [list(tokens) for tokens in self._tokens]
        child._key, child._undeclared_from = self._key, self._undeclared_from
        child._count = self._count
        return child

    def offload(self) -> None:
        """Every block's codes and scales to the CPU, row by row; the blocks go back."""
        self._not_offloaded("offload")
        ids = torch.tensor(self._tables, dtype=torch.int64).reshape(len(self._tables), -1)
        ids = ids.to(self._slab.keys.codes.device)
        self._host = tuple(plane[ids].to("cpu", copy=True) for plane in self._slab.planes())
        _give_back(self.pool, self._tables)
        self._anchors = [[] for _ in self._tables]

    def restore(self) -> None:
        if self._host is None:
            raise RadixInputError("restore: this cache is not offloaded")
        per_row = self._host[0].shape[1]
        taken = self.pool._take(per_row * len(self._tables), self._slab)  # may refuse
        for row, table in enumerate(self._tables):
            table.extend(taken[row * per_row : (row + 1) * per_row])
        host, self._host = self._host, None
        ids = torch.tensor(self._tables, dtype=torch.int64).reshape(len(self._tables), -1)
        planes = self._slab.planes()
        ids = ids.to(planes[0].device)
        for plane, held in zip(planes, host, strict=True):
            plane[ids] = held.to(plane.device)
        self._publish_full_blocks()
