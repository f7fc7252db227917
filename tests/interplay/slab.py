"""Style: a slab preallocated to ``max_length`` (a static cache), shared by forks copy-on-write
through an owner count, and scrubbed on reset.

``fork`` costs nothing: the child points at the parent's slab and the slab's owner count
goes up. Whoever writes to a slab that has other owners first copies the rows it holds into
a slab of its own (``_own``); ``truncate`` only moves the length, and ``reorder`` always
builds a new slab. ``reset`` scrubs the rows the cache held (zeros), so that no row of a
finished request can ever be read back by the next one, even through a read past the length
(rule 6 asks that nothing from before a reset comes back; this cache makes sure of it).

The one bug (``ResetScrubsSharedSlab``): ``reset`` scrubs the slab in place whether or not
other caches still own it.

- First event: ``fork`` (the state "a slab with two owners, neither written since").
- Second event: ``reset`` of either side before either writes (a parallel sample cancelled
  at once, a parent request finished right after its prompt was forked, the prompt cache of
  a system prompt reset for the next user while its forks serve).
- A correct cache gives the shared slab up and takes a fresh one; this one zeroes the rows
  its forks still hold: their next step attends over zero keys and values. A reset of a
  cache that owns its slab alone, and a fork whose sides write before any reset, are right.

Stands for "clear" paths written for a cache that owns its memory (zero the buffer, keep
the allocation for the next request, as static caches do) that meet copy-on-write sharing
added later (BUGS.md classes 5 and 3 of its table: reset and reuse, "CoW not applied"). The
twin (``ResetDetachesSharedSlab``) takes a fresh slab when it shares one.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from kvref import check_append, check_reorder, check_truncate


class _Slab:
    """Rows for ``max_length`` tokens and how many caches read them."""

    def __init__(self, spec) -> None:
        like = {"dtype": spec.dtype, "device": spec.device}
        rows = (spec.batch, spec.kv_heads, spec.max_length)
        self.k = torch.zeros((*rows, spec.head_dim), **like)
        self.v = torch.zeros((*rows, spec.value_width), **like)
        self.owners = 1


def _disown(holder: list[_Slab]) -> None:
    holder[0].owners -= 1


class ResetScrubsSharedSlab:
    detach_on_reset = False  # the bug: reset scrubs a slab other caches still read

    def __init__(self, spec, slab: _Slab | None = None, length: int = 0) -> None:
        self.spec = spec
        self._n = length
        # A one-element list, so that the finalizer (which must not hold the cache) always
        # disowns the slab the cache holds when it is collected.
        self._holder = [slab if slab is not None else _Slab(spec)]
        weakref.finalize(self, _disown, self._holder)

    @property
    def _slab(self) -> _Slab:
        return self._holder[0]

    def _replace(self, slab: _Slab) -> None:
        self._slab.owners -= 1
        self._holder[0] = slab

    @property
    def length(self) -> int:
        return self._n

    @property
    def nbytes(self) -> int:
        return self._slab.k.nbytes + self._slab.v.nbytes

    def _own(self) -> None:
        """Copy on write: a slab with other owners is copied before this cache writes."""
        if self._slab.owners > 1:
            mine = _Slab(self.spec)
            mine.k[:, :, : self._n] = self._slab.k[:, :, : self._n]
            mine.v[:, :, : self._n] = self._slab.v[:, :, : self._n]
            self._replace(mine)

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        new = check_append(self.spec, self._n, key, value, capacity=self.spec.max_length)
        self._own()
        slab, n = self._slab, self._n
        slab.k[:, :, n : n + new] = key
        slab.v[:, :, n : n + new] = value
        self._n = n + new
        return slab.k[:, :, : self._n], slab.v[:, :, : self._n]

    def fork(self) -> ResetScrubsSharedSlab:
        self._slab.owners += 1
        return type(self)(self.spec, self._slab, self._n)

    def truncate(self, length: int) -> None:
        check_truncate(self._n, length)
        self._n = length

    def reorder(self, indices: Tensor) -> None:
        check_reorder(self.spec, indices)
        moved = _Slab(self.spec)
        moved.k[:, :, : self._n] = self._slab.k[indices, :, : self._n]
        moved.v[:, :, : self._n] = self._slab.v[indices, :, : self._n]
        self._replace(moved)

    def reset(self) -> None:
        if self.detach_on_reset and self._slab.owners > 1:
            self._replace(_Slab(self.spec))  # fresh zeros; the others keep theirs
        else:
            # Bug (detach_on_reset False): scrubbed in place, forks or not.
            self._slab.k[:, :, : self._n].zero_()
            self._slab.v[:, :, : self._n].zero_()
        self._n = 0


class ResetDetachesSharedSlab(ResetScrubsSharedSlab):
    """The twin: a reset of a shared slab takes a fresh one instead of scrubbing."""

    detach_on_reset = True
