"""Rows of their own (contract, section 8.1): how one call of ``forward_rows`` lays out a
batch whose rows bring new tokens of their own count, after lengths of their own. Where a
row's tokens sit among the slots (``row_slots``: the first, or with left padding the last),
the token ids so laid out (``rows_laid_out``), each slot's position (``row_positions``) and
the layout the model's layers are handed (``RowBatch``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


def row_slots(padding: str, width: int, count: int) -> slice:
    """Where a row's ``count`` new tokens sit among the ``width`` slots of an
    ``append_rows`` call: the first ones (``padding`` "right") or the last ("left")."""
    return slice(width - count, width) if padding == "left" else slice(0, count)


def rows_laid_out(rows: Sequence[Tensor], padding: str, device=None) -> tuple[Tensor, list[int]]:
    """Token ids for ``forward_rows``: row b's new tokens ``rows[b]`` (none allowed) in the
    slots ``padding`` says, pads token 0; and the count per row."""
    counts = [len(tokens) for tokens in rows]
    width = max(1, *counts)
    laid = torch.zeros(len(rows), width, dtype=torch.long, device=device)
    for row, tokens in enumerate(rows):
        laid[row, row_slots(padding, width, counts[row])] = tokens
    return laid, counts


def row_positions(starts: Tensor, real: Tensor) -> Tensor:
    """(B, T) positions of a call of ``forward_rows``: a real slot's is its row's next one
    (``starts``, (B,)) plus its index among the row's new tokens, wherever padding puts them;
    a pad's is any (its keys are poisoned, its logits nan)."""
    return (starts[:, None] + real.cumsum(dim=1) - 1).clamp(min=0)


@dataclass(frozen=True)
class RowBatch:
    """How one call of ``ReferenceTransformer.forward_rows`` lays its rows out (contract,
    section 8.1): row b brings ``counts[b]`` new tokens, in the slots ``real`` marks, after
    the ``lengths[b]`` its caches hold from position ``firsts[b]``; pad slots carry ``pad``."""

    counts: tuple[int, ...]
    real: Tensor  # (B, T) booleans: the slots that hold a row's new tokens
    lengths: tuple[int, ...]
    firsts: tuple[int, ...]
    pad: float
