"""Style: draft trees held aside. Each batch row's rows are one (H_kv, L_b, D) tensor of its
own (no batch tensor is kept); a draft tree's nodes (contract, section 9.2) are never written
into them: they wait beside the rows, and the commit appends each row's accepted nodes,
gathered in path order, to that row alone.

Written from ``docs/contract.md`` (sections 1-4, 8.1 and 9.2) only, as a second
implementation of tree drafts to hold the kit's checks against (``kvimpl.tree`` appends the
nodes into the cache and truncates them away; this one never stores a rejected node).

- ``AsideTreeCache``: every row one length; ``append``, ``truncate``, ``reorder``, ``reset``,
  ``append_tree`` and ``commit_tree``, whose accepted paths must then be of one length.
- ``AsideTreeRowsCache``: rows of their own too (``row_lengths``, ``append_rows`` with right
  padding, ``truncate_rows``), each row committing a path of its own length.

Validation is written here, not borrowed from ``kvref`` (a parent must come before its
node; an accepted path starts at a root and goes down child by child). Every bad argument
raises ``ValueError`` (``TypeError`` for one of the wrong type) before anything changes, a
call between ``append_tree`` and ``commit_tree`` included. There is no length limit: a row
grows past ``max_length`` (rule 4 lets a cache grow). Every return is freshly built.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


class AsideTreeCache:
    def __init__(self, spec) -> None:
        self.spec = spec
        self._device = torch.device(spec.device)
        self.reset()

    # --- state ------------------------------------------------------------------------
    def reset(self) -> None:
        s = self.spec
        self._keys = [self._empty(s.head_dim) for _ in range(s.batch)]
        self._values = [self._empty(s.value_width) for _ in range(s.batch)]
        self._tree: tuple[tuple[int, ...], Tensor, Tensor] | None = None  # parents, nodes

    def _empty(self, width: int) -> Tensor:
        s = self.spec
        return torch.empty(s.kv_heads, 0, width, dtype=s.dtype, device=self._device)

    @property
    def length(self) -> int:
        held = max(rows.shape[1] for rows in self._keys)
        return held + (0 if self._tree is None else len(self._tree[0]))

    @property
    def nbytes(self) -> int:
        held = sum(k.nbytes + v.nbytes for k, v in zip(self._keys, self._values, strict=True))
        return held + (0 if self._tree is None else self._tree[1].nbytes + self._tree[2].nbytes)

    def _lengths(self) -> list[int]:
        return [rows.shape[1] for rows in self._keys]

    # --- the protocol -------------------------------------------------------------------
    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        self._no_tree("append")
        self._one_length("append")
        self._check_rows(key, value)
        self._store(key, value, [key.shape[2]] * len(self._keys))
        return self._stacked()

    def truncate(self, length: int) -> None:
        self._no_tree("truncate")
        if isinstance(length, bool) or not isinstance(length, int):
            raise TypeError(f"truncate wants an int, got {type(length).__name__}")
        if not 0 <= length <= self.length:
            raise ValueError(f"truncate to {length}: must be in [0, {self.length}]")
        self._cut([min(length, n) for n in self._lengths()])

    def reorder(self, indices: Tensor) -> None:
        self._no_tree("reorder")
        batch = len(self._keys)
        if not isinstance(indices, Tensor) or indices.dtype != torch.long:
            raise ValueError("reorder wants an int64 tensor of indices")
        if indices.shape != (batch,) or indices.device.type != self._device.type:
            raise ValueError(f"reorder wants shape ({batch},) on {self._device}")
        order = indices.tolist()
        if any(not 0 <= i < batch for i in order):
            raise ValueError(f"reorder index out of range [0, {batch}): {order}")
        self._keys = [self._keys[i] for i in order]
        self._values = [self._values[i] for i in order]

    # --- tree drafts (section 9.2) -----------------------------------------------------
    def append_tree(self, key: Tensor, value: Tensor, parents) -> tuple[Tensor, Tensor]:
        if self._tree is not None:
            raise ValueError("append_tree: the last tree is not committed yet")
        self._one_length("append_tree")
        self._check_rows(key, value)
        parents = self._checked_parents(parents, key.shape[2])
        self._tree = (parents, key.detach().clone(), value.detach().clone())
        keys, values = self._stacked()
        return torch.cat((keys, key), dim=2), torch.cat((values, value), dim=2)

    def commit_tree(self, accepted) -> None:
        if self._tree is None:
            raise ValueError("commit_tree: no tree to commit")
        parents, keys, values = self._tree
        paths = self._checked_paths(accepted, parents)
        if not self._ragged_commits() and len({len(path) for path in paths}) > 1:
            raise ValueError(
                f"commit_tree: paths of lengths {[len(p) for p in paths]}; rows hold one length"
            )
        for row, path in enumerate(paths):
            self._keys[row] = torch.cat((self._keys[row], keys[row][:, list(path)]), dim=1)
            self._values[row] = torch.cat((self._values[row], values[row][:, list(path)]), dim=1)
        self._tree = None

    def _ragged_commits(self) -> bool:
        return False

    def _checked_parents(self, parents, nodes: int) -> tuple[int, ...]:
        if isinstance(parents, Tensor):
            parents = parents.tolist()
        if not isinstance(parents, Sequence) or isinstance(parents, str):
            raise TypeError(f"parents must be a sequence of ints, got {type(parents).__name__}")
        if len(parents) != nodes:
            raise ValueError(f"{len(parents)} parents for {nodes} draft nodes")
        for node, parent in enumerate(parents):
            if isinstance(parent, bool) or not isinstance(parent, int):
                raise ValueError(f"parent of node {node} is {parent!r}, not an int")
            if not -1 <= parent < node:
                raise ValueError(f"parent of node {node} is {parent}: must be in [-1, {node})")
        return tuple(parents)

    def _checked_paths(self, accepted, parents: tuple[int, ...]) -> list[tuple[int, ...]]:
        if not isinstance(accepted, Sequence) or isinstance(accepted, str):
            raise TypeError(f"accepted must be a sequence of paths, got {type(accepted).__name__}")
        if len(accepted) != len(self._keys):
            raise ValueError(f"{len(accepted)} accepted paths for {len(self._keys)} rows")
        paths = []
        for row, path in enumerate(accepted):
            if not isinstance(path, Sequence) or isinstance(path, str):
                raise TypeError(f"row {row}'s accepted path is a {type(path).__name__}")
            above = -1
            for node in path:
                if isinstance(node, bool) or not isinstance(node, int):
                    raise ValueError(f"row {row}: {node!r} is not a node index")
                if not 0 <= node < len(parents) or parents[node] != above:
                    raise ValueError(f"row {row}: {list(path)} does not go down the tree")
                above = node
            paths.append(tuple(path))
        return paths

    # --- helpers --------------------------------------------------------------------------
    def _no_tree(self, call: str) -> None:
        if self._tree is not None:
            raise ValueError(f"{call} while a draft tree waits for commit_tree")

    def _one_length(self, call: str) -> None:
        if len(set(self._lengths())) > 1:
            raise ValueError(f"{call}: rows hold {self._lengths()} tokens; use append_rows")

    def _check_rows(self, key: Tensor, value: Tensor) -> None:
        s = self.spec
        for name, rows in (("key", key), ("value", value)):
            if not isinstance(rows, Tensor):
                raise TypeError(f"{name} is a {type(rows).__name__}, not a tensor")
            if rows.ndim != 4:
                raise ValueError(f"{name} has {rows.ndim} dims, want 4")
            if rows.dtype != s.dtype:
                raise ValueError(f"{name} dtype {rows.dtype}, want {s.dtype}")
            if rows.device.type != self._device.type:
                raise ValueError(f"{name} device {rows.device}, want {self._device}")
        want_key = (len(self._keys), s.kv_heads, key.shape[2], s.head_dim)
        want_value = (*want_key[:3], s.value_width)
        if tuple(key.shape) != want_key or tuple(value.shape) != want_value:
            raise ValueError(
                f"key {tuple(key.shape)} and value {tuple(value.shape)}: want {want_key} and "
                f"{want_value}"
            )
        if key.shape[2] == 0:
            raise ValueError("zero new tokens")

    def _store(self, key: Tensor, value: Tensor, counts: Sequence[int]) -> None:
        for row, count in enumerate(counts):
            self._keys[row] = torch.cat((self._keys[row], key[row, :, :count]), dim=1)
            self._values[row] = torch.cat((self._values[row], value[row, :, :count]), dim=1)

    def _cut(self, lengths: Sequence[int]) -> None:
        self._keys = [rows[:, :n].clone() for rows, n in zip(self._keys, lengths, strict=True)]
        self._values = [rows[:, :n].clone() for rows, n in zip(self._values, lengths, strict=True)]

    def _stacked(self) -> tuple[Tensor, Tensor]:
        return torch.stack(self._keys), torch.stack(self._values)


class AsideTreeRowsCache(AsideTreeCache):
    """Rows of their own (section 8.1): right padding, each row's path of its own length."""

    padding = "right"

    @property
    def row_lengths(self) -> tuple[int, ...]:
        return tuple(self._lengths())

    def _ragged_commits(self) -> bool:
        return True

    def append_rows(self, key: Tensor, value: Tensor, counts) -> tuple[Tensor, Tensor, Tensor]:
        self._no_tree("append_rows")
        self._check_rows(key, value)
        counts = self._checked_counts(counts, key.shape[2])
        self._store(key, value, counts)
        return self._padded()

    def truncate_rows(self, lengths) -> None:
        self._no_tree("truncate_rows")
        held = self._lengths()
        if not isinstance(lengths, Sequence) or len(lengths) != len(held):
            raise ValueError(f"truncate_rows wants {len(held)} lengths, got {lengths!r}")
        for row, (n, most) in enumerate(zip(lengths, held, strict=True)):
            if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= most:
                raise ValueError(f"truncate_rows: row {row} to {n!r}, must be in [0, {most}]")
        self._cut(list(lengths))

    def _checked_counts(self, counts, width: int) -> list[int]:
        if not isinstance(counts, Sequence) or len(counts) != len(self._keys):
            raise ValueError(f"append_rows wants {len(self._keys)} counts, got {counts!r}")
        for row, count in enumerate(counts):
            if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= width:
                raise ValueError(f"append_rows: row {row}'s count {count!r} not in [0, {width}]")
        return list(counts)

    def _padded(self) -> tuple[Tensor, Tensor, Tensor]:
        """Every row's rows at the left of one width, zeros after; ``valid`` says which."""
        s, width = self.spec, max(self._lengths())
        batch = len(self._keys)
        keys = torch.zeros(batch, s.kv_heads, width, s.head_dim, dtype=s.dtype, device=self._device)
        values = keys.new_zeros(batch, s.kv_heads, width, s.value_width)
        valid = torch.zeros(batch, width, dtype=torch.bool, device=self._device)
        for row, n in enumerate(self._lengths()):
            keys[row, :, :n], values[row, :, :n], valid[row, :n] = (
                self._keys[row],
                self._values[row],
                True,
            )
        return keys, values, valid
