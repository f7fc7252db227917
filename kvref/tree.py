"""Draft trees (contract, section 9.2): the shape of a speculative draft verified as a tree
in one call of ``forward_tree``. Each node's depth (its position after the committed
tokens), its path from its root, the mask of the nodes it sees (its ancestors and itself)
and the layout the model's layers are handed (``TreeBatch``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


def tree_depths(parents: Sequence[int]) -> tuple[int, ...]:
    """Each draft node's depth: 0 for a root, its parent's plus 1 otherwise."""
    depths: list[int] = []
    for parent in parents:
        depths.append(0 if parent < 0 else depths[parent] + 1)
    return tuple(depths)


def tree_paths(parents: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """Each draft node's path (contract, section 9.2): its root, ..., its parent, itself."""
    paths: list[tuple[int, ...]] = []
    for node, parent in enumerate(parents):
        paths.append((*(paths[parent] if parent >= 0 else ()), node))
    return tuple(paths)


def tree_mask(parents: Sequence[int], device=None) -> Tensor:
    """(T, T) booleans: ``[i, j]`` where node j is node i or one of its ancestors, the only
    draft nodes node i sees (section 9.2)."""
    nodes = len(parents)
    seen = torch.zeros(nodes, nodes, dtype=torch.bool, device=device)
    for node, path in enumerate(tree_paths(parents)):
        seen[node, list(path)] = True
    return seen


@dataclass(frozen=True)
class TreeBatch:
    """How one call of ``ReferenceTransformer.forward_tree`` lays its draft nodes out
    (contract, section 9.2): node i's parent is ``parents[i]`` (-1: the last committed
    token), after the ``held`` tokens the caches hold, and it sees the nodes ``seen[i]``
    marks (``tree_mask``)."""

    parents: tuple[int, ...]
    held: int
    seen: Tensor  # (T, T) booleans
