"""Broken engines: one-bug subclasses of ``kvimpl.cell_engine.CellEngine``.

Each stands for a bug class of real engines' KV memory (llama.cpp's cells, a serving
engine's sequences; ../shared/BUGS.md), and ``tests/test_engines.py`` checks that the
engine properties of ``kvcheck.engines`` catch each one. ``ENGINE_MUTANTS`` lists them with
the property that must catch it; it is not part of the layer catalogue (``MUTANTS``).
"""

from __future__ import annotations

from torch import Tensor

from kvimpl.cell_engine import CellEngine


class ShiftWithoutKShift(CellEngine):
    """shift moves the cells' positions but never re-rotates their keys.

    The context shift whose K-shift pass is skipped (a model or cache type for which
    llama.cpp's ``build_graph_shift`` does nothing, or a pending shift dropped): the mask
    sees the new positions while the keys still carry the old rotation."""

    def apply_shifts(self) -> None:
        self.pending = [0] * self.size


class ShiftMovesSharedCells(CellEngine):
    """shift moves a cell shared by a copy for every sequence that holds it.

    llama.cpp's ``seq_add`` on a cell that ``seq_cp`` shared: a cell has one position, so
    shifting one sequence shifts the copy and the source together."""

    def shift(self, sequence: int, start: int, end: int | None, delta: int) -> None:
        for cell in range(self.size):
            if sequence in self.seqs[cell] and self.in_span(cell, start, end):
                self.pos[cell] += delta
                self.pending[cell] += delta


class RemoveFreesSharedCells(CellEngine):
    """remove frees the cells in the span whoever else holds them.

    ``seq_rm`` that clears a cell instead of dropping one sequence id from it: after a copy,
    removing from one sequence takes the tokens away from the other too."""

    def remove(self, sequence: int, start: int, end: int | None) -> None:
        for cell in range(self.size):
            if sequence in self.seqs[cell] and self.in_span(cell, start, end):
                self.free(cell)
        self.head = 0


class MaskIgnoresSequences(CellEngine):
    """A token sees every occupied cell at a position not after its own, whatever its
    sequence.

    The attention mask of a unified cache built without the sequence ids (llama.cpp's
    ``kq_mask`` checking ``cell.is_empty()`` for ``!cell.has_seq_id(seq)``): sequences
    batched together read one another's tokens."""

    def mask(self, owners, positions):
        at = self.pos.new_tensor(positions)[:, None]
        return super().mask(owners, positions) | ((self.pos[None, :] >= 0) & (self.pos <= at))


class SearchTrustsHead(CellEngine):
    """The cell search takes the cells from ``head`` on without asking whether they are
    free.

    A ``find_slot`` whose occupancy test is lost: after a removal moved ``head`` back to a
    freed cell, a batch longer than the freed span overwrites the occupied cells after it."""

    def find_cells(self, count: int) -> list[int]:
        return [(self.head + step) % self.size for step in range(count)]


class PositionsFromCount(CellEngine):
    """New tokens are placed at positions counted from the cells their sequence holds, not
    at the positions the step gives.

    ``n_past`` bookkeeping: a server that numbers a sequence's next token by how many it
    holds, wrong once a sequence starts elsewhere than 0, a span is removed or a shift
    opened a gap."""

    def place(self, owners, positions):
        counted, seen = [], {}
        for owner in owners:
            held = seen.setdefault(owner, sum(owner in s for s in self.seqs))
            counted.append(held)
            seen[owner] = held + 1
        positions[:] = counted
        return super().place(owners, positions)


class ClearLeavesLastSequence(CellEngine):
    """clear forgets every sequence but the last.

    A clear that walks the sequence ids off by one (or one stream of a multi-stream cache
    left out): the last sequence, fed again after the clear, still sees its old tokens."""

    def clear(self) -> None:
        last = self.spec.sequences - 1
        for cell in range(self.size):
            self.seqs[cell] -= set(range(last))
            if not self.seqs[cell]:
                self.free(cell)
        self.head = 0


class PrefillNotCausal(CellEngine):
    """A batch's tokens see every cell of their sequence, the batch's later tokens among them.

    The causal mask left out of a prefill (a decoder run with llama.cpp's ``causal_attn``
    off, or an embedding path's non-causal attention taken): single-token decode steps are
    right, a prompt of several tokens reads its own future."""

    def mask(self, owners: list[int], positions: list[int]) -> Tensor:
        return super().mask(owners, [max(positions)] * len(positions))


class ShiftMovesTheTokenAtEnd(CellEngine):
    """shift moves the token at ``end`` too: its span taken as [start, end], not [start, end).

    An off-by-one in ``seq_add``'s span (``p1`` taken inclusive): a shift to the end of a
    sequence (``end`` None) is right, and so is every span whose end no token sits at; a
    span that ends at a held token moves it with the rest, out of its place."""

    def shift(self, sequence: int, start: int, end: int | None, delta: int) -> None:
        super().shift(sequence, start, None if end is None else end + 1, delta)


# Each mutant and the engine property that must catch it.
ENGINE_MUTANTS = (
    (ShiftWithoutKShift, "engine shift"),
    (ShiftMovesSharedCells, "engine shift"),
    (ShiftMovesTheTokenAtEnd, "engine shift"),
    (RemoveFreesSharedCells, "engine copy"),
    (MaskIgnoresSequences, "engine sequences"),
    (SearchTrustsHead, "engine remove"),
    (PositionsFromCount, "engine remove"),
    (ClearLeavesLastSequence, "engine clear"),
    (PrefillNotCausal, "engine decode"),
    (ShiftWithoutKShift, "engine mixed"),
)
