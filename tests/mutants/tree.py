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
from tests.independent.aside_tree_cache import AsideTreeCache, AsideTreeRowsCache


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


# --- one-bug variants of an independent cache (tests/independent/aside_tree_cache.py) ------
class _CutsEveryPathToTheShortest:
    """The one bug of the two mutants below, on a cache with rows of their own and on one
    without: each row's accepted path cut to the batch's shortest, then committed."""

    def commit_tree(self, accepted) -> None:
        paths = isinstance(accepted, (list, tuple)) and accepted
        if self._tree is not None and paths and all(isinstance(p, (list, tuple)) for p in paths):
            shortest = min(len(path) for path in accepted)
            accepted = [path[:shortest] for path in accepted]
        super().commit_tree(accepted)


class CommitCutsRowsToTheShortest(_CutsEveryPathToTheShortest, AsideTreeRowsCache):
    """``commit_tree`` on rows of their own keeps, in every row, only as many nodes of its
    path as the shortest path accepted in the batch.

    Stands for a verifier that keeps one accepted count for the batch (the minimum, as
    batched speculative decoding without per-row lengths must): every row longer than the
    shortest loses tokens it accepted, and decodes on as if it had never drafted them.
    """


class CutsRaggedPathsSilently(_CutsEveryPathToTheShortest, AsideTreeCache):
    """``commit_tree`` on a cache without rows of their own takes paths of different
    lengths by cutting each to the shortest, instead of refusing them.

    Stands for a dense cache that "handles" per-row acceptance by truncating the batch to the
    fewest accepted: the caller thinks each row kept its path, the cache holds less, and the
    rows' histories part from their caches without an error.
    """


class SecondTreeReplacesTheFirst(AsideTreeCache):
    """A second ``append_tree`` before the commit is taken: the waiting tree is dropped and
    the new one waits in its place.

    Stands for a draft buffer that is simply overwritten by the next draft step (a scheduler
    that re-drafts after a preemption without committing): the first tree's nodes are lost
    and a commit meant for it keeps the second tree's.
    """

    def append_tree(self, key: Tensor, value: Tensor, parents):
        self._tree = None
        return super().append_tree(key, value, parents)


class SecondTreeJoinsTheFirst(AsideTreeCache):
    """A second ``append_tree`` before the commit is taken as more nodes of the waiting tree
    (its roots children of the last committed token).

    Stands for a draft buffer that appends every draft step's nodes to the pending tree
    (a tree grown over several calls): a caller who meant a new tree gets a merged one, whose
    node indices are not the ones it commits.
    """

    def append_tree(self, key: Tensor, value: Tensor, parents):
        if self._tree is None:
            return super().append_tree(key, value, parents)
        before, keys, values = self._tree
        shifted = tuple(p if p < 0 else p + len(before) for p in parents)
        self._tree = None
        merged = (torch.cat((keys, key), dim=2), torch.cat((values, value), dim=2))
        return super().append_tree(*merged, (*before, *shifted))


class NegativeNodeReadFromTheEnd(AsideTreeCache):
    """``commit_tree`` takes a negative node index as Python does, from the end of the tree:
    node -1 is the last node.

    Stands for path validation that checks ``node < T`` but not ``node >= 0`` before indexing
    (``tensor[:, path]`` takes -1 as the last slot): a caller's -1 ("the last committed token",
    as the parents say) commits the last draft node instead of being refused.
    """

    def _checked_paths(self, accepted, parents):
        if isinstance(accepted, (list, tuple)):
            accepted = [
                [n % len(parents) if isinstance(n, int) and n < 0 else n for n in path]
                if isinstance(path, (list, tuple))
                else path
                for path in accepted
            ]
        return super()._checked_paths(accepted, parents)


class ReorderLeavesTheLastCommitBehind(AsideTreeCache):
    """A ``reorder`` right after ``commit_tree`` moves each row's rows but the ones the
    commit just kept, which stay with the row index they were committed at.

    Stands for a persistent batch whose row swap (vLLM's ``InputBatch.swap_states``) forgets
    the per-request array of accepted draft tokens: a reordered row carries its neighbour's
    accepted tokens until the next step rebuilds them.
    """

    _kept_last = 0  # rows the last commit appended, until the next call

    def commit_tree(self, accepted) -> None:
        super().commit_tree(accepted)
        self._kept_last = len(accepted[0]) if accepted else 0

    def reorder(self, indices: Tensor) -> None:
        kept, self._kept_last = self._kept_last, 0
        tails = [(k[:, k.shape[1] - kept :], v[:, v.shape[1] - kept :]) for k, v in self._rows()]
        super().reorder(indices)
        if not kept:
            return
        for row, (keys, values) in enumerate(tails):
            self._keys[row] = torch.cat((self._keys[row][:, :-kept], keys), dim=1)
            self._values[row] = torch.cat((self._values[row][:, :-kept], values), dim=1)

    def _rows(self):
        return list(zip(self._keys, self._values, strict=True))

    def append(self, key: Tensor, value: Tensor):
        self._kept_last = 0
        return super().append(key, value)

    def truncate(self, length: int) -> None:
        self._kept_last = 0
        super().truncate(length)

    def reset(self) -> None:
        self._kept_last = 0
        super().reset()


# The bugs above, each in an independent cache of another style than kvimpl.tree's.
ASIDE_TREE_MUTANTS = (
    CommitCutsRowsToTheShortest,
    CutsRaggedPathsSilently,
    SecondTreeReplacesTheFirst,
    SecondTreeJoinsTheFirst,
    NegativeNodeReadFromTheEnd,
    ReorderLeavesTheLastCommitBehind,
)


TREE_MUTANTS = (
    CommitKeepsTheFirstNodes,
    CommitWritesThePathReversed,
    CommitMovesKeysNotValues,
    *ASIDE_TREE_MUTANTS,
)

# Bugs of the model's side of tree drafts, run on a correct ChunkedCache.
TREE_MODEL_MUTANTS = (
    siblings_visible_in_the_tree,
    nodes_at_their_index,
    nodes_blind_to_themselves,
    hidden_nodes_values_summed,
)
