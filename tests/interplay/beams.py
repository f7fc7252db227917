"""Style: one growing tensor per side, doubled when full, with beam reorders gathered lazily.

A beam search reorders the cache at every step, and most reorders are followed at once by an
append; so this cache does not gather on ``reorder``: it keeps the permutation pending and
applies it, in place, at the top of the next call that writes or copies rows (``append``,
``fork``). Nothing else reads the rows, so the pending permutation is invisible from outside.
``truncate`` commutes with a permutation of batch rows, so it leaves the pending one alone.

The one bug (``LazyGatherOverwritesPendingReorder``): a ``reorder`` that finds a permutation
still pending replaces it instead of composing with it.

- First event: a ``reorder``, which leaves the state "a permutation pending" (no append yet).
- Second event: another ``reorder`` before any append (a beam step whose append was rolled
  back, a search that reorders twice when it both prunes finished beams and reranks, an
  engine that reorders once per layer group).
- A correct cache holds rows ``old[p1][p2]``, i.e. storage gathered by ``p1[p2]``; this one
  gathers by ``p2`` alone, so every beam reads the history of the wrong parent from the
  next append on. One reorder followed by an append is right, and so is any number of
  reorders each followed by an append.

Stands for engines that defer the beam gather (an indirection table of beam indices, a
``reorder_cache`` that only keeps ``beam_idx`` for the next step) and assume one reorder per
step: BUGS.md class 6 of its table, batch-axis re-indexing ("reorder silently skipped",
"beams read stale blocks"). The twin (``LazyGatherComposesReorders``) composes:
``pending = pending[p2]``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvref import check_append, check_reorder, check_truncate


class LazyGatherOverwritesPendingReorder:
    compose = False  # the bug: a second pending reorder replaces the first

    def __init__(self, spec) -> None:
        self.spec = spec
        self._n = 0
        self._pending: Tensor | None = None  # new row b is stored row pending[b]
        self._k = self._empty(0, spec.head_dim)
        self._v = self._empty(0, spec.value_width)

    def _empty(self, capacity: int, width: int) -> Tensor:
        s = self.spec
        return torch.zeros((s.batch, s.kv_heads, capacity, width), dtype=s.dtype, device=s.device)

    @property
    def length(self) -> int:
        return self._n

    @property
    def nbytes(self) -> int:
        return self._k.nbytes + self._v.nbytes

    def _settle(self) -> None:
        """Apply the pending permutation to the rows held (advanced indexing copies first,
        so the in-place assignment reads the old rows)."""
        if self._pending is None:
            return
        n = self._n
        self._k[:, :, :n] = self._k[self._pending, :, :n]
        self._v[:, :, :n] = self._v[self._pending, :, :n]
        self._pending = None

    def _room(self, needed: int) -> None:
        capacity = self._k.shape[2]
        if needed <= capacity:
            return
        capacity = max(needed, 2 * capacity, 16)
        k = self._empty(capacity, self.spec.head_dim)
        v = self._empty(capacity, self.spec.value_width)
        k[:, :, : self._n] = self._k[:, :, : self._n]
        v[:, :, : self._n] = self._v[:, :, : self._n]
        self._k, self._v = k, v

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        new = check_append(self.spec, self._n, key, value)
        self._settle()
        self._room(self._n + new)
        self._k[:, :, self._n : self._n + new] = key
        self._v[:, :, self._n : self._n + new] = value
        self._n += new
        return self._k[:, :, : self._n], self._v[:, :, : self._n]

    def reorder(self, indices: Tensor) -> None:
        check_reorder(self.spec, indices)
        if self._pending is not None and self.compose:
            self._pending = self._pending[indices]
        else:
            # Bug (compose False): a permutation still pending is forgotten.
            self._pending = indices.clone()

    def truncate(self, length: int) -> None:
        check_truncate(self._n, length)
        self._n = length  # rows past it are dead; the pending permutation still applies

    def fork(self) -> LazyGatherOverwritesPendingReorder:
        self._settle()
        child = type(self)(self.spec)
        child._room(self._n)
        child._k[:, :, : self._n] = self._k[:, :, : self._n]
        child._v[:, :, : self._n] = self._v[:, :, : self._n]
        child._n = self._n
        return child

    def reset(self) -> None:
        self._n = 0
        self._pending = None


class LazyGatherComposesReorders(LazyGatherOverwritesPendingReorder):
    """The twin: a reorder composes with the one pending."""

    compose = True
