"""Broken tree drafts (docs/contract.md, section 9.2): each cache mutant a ``ChunkedCache``
whose ``commit_tree`` keeps the wrong rows, or the right ones in the wrong places; each model
mutant a patch of the reference model's ``forward_tree`` with one bug, run on a correct
``ChunkedCache`` (the uncached oracle, ``forward_tree_uncached``, takes none of the patched
paths).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from unittest import mock

import torch
from torch import Tensor

from kvimpl import ChunkedCache
from kvref import check_accepted, model


class _Compacts(ChunkedCache):
    """``commit_tree`` that truncates back to the committed rows and appends, per row, the
    node rows ``keys_kept(path)`` and ``values_kept(path)`` (the accepted path, correctly)."""

    def keys_kept(self, path: tuple[int, ...]) -> list[int]:
        return list(path)

    def values_kept(self, path: tuple[int, ...]) -> list[int]:
        return list(path)

    def commit_tree(self, accepted) -> None:
        tree = self._tree_waiting()
        if tree is None:
            raise ValueError("commit_tree: no draft tree is waiting")
        paths = check_accepted(accepted, tree.parents, tree.batch, same_length=True)
        self.truncate(tree.held)
        if paths[0]:
            keys = torch.stack(
                [tree.keys[row, :, self.keys_kept(p)] for row, p in enumerate(paths)]
            )
            values = torch.stack(
                [tree.values[row, :, self.values_kept(p)] for row, p in enumerate(paths)]
            )
            self.append(keys, values)
        self._draft_tree = None


class CommitKeepsTheFirstNodes(ChunkedCache):
    """``commit_tree`` keeps as many rows after the committed ones as the path has nodes, by
    truncating: the first nodes in buffer order stay, whichever were accepted.

    Stands for the rollback of linear speculative decoding (truncate to L + the accepted
    count) run on a tree buffer: right whenever the accepted path is nodes 0, 1, 2, ... (a
    chain, or the first branch), wrong for any other, the rejected siblings' rows kept.
    """

    def commit_tree(self, accepted) -> None:
        tree = self._tree_waiting()
        if tree is None:
            raise ValueError("commit_tree: no draft tree is waiting")
        paths = check_accepted(accepted, tree.parents, tree.batch, same_length=True)
        self.truncate(tree.held + len(paths[0]))
        self._draft_tree = None


class CommitWritesThePathReversed(_Compacts):
    """``commit_tree`` writes the accepted nodes' rows leaf first: the right rows, each at
    the position of its mirror in the path.

    Stands for a compaction that walks the accepted path by parent pointers, from the last
    accepted node up to the root, and writes rows in the order it visits them: every moved
    key then sits at another position than the one it was rotated for.
    """

    def keys_kept(self, path: tuple[int, ...]) -> list[int]:
        return list(reversed(path))

    def values_kept(self, path: tuple[int, ...]) -> list[int]:
        return list(reversed(path))


class CommitMovesKeysNotValues(_Compacts):
    """``commit_tree`` moves the accepted nodes' keys into place, but leaves the values of
    the first nodes in buffer order where they are.

    Stands for a KV compaction kernel that gathers the K cache along the accepted path and
    copies V from the unmoved slots (one index tensor updated, the other not): the keys are
    right, so attention looks right, and the rejected siblings' values are read.
    """

    def values_kept(self, path: tuple[int, ...]) -> list[int]:
        return list(range(len(path)))


@contextmanager
def siblings_visible_in_the_tree() -> Iterator[None]:
    """The tree mask is the causal mask over node order: each node sees every node before it
    in the draft, its ancestors and every other branch drafted before it.

    Stands for a verifier built for linear drafts (a plain causal mask over the flattened
    draft tokens) handed a tree: right for a chain in order, wrong as soon as a node has an
    earlier sibling, whose branch it then attends.
    """

    def causal_over_nodes(parents: Sequence[int], device=None) -> Tensor:
        nodes = len(parents)
        return torch.ones(nodes, nodes, dtype=torch.bool, device=device).tril()

    with mock.patch.object(model, "tree_mask", causal_over_nodes):
        yield


@contextmanager
def nodes_at_their_index() -> Iterator[None]:
    """Draft node i is placed at position L + i, its index in the draft, instead of L +
    its depth.

    Stands for tree position ids taken as arange over the flattened draft (the linear
    draft's positions), as verifiers that forget the tree's own position ids do: a node's key
    is rotated, and its query asks, as if its earlier siblings were its ancestors, and its
    key stays at that position after the commit.
    """

    def by_index(parents: Sequence[int]) -> tuple[int, ...]:
        return tuple(range(len(parents)))

    with mock.patch.object(model, "tree_depths", by_index):
        yield


@contextmanager
def nodes_blind_to_themselves() -> Iterator[None]:
    """The tree mask marks a node's ancestors but not the node itself: each node attends the
    committed rows and its ancestors only.

    Stands for a tree mask built from the parent pointers alone (each node's row the
    ancestors' marks, the diagonal forgotten): every node loses its own key and value.
    """
    original = model.tree_mask

    def without_self(parents: Sequence[int], device=None) -> Tensor:
        seen = original(parents, device)
        return seen & ~torch.eye(len(parents), dtype=torch.bool, device=device)

    with mock.patch.object(model, "tree_mask", without_self):
        yield


@contextmanager
def hidden_nodes_values_summed() -> Iterator[None]:
    """A node's hidden rows (another branch's nodes) get weight 0 in the tree's attention,
    but their values are still summed: 0 x nan is nan.

    Stands for a tree mask applied to the scores only (the -inf bias of a custom mask),
    the weighted sum then reading every slot, as a kernel that does not zero masked slots
    does: harmless for finite rows, but a rejected node's row of nan (a poisoned or never
    written slot) reaches every node of the tree.
    """
    original = model.attention

    def summing_hidden(query, keys, values, *args, visible=None, **kwargs) -> Tensor:
        mixed = original(query, keys, values, *args, visible=visible, **kwargs)
        if visible is None:
            return mixed
        group = query.shape[1] // keys.shape[1]
        hidden = values.repeat_interleave(group, dim=1)[:, :, None].masked_fill(
            visible[..., None], 0
        )
        return mixed + (0 * hidden).sum(dim=-2).to(mixed.dtype)

    with mock.patch.object(model, "attention", summing_hidden):
        yield


TREE_MUTANTS = (CommitKeepsTheFirstNodes, CommitWritesThePathReversed, CommitMovesKeysNotValues)

# Bugs of the model's side of tree drafts, run on a correct ChunkedCache.
TREE_MODEL_MUTANTS = (
    siblings_visible_in_the_tree,
    nodes_at_their_index,
    nodes_blind_to_themselves,
    hidden_nodes_values_summed,
)
