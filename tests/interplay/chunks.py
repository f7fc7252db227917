"""Style: a list of chunks, one per append, with a sorted index of where each chunk starts,
so that a rollback finds the chunk it ends in by bisection instead of walking the list.

``_chunks[i]`` holds the rows given by one call and ``_starts[i]`` the position of its first
row: the two lists move together. ``truncate`` bisects ``_starts`` for the chunks that begin
before the new length, drops the rest and cuts the last one kept. Rows move between layouts
as one run (``export_rows`` / ``import_rows``, contract section 11.2): an import lays the run
in as a single chunk.

The one bug (``ImportLeavesChunkIndexBehind``): ``import_rows`` appends the chunk but not
its start to the index, so from then on ``_starts[i]`` describes ``_chunks[i + 1]``.

- First event: ``import_rows`` (a cache moved in from another layout: disaggregated
  prefill handing its rows to a decode worker), leaving "one chunk more than the index".
- Second event: a ``truncate`` (a rejected draft, an edit), at once or after decode steps.
- A correct cache cuts the chunk the length ends in; this one bisects a shifted index and
  keeps the wrong chunks, or none. Decode steps after an import append and return the right
  rows, an export after an import is right, and a truncate of a cache fed by appends is
  right: only the pair shows.

Stands for import or migration paths that rebuild a cache's data but not an index kept
beside it (block boundaries, a prefix hash chain, a chunk directory; BUGS.md class 9 of its
table, moving blocks between memories: "swap mapping errors"). The twin
(``ImportIndexesChunk``) records the imported chunk's start.
"""

from __future__ import annotations

import bisect

import torch
from torch import Tensor

from kvref import CacheRows, check_append, check_import, check_truncate


class ImportLeavesChunkIndexBehind:
    index_imports = False  # the bug: an imported chunk gets no entry in _starts

    def __init__(self, spec) -> None:
        self.spec = spec
        self.reset()

    def reset(self) -> None:
        self._chunks: list[tuple[Tensor, Tensor]] = []
        self._starts: list[int] = []
        self._n = 0

    @property
    def length(self) -> int:
        return self._n

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self._chunks)

    def _joined(self) -> tuple[Tensor, Tensor]:
        if not self._chunks:
            s, like = self.spec, {"dtype": self.spec.dtype, "device": self.spec.device}
            return (
                torch.zeros((s.batch, s.kv_heads, 0, s.head_dim), **like),
                torch.zeros((s.batch, s.kv_heads, 0, s.value_width), **like),
            )
        return (
            torch.cat([k for k, _ in self._chunks], dim=2),
            torch.cat([v for _, v in self._chunks], dim=2),
        )

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        new = check_append(self.spec, self._n, key, value)
        self._starts.append(self._n)
        self._chunks.append((key.clone(), value.clone()))
        self._n += new
        return self._joined()

    def truncate(self, length: int) -> None:
        check_truncate(self._n, length)
        kept = bisect.bisect_left(self._starts, length)  # chunks that begin before length
        self._chunks, self._starts = self._chunks[:kept], self._starts[:kept]
        if kept:
            k, v = self._chunks[-1]
            rows = length - self._starts[-1]
            self._chunks[-1] = (k[:, :, :rows].clone(), v[:, :, :rows].clone())
        self._n = length

    def export_rows(self) -> CacheRows:
        keys, values = self._joined()
        # torch.cat made new tensors; with one chunk it still copies, so nothing is shared.
        return CacheRows(keys.clone(), values.clone(), self._n)

    def import_rows(self, rows: CacheRows) -> None:
        check_import(self.spec, self._n, rows)
        if rows.rows != rows.length:
            raise ValueError(
                f"import_rows: {rows.rows} rows for a length of {rows.length}: this cache "
                f"keeps every row from position 0 and takes no run that starts later"
            )
        if rows.length:
            if self.index_imports:
                self._starts.append(0)
            # Bug (index_imports False): the chunk is in, its start is not.
            self._chunks.append((rows.keys.clone(), rows.values.clone()))
        self._n = rows.length


class ImportIndexesChunk(ImportLeavesChunkIndexBehind):
    """The twin: an imported chunk's start goes into the index too."""

    index_imports = True
