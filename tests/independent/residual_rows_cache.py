"""Style 11: the left-padded dense batch cache (``left_padded_batch_cache.py``) with each
batch row's tokens coded in place once they leave that row's own residual of the last
``RECENT`` (contract, section 10.1, rows of their own).

Written from the contract, in another style than the built-in coded caches: nothing is held
in codes; a token leaving its row's residual is coded (8 bits, min/max over the head, as
``kvimpl.quantized`` codes a row) and decoded back into the same slot at once, so the dense
tensors always hold the rows as the cache reads them. Each row counts the tokens it has
coded (``_coded``): a token is coded exactly once, a rollback keeps the count (its
precision does not come back), and a selection or a join carries each row's count with it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from kvimpl.quantized import dequantize, quantize
from kvref.quantized import Quantized
from tests.independent.left_padded_batch_cache import LeftPaddedBatchCache

RECENT = 3


class ResidualRowsCache(LeftPaddedBatchCache):
    kv_storage = Quantized(bits=8, recent=RECENT)

    def _set_empty(self, batch: int) -> None:
        super()._set_empty(batch)
        self._coded = [0] * batch

    def _store(self, key: Tensor, value: Tensor, counts: tuple[int, ...]) -> None:
        super()._store(key, value, counts)
        self._code_left_residuals()

    def _residual_start(self, row: int) -> int:
        """The first of row ``row``'s tokens still in its residual: its own length's."""
        return max(0, self._lengths[row] - RECENT)

    def _code_left_residuals(self) -> None:
        """Code, in place, each row's tokens that left its residual since it last coded."""
        w = self._width
        for row, done in enumerate(self._coded):
            upto = max(done, self._residual_start(row))
            if upto == done:
                continue
            offset = w - self._lengths[row]  # the row's left padding
            slots = slice(offset + done, offset + upto)
            for held in (self._key, self._value):
                rows = held[row, :, slots]
                coded = quantize(rows, torch.promote_types(rows.dtype, torch.float32))
                held[row, :, slots] = dequantize(*coded, rows.dtype)
            self._coded[row] = upto

    def truncate_rows(self, lengths: Sequence[int]) -> None:
        super().truncate_rows(lengths)
        self._coded = [min(done, n) for done, n in zip(self._coded, self._lengths, strict=True)]

    def select_rows(self, indices: Tensor) -> None:
        super().select_rows(indices)
        self._coded = [self._coded[row] for row in indices.tolist()]

    def join(self, other: LeftPaddedBatchCache) -> None:
        coded = list(getattr(other, "_coded", [0] * len(other._lengths)))
        super().join(other)
        self._coded = self._coded + coded
