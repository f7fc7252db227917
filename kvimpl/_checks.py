"""Validation shared by the built-in caches' optional capabilities (truncate, reorder).

Each check only reads, so a cache that calls it before changing anything is left untouched
when it refuses.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvref.protocol import CacheSpec


def check_truncate(length_now: int, length: object) -> None:
    """Refuse ``truncate(length)`` on a cache holding ``length_now`` tokens unless
    0 <= length <= length_now and length is an int (a bool is not)."""
    if isinstance(length, bool) or not isinstance(length, int):
        raise ValueError(f"truncate: length must be an int, got {type(length).__name__} {length!r}")
    if not 0 <= length <= length_now:
        raise ValueError(
            f"truncate: length must be between 0 and {length_now} (the tokens held), got {length}"
        )


def check_reorder(spec: CacheSpec, indices: object) -> None:
    """Refuse ``reorder(indices)`` unless ``indices`` is an int64 tensor shaped (batch,) on
    the cache's device with values in [0, batch) (repeats are fine)."""
    if not isinstance(indices, Tensor):
        raise TypeError(f"reorder: indices must be a torch.Tensor, got {type(indices).__name__}")
    if indices.dtype != torch.int64:
        raise ValueError(f"reorder: indices must be int64, got {indices.dtype}")
    if indices.shape != (spec.batch,):
        raise ValueError(
            f"reorder: indices must have shape (batch,) = ({spec.batch},), "
            f"got {tuple(indices.shape)}"
        )
    wanted = torch.device(spec.device)
    if indices.device.type != wanted.type or wanted.index not in (None, indices.device.index):
        raise ValueError(
            f"reorder: indices must be on the cache's device {spec.device}, got {indices.device}"
        )
    low, high = int(indices.min()), int(indices.max())
    if low < 0 or high >= spec.batch:
        raise ValueError(
            f"reorder: indices must be in [0, {spec.batch}) (batch rows), "
            f"got values from {low} to {high}"
        )
