"""Fixed-size chunks allocated as needed: growth never copies old chunks, waste < one chunk.

The protocol's ``append`` hands back contiguous (batch, kv_heads, length, head_dim) tensors,
so each append joins the chunks with one ``torch.cat``: a copy of the whole history. The
model calls ``attend`` instead when a cache has it, and this one does: it computes attention
chunk by chunk where the chunks lie, merging them with an online softmax
(``kvimpl.blockwise``), so decoding through ``attend`` copies nothing but the new rows.
Tree drafts (contract, section 9.2) come from ``kvimpl.tree``, through ``append`` and
``truncate``: every row accepts a path of one length, and moves (section 11.2) from
``kvimpl.movable``, through ``append``.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from kvimpl.blockwise import attend_blocks
from kvimpl.movable import MovableMixin
from kvimpl.tree import TreeDraftsMixin
from kvref.checks import check_append, check_attend, check_reorder, check_truncate
from kvref.protocol import CacheSpec

DEFAULT_CHUNK_SIZE = 16


class ChunkedCache(TreeDraftsMixin, MovableMixin):
    # Its sizes, for the suite to hit its chunk boundaries on purpose (kvcheck.Sizes; a
    # plain dict, so that the cache needs nothing from the kit).
    kv_sizes: ClassVar[dict[str, int]] = {"page": DEFAULT_CHUNK_SIZE}

    def __init__(self, spec: CacheSpec, chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        self.spec = spec
        self.chunk_size = chunk_size
        self.reset()

    @property
    def length(self) -> int:
        return self._length

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.chunks)

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        self._store(key, value, check_append(self.spec, self._length, key, value))
        return self._rows_to_move()

    def attend(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        new_tokens = check_attend(self.spec, self._length, query, key, value)
        first = self._length
        self._store(key, value, new_tokens)
        return attend_blocks(
            query, self.spec, first, self._length, self.chunk_size, self.chunks.__getitem__
        )

    def truncate(self, length: int) -> None:
        check_truncate(self._length, length)
        del self.chunks[-(-length // self.chunk_size) :]  # the chunks wholly past the new end
        self._length = length

    def reorder(self, indices: Tensor) -> None:
        check_reorder(self.spec, indices)
        self.chunks = [
            (k.index_select(0, indices), v.index_select(0, indices)) for k, v in self.chunks
        ]

    def reset(self) -> None:
        self.chunks: list[tuple[Tensor, Tensor]] = []
        self._length = 0

    def _rows_to_move(self) -> tuple[Tensor, Tensor]:
        return self._joined(0), self._joined(1)

    def _joined(self, which: int) -> Tensor:
        # Only the written rows of the last chunk, so the result is contiguous.
        rows_in_last = self._length - (len(self.chunks) - 1) * self.chunk_size
        parts = [chunk[which] for chunk in self.chunks[:-1]]
        parts.append(self.chunks[-1][which][:, :, :rows_in_last])
        return torch.cat(parts, dim=2)

    def _store(self, key: Tensor, value: Tensor, new_tokens: int) -> None:
        written = 0
        while written < new_tokens:
            chunk, row = divmod(self._length + written, self.chunk_size)
            if chunk == len(self.chunks):
                self.chunks.append(self._new_chunk())
            rows = min(self.chunk_size - row, new_tokens - written)
            chunk_key, chunk_value = self.chunks[chunk]
            chunk_key[:, :, row : row + rows] = key[:, :, written : written + rows]
            chunk_value[:, :, row : row + rows] = value[:, :, written : written + rows]
            written += rows
        self._length += new_tokens

    def _new_chunk(self) -> tuple[Tensor, Tensor]:
        s = self.spec
        shape = (s.batch, s.kv_heads, self.chunk_size, s.head_dim)
        return (
            torch.zeros(shape, dtype=s.dtype, device=s.device),
            torch.zeros(shape, dtype=s.dtype, device=s.device),
        )
