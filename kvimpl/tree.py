"""Tree drafts (contract, section 9.2) for any cache, in terms of what it already offers.

``TreeDraftsMixin`` gives a cache ``append_tree`` and ``commit_tree`` built on its own
``append`` and ``truncate``; add it as a base class and nothing else::

    class ChunkedCache(TreeDraftsMixin): ...

- ``append_tree(key, value, parents)`` checks ``parents`` (``kvref.check_tree``), then
  appends the T nodes as one ``append`` (which checks the rest and refuses changing
  nothing), and keeps a copy of the node rows the cache returned, to commit from.
- ``commit_tree(accepted)`` checks ``accepted`` (``kvref.check_accepted``), truncates back
  to the L committed tokens and appends each row's accepted nodes in path order: at
  positions L, L + 1, ..., where the model rotated them (a node's key sits at L + its
  depth). Rows are moved, never rotated.

A cache with rows of their own (contract, section 8.1: ``row_lengths``, ``append_rows``, and
``truncate_rows`` for this) commits each row's path, of its own length, through
``truncate_rows`` and ``append_rows`` (laid out as its ``padding`` says); any other cache
takes paths of one length for every row and refuses others. A second ``append_tree`` before
the commit, a commit with no tree, and bad arguments are refused with ``ValueError`` before
anything changes. The tree waiting for its commit is forgotten once the cache no longer
holds its L + T rows (a ``reset``, say: any call but the commit is outside the contract).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from kvref.checks import check_accepted, check_tree
from kvref.rows import row_slots


@dataclass(frozen=True)
class _DraftTree:
    """A tree appended and not yet committed: after ``held`` tokens, its ``parents``, for a
    batch of ``batch`` rows, and copies of the node rows the cache returned (B, H_kv, T, D)."""

    held: int
    parents: tuple[int, ...]
    batch: int
    keys: Tensor
    values: Tensor


class TreeDraftsMixin:
    """``append_tree`` and ``commit_tree`` on the cache's own ``append`` and ``truncate`` (or,
    with rows of their own, ``append_rows`` and ``truncate_rows``); see the module docstring.
    Keeps one attribute, ``_draft_tree``, and needs no ``__init__``."""

    _draft_tree: _DraftTree | None = None

    def append_tree(self, key: Tensor, value: Tensor, parents) -> tuple[Tensor, Tensor]:
        if (tree := self._tree_waiting()) is not None:
            raise ValueError(
                f"append_tree: a draft tree of {len(tree.parents)} nodes after {tree.held} "
                f"tokens is waiting for commit_tree; commit it before drafting another"
            )
        if not isinstance(key, Tensor) or key.ndim != 4:
            shown = tuple(key.shape) if isinstance(key, Tensor) else type(key).__name__
            raise ValueError(
                f"append_tree: key must be a tensor of rank 4 (batch, kv_heads, T, "
                f"head_dim), got {shown}"
            )
        parents = check_tree(parents, key.shape[2])
        lengths = list(getattr(self, "row_lengths", ()))
        if len(set(lengths)) > 1:
            raise ValueError(
                f"append_tree: the rows hold different numbers of tokens {lengths}; a tree is "
                f"drafted after one length for every row (feed the rows up to it first)"
            )
        held = self.length
        keys, values = self.append(key, value)  # checks the rest, changing nothing on refusal
        nodes = len(parents)
        # The nodes as the cache holds them (the last T rows it returned), copied: its views
        # are valid only until its next call.
        self._draft_tree = _DraftTree(
            held, parents, key.shape[0], keys[:, :, -nodes:].clone(), values[:, :, -nodes:].clone()
        )
        return keys, values

    def commit_tree(self, accepted) -> None:
        tree = self._tree_waiting()
        if tree is None:
            raise ValueError("commit_tree: no draft tree is waiting; call append_tree first")
        rows = self._tree_rows_of_their_own()
        paths = check_accepted(accepted, tree.parents, tree.batch, same_length=not rows)
        counts = [len(path) for path in paths]
        width = max(counts)
        shape = (tree.batch, tree.keys.shape[1], width)
        keys = tree.keys.new_zeros((*shape, tree.keys.shape[3]))
        values = tree.values.new_zeros((*shape, tree.values.shape[3]))
        padding = getattr(self, "padding", "right") if rows else "right"
        for row, path in enumerate(paths):
            if not path:
                continue
            slots = row_slots(padding, width, len(path))
            keys[row, :, slots] = tree.keys[row, :, list(path)]
            values[row, :, slots] = tree.values[row, :, list(path)]
        if rows:
            self.truncate_rows((tree.held,) * tree.batch)
            if width:
                self.append_rows(keys, values, counts)
        else:
            self.truncate(tree.held)
            if width:
                self.append(keys, values)
        self._draft_tree = None

    def _tree_waiting(self) -> _DraftTree | None:
        """The tree appended and not committed, while the cache still holds its rows."""
        tree = self._draft_tree
        if tree is not None and self.length != tree.held + len(tree.parents):
            self._draft_tree = tree = None  # reset or changed since: the tree is gone
        return tree

    def _tree_rows_of_their_own(self) -> bool:
        """Whether each row can take a path of its own length (section 8.1)."""
        return hasattr(self, "row_lengths") and all(
            callable(getattr(self, name, None)) for name in ("append_rows", "truncate_rows")
        )
