"""Broken moves of a paged cache between layouts (contract, section 11.2): each a few lines
away from the built-in ``kvimpl.paged`` pool, with exactly one bug.

As in ``tests/mutants/paged.py``, a mutant is a pool instance (a ``kvref.BlockPool``
factory) whose caches have the bug; ``with_blocks`` and ``with_block_size`` give pools of the
same broken kind (the other end of a move between block sizes is broken too). The first
line of each docstring names the bug and the rest the real failure it stands for.
"""

from __future__ import annotations

import torch

from kvimpl.paged import PagedCache
from kvref import CacheRows
from tests.mutants.paged import _MutantPool


class _ReversesBlocks(PagedCache):
    def _append_imported(self, rows: CacheRows) -> None:
        super()._append_imported(rows)
        for table in self._tables:
            table.reverse()  # the blocks written, listed last first


class ImportReversesBlockOrder(_MutantPool):
    """``import_rows`` lists the blocks it writes in reverse order: the first block's rows
    end up at the last block's positions.

    Stands for a connector that receives a request's blocks and records them in another
    order than the sender sent them (caches moved with their blocks out of order, the bug
    class of sglang 20967 and vllm 44455 in the contract's section 11): every row arrives,
    at the wrong position, and the decode side goes on over a scrambled history (writing
    its next tokens into what was the first block, full).
    """

    cache_class = _ReversesBlocks


class _SendsFullBlocks(PagedCache):
    def export_rows(self) -> CacheRows:
        rows = super().export_rows()
        full = rows.length // self.pool.block_size * self.pool.block_size
        rows.keys[:, :, full:] = 0  # the partly filled last block is never sent
        rows.values[:, :, full:] = 0
        return rows


class ExportDropsPartialBlock(_MutantPool):
    """``export_rows`` sends only the full blocks: the rows of the partly filled last block
    come out as zeros, with the whole length.

    Stands for a KV connector that transfers whole blocks only (the prompt's last, partly
    filled block left out, or left for the decode side to recompute and never recomputed):
    the receiver is told the prompt's whole length, as its scheduler knows it, and decodes
    over rows it never got, the buffer's zeros.
    """

    cache_class = _SendsFullBlocks


class _TakesBlocksWhole(PagedCache):
    def _append_imported(self, rows: CacheRows) -> None:
        size, source = self.pool.block_size, rows.block_size or self.pool.block_size
        # Position p of the source goes to block p // source, slot p % source: a block taken
        # whole. Slots no source row maps to are written as zeros; rows past a slot are lost.
        positions = torch.arange(rows.rows, device=rows.keys.device)
        sent = positions // size * source + positions % size
        sent = torch.where((positions % size < source) & (sent < rows.rows), sent, rows.rows)

        def laid(tensor):
            return torch.cat((tensor, torch.zeros_like(tensor[:, :, :1])), dim=2)[:, :, sent]

        moved = CacheRows(laid(rows.keys), laid(rows.values), rows.length, rows.block_size)
        super()._append_imported(moved)


class ImportKeepsSourceBlockSize(_MutantPool):
    """``import_rows`` lays the rows out in the source's block size (``rows.block_size``):
    the source's block i, whole, into its own block i, whatever the two block sizes.

    Stands for disaggregated prefill between workers of different block sizes whose
    connector copies block by block, as if the sizes matched (the receiver's own block size
    used for the allocation only): from larger blocks the rows past its block size are lost,
    from smaller ones each block holds a few rows and a gap, and every position after the
    first block reads another token's row. Right whenever the two sizes are equal.
    """

    cache_class = _TakesBlocksWhole


MOVE_MUTANTS = (
    ImportReversesBlockOrder(),
    ExportDropsPartialBlock(),
    ImportKeepsSourceBlockSize(),
)
