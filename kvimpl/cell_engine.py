"""A correct ``SequenceEngine`` kept the way llama.cpp's unified KV cache keeps its memory.

The engine-level kit's own correct engine (``kvcheck.engines``, contract section 13): the
layout and the bookkeeping follow llama.cpp's ``llama_kv_cells`` (src/llama-kv-cells.h) and
``llama_kv_cache`` (src/llama-kv-cache.cpp), in code of its own:

- a fixed number of cells, each with one position and a set of sequence ids (empty: free),
  and per layer a K tensor (each cell's key rotated at the cell's position) and a V tensor
  over the cells;
- ``decode`` places the batch's tokens in free cells found by a ring search from ``head``
  (first fit, so that a sequence's cells are not in position order once cells have been
  freed), writes each layer's new K and V into them and attends over every cell with an
  explicit boolean mask: a token sees a cell that holds its own sequence at a position not
  after its own (llama.cpp's ``kq_mask``);
- ``remove`` drops the sequence's id from its cells in the span, a cell with no id left is
  free, and the search's ``head`` goes back to the first cell freed (``seq_rm``);
- ``copy`` adds the target's id to every cell of the source: the cells are shared, not
  duplicated (``seq_cp``);
- ``shift`` adds delta to the positions of the sequence's cells in the span and notes the
  delta on the cell; the keys are re-rotated by their cells' pending deltas before the next
  decode (llama.cpp's deferred K-shift, ``has_shift`` and ``build_graph_shift``).

One place it parts from llama.cpp on purpose: llama.cpp's ``seq_add`` moves a cell shared by
several sequences for all of them (a cell has one position). The protocol's ``shift`` moves
"the sequence's tokens", and a copy and its source go on apart, so a shared cell in the span
is copied on write: the sequence's id leaves it for a new cell holding the same K (its
pending delta carried over), the same V, at the new position. A cell held by the shifted
sequence alone moves in place.

The model is the reference transformer's own modules (embedding, norms, projections, feed
forward, tied output), run by this module's own forward pass over the cells; it computes in
the model's dtype. Nothing is validated: a batch the cells cannot hold raises.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from kvref.engine import EngineSpec, Step
from kvref.model import ReferenceTransformer
from kvref.rope import apply_rope, rerotate


class CellEngine:
    """llama.cpp's unified KV cache in miniature (the module docstring). ``cells``: how many
    (default: every sequence full, ``sequences x max_tokens``, which copy-on-write shifts
    need at most); ``head``: the cell the first search starts from (default: the model's
    seed modulo the cells, so that the kit's draws start the ring anywhere and reach its
    wrap)."""

    def __init__(
        self,
        model: ReferenceTransformer,
        spec: EngineSpec,
        *,
        cells: int | None = None,
        head: int | None = None,
    ) -> None:
        c = model.config
        if c.attention != "gqa" or c.window is not None or c.kv_sources is not None:
            raise NotImplementedError("CellEngine runs plain Llama-style models only")
        self.model, self.spec = model, spec
        self.size = cells if cells is not None else spec.sequences * spec.max_tokens
        self.head = (c.seed if head is None else head) % self.size
        like = {"dtype": model.dtype, "device": model.device}
        self.pos = torch.full((self.size,), -1, dtype=torch.long, device=model.device)
        self.seqs: list[set[int]] = [set() for _ in range(self.size)]
        self.pending = [0] * self.size  # each cell's K-shift not yet applied to its keys
        shape = (self.size, c.num_kv_heads, c.head_dim)
        self.k = [torch.zeros(shape, **like) for _ in range(c.num_layers)]
        self.v = [torch.zeros(shape, **like) for _ in range(c.num_layers)]

    # --- the cells ---------------------------------------------------------------------

    def is_free(self, cell: int) -> bool:
        return not self.seqs[cell]

    def free(self, cell: int) -> None:
        self.seqs[cell] = set()
        self.pos[cell] = -1
        self.pending[cell] = 0

    def find_cells(self, count: int) -> list[int]:
        """``count`` free cells, first fit around the ring from ``head``."""
        found = []
        for step in range(self.size):
            cell = (self.head + step) % self.size
            if self.is_free(cell):
                found.append(cell)
                if len(found) == count:
                    return found
        raise RuntimeError(f"no room: {count} cells wanted, {len(found)} free of {self.size}")

    def in_span(self, cell: int, start: int, end: int | None) -> bool:
        p = int(self.pos[cell])
        return p >= start and (end is None or p < end)

    def apply_shifts(self) -> None:
        """Re-rotate each cell's keys by its pending delta (the deferred K-shift)."""
        by_delta: dict[int, list[int]] = {}
        for cell, delta in enumerate(self.pending):
            if delta:
                by_delta.setdefault(delta, []).append(cell)
        base = self.model.config.rope_base
        for delta, cells in by_delta.items():
            index = torch.tensor(cells, device=self.pos.device)
            for keys in self.k:
                # (cells, heads, D) as (heads, cells, D): rerotate rotates the rows axis.
                moved = rerotate(keys[index].transpose(0, 1), delta, base)
                keys[index] = moved.transpose(0, 1)
        self.pending = [0] * self.size

    # --- the protocol ------------------------------------------------------------------

    @torch.no_grad()
    def decode(self, steps: Sequence[Step]) -> list[Tensor]:
        self.apply_shifts()
        device = self.pos.device
        tokens = [t for step in steps for t in step.tokens]
        positions = [p for step in steps for p in step.positions]
        owners = [step.sequence for step in steps for _ in step.tokens]
        placed = self.place(owners, positions)
        mask = self.mask(owners, positions)
        at = torch.tensor(positions, dtype=torch.long, device=device)
        index = torch.tensor(placed, dtype=torch.long, device=device)
        x = self.model.embedding(torch.tensor(tokens, dtype=torch.long, device=device))
        for layer, block in enumerate(self.model.blocks):
            x = x + self.attend(layer, block.attention, block.attention_norm(x), at, index, mask)
            x = x + block.feed_forward(x)
        logits = self.model.final_norm(x) @ self.model.embedding.weight.T
        return list(logits.split([len(step.tokens) for step in steps]))

    def place(self, owners: list[int], positions: list[int]) -> list[int]:
        """Each new token's cell: found free, given its sequence and position."""
        placed = self.find_cells(len(owners))
        for cell, sequence, position in zip(placed, owners, positions, strict=True):
            self.seqs[cell] = {sequence}
            self.pos[cell] = position
        self.head = (placed[-1] + 1) % self.size
        return placed

    def mask(self, owners: list[int], positions: list[int]) -> Tensor:
        """(tokens, cells): True where a token sees a cell (its sequence's, not after it)."""
        held = torch.tensor(
            [[owner in self.seqs[cell] for cell in range(self.size)] for owner in owners],
            dtype=torch.bool,
            device=self.pos.device,
        )
        at = torch.tensor(positions, dtype=torch.long, device=self.pos.device)
        return held & (self.pos[None, :] <= at[:, None])

    def attend(self, layer: int, attention, x: Tensor, at: Tensor, index: Tensor, mask: Tensor):
        """The attention block over the cells, the new tokens' K and V written in first."""
        c = self.model.config
        n = x.shape[0]
        q = attention.query(x).view(n, c.num_heads, c.head_dim).transpose(0, 1)  # (H, n, D)
        k = attention.key(x).view(n, c.num_kv_heads, c.head_dim).transpose(0, 1)
        v = attention.value(x).view(n, c.num_kv_heads, c.head_dim)
        q = apply_rope(q[None], at, c.rope_base)[0]
        k = apply_rope(k[None], at, c.rope_base)[0].transpose(0, 1)  # (n, H_kv, D)
        self.k[layer][index] = k
        self.v[layer][index] = v
        group = c.num_heads // c.num_kv_heads
        keys = self.k[layer].transpose(0, 1).repeat_interleave(group, dim=0)  # (H, cells, D)
        values = self.v[layer].transpose(0, 1).repeat_interleave(group, dim=0)
        scores = (q @ keys.transpose(-2, -1)) / c.head_dim**0.5
        weights = torch.softmax(scores.masked_fill(~mask[None], float("-inf")), dim=-1)
        mixed = (weights @ values).transpose(0, 1).reshape(n, c.num_heads * c.head_dim)
        return attention.out(mixed)

    def clear(self) -> None:
        for cell in range(self.size):
            self.free(cell)
        self.head = 0

    def remove(self, sequence: int, start: int, end: int | None) -> None:
        first_freed = None
        for cell in range(self.size):
            if sequence in self.seqs[cell] and self.in_span(cell, start, end):
                self.seqs[cell].discard(sequence)
                if self.is_free(cell):
                    self.free(cell)
                    first_freed = cell if first_freed is None else first_freed
        if first_freed is not None and first_freed < self.head:
            self.head = first_freed

    def copy(self, source: int, target: int) -> None:
        for cell in range(self.size):
            if source in self.seqs[cell]:
                self.seqs[cell].add(target)

    def shift(self, sequence: int, start: int, end: int | None, delta: int) -> None:
        moving = [
            cell
            for cell in range(self.size)
            if sequence in self.seqs[cell] and self.in_span(cell, start, end)
        ]
        for cell in moving:
            if self.seqs[cell] != {sequence}:  # shared: the sequence's own cell, copied on write
                cell = self.copy_on_write(cell, sequence)
            self.pos[cell] += delta
            self.pending[cell] += delta

    def copy_on_write(self, cell: int, sequence: int) -> int:
        """Take ``sequence`` off the shared ``cell`` onto a free cell of its own, the same K
        (its pending delta too), V and position."""
        self.seqs[cell].discard(sequence)
        (own,) = self.find_cells(1)
        self.seqs[own] = {sequence}
        self.pos[own] = self.pos[cell]
        self.pending[own] = self.pending[cell]
        for keys, values in zip(self.k, self.v, strict=True):
            keys[own] = keys[cell]
            values[own] = values[cell]
        return own


def engine(model: ReferenceTransformer, spec: EngineSpec) -> CellEngine:
    """The ``EngineFactory``: a ``CellEngine`` of the model, with the default cells."""
    return CellEngine(model, spec)
