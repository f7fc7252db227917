"""What a cache should hold after a context shift (contract, section 8.4), where no uncached
pass holds it: the rows with a span gone and the keys after it rotated back
(``shifted_rows``), and a trusted cache that starts out holding given rows (``HeldRows``),
through which the reference model computes the logits a shifted cache must give.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvref.rope import rerotate


def shifted_rows(
    keys: Tensor, values: Tensor, start: int, count: int, base: float, stored: str = "rotated"
) -> tuple[Tensor, Tensor]:
    """What a cache holding ``keys`` and ``values`` (B, H_kv, rows, D) should hold after
    ``shift(start, count)``: the span gone, the keys after it rotated back by ``count``
    positions (``rerotate``; kept as they are where they are ``stored`` "unrotated"), the
    values moved as they are."""
    after = slice(start + count, None)
    moved = keys[:, :, after]
    if stored == "rotated":
        moved = rerotate(moved, -count, base)
    return (
        torch.cat((keys[:, :, :start], moved), dim=2),
        torch.cat((values[:, :, :start], values[:, :, after]), dim=2),
    )


class HeldRows:
    """A trusted cache that starts out holding given rows, every layer its own: the oracle
    after a context shift (contract, section 8.4), where what a cache should hold is no
    uncached pass's. It keeps every row (the model's mask applies a window)."""

    def __init__(
        self, keys: Tensor, values: Tensor, first_position: int = 0, keys_stored="rotated"
    ) -> None:
        self.keys, self.values, self.first_position = keys, values, first_position
        self.keys_stored = keys_stored  # as the cache under test keeps them

    @property
    def length(self) -> int:
        return self.keys.shape[2]

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        self.keys = torch.cat((self.keys, key), dim=2)
        self.values = torch.cat((self.values, value), dim=2)
        return self.keys, self.values

    def reset(self) -> None:
        self.keys, self.values = self.keys[:, :, :0], self.values[:, :, :0]
