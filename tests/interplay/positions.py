"""Style: a dict from position to that position's row (every batch row's key and value at
it), rolled back lazily, with speculative tree drafts held aside until a path is committed.

``_rows[p]`` is ``(key, value)`` shaped (B, H, D) and (B, H, Dv); what ``append`` returns is
the stack of positions 0 .. length-1. A ``truncate`` only lowers the length: entries past it
are dead and are overwritten by the next writes (no dict surgery on the rollback path, which
runs on every rejected draft). Tree drafts (contract, section 9.2) sit in ``_draft`` until
``commit_tree`` writes each row's accepted path at positions ``_anchor`` onwards;
``_anchor``, where the next draft hangs, is kept by the paths that write (``append``,
``commit_tree``) and by ``reset``.

The one bug (``TreeAnchorSurvivesTruncate``): ``truncate`` does not move ``_anchor``.

- First event: a ``truncate`` (a rejected path after a commit, an edit), leaving "the
  anchor past the length".
- Second event: ``append_tree`` with no append between (a second tree drafted right after
  the rollback).
- A correct cache hangs the tree after the ``length`` tokens it holds; this one after the
  old anchor: ``append_tree`` returns the dead rows between the two as committed, and the
  commit makes them live again. An ``append`` after the truncate moves the anchor back, so
  truncate-then-decode-then-draft is right, as is a draft after any append or commit.

Stands for the speculative-decoding class where the scheduler's count of computed tokens
(``num_computed_tokens``, the draft's anchor) and the cache's length are two numbers and a
rejection path updates one of them (BUGS.md class 2 of its table, rollback: "position
counters not rolled back"). The twin (``TreeAnchorFollowsTruncate``) moves it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvref import check_accepted, check_append, check_tree, check_truncate


class TreeAnchorSurvivesTruncate:
    move_anchor = False  # the bug: truncate leaves the draft anchor where it was

    def __init__(self, spec) -> None:
        self.spec = spec
        self.reset()

    def reset(self) -> None:
        self._rows: dict[int, tuple[Tensor, Tensor]] = {}
        self._n = 0  # committed tokens
        self._anchor = 0  # where the next draft hangs
        self._draft: list[tuple[Tensor, Tensor]] | None = None  # node i's (key, value)
        self._parents: tuple[int, ...] = ()

    @property
    def length(self) -> int:
        if self._draft is None:
            return self._n
        return self._anchor + len(self._draft)

    @property
    def nbytes(self) -> int:
        held = list(self._rows.values()) + (self._draft or [])
        return sum(k.nbytes + v.nbytes for k, v in held)

    def _stack(self, count: int, extra=()) -> tuple[Tensor, Tensor]:
        rows = [self._rows[p] for p in range(count)] + list(extra)
        s, like = self.spec, {"dtype": self.spec.dtype, "device": self.spec.device}
        if not rows:
            return (
                torch.zeros((s.batch, s.kv_heads, 0, s.head_dim), **like),
                torch.zeros((s.batch, s.kv_heads, 0, s.value_width), **like),
            )
        return torch.stack([k for k, _ in rows], dim=2), torch.stack([v for _, v in rows], dim=2)

    def _waiting(self, call: str) -> None:
        if self._draft is not None:
            raise ValueError(f"{call}: a draft tree waits for commit_tree; commit it first")

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        new = check_append(self.spec, self._n, key, value)
        self._waiting("append")
        for t in range(new):
            self._rows[self._n + t] = (key[:, :, t].clone(), value[:, :, t].clone())
        self._n += new
        self._anchor = self._n
        return self._stack(self._n)

    def truncate(self, length: int) -> None:
        check_truncate(self.length, length)
        self._waiting("truncate")
        self._n = length  # the dead entries past it stay until overwritten
        if self.move_anchor:
            self._anchor = length
        # Bug (move_anchor False): the next draft still hangs after the old anchor.

    def append_tree(self, key: Tensor, value: Tensor, parents) -> tuple[Tensor, Tensor]:
        nodes = check_append(self.spec, self.length, key, value)
        parents = check_tree(parents, nodes)
        self._waiting("append_tree")
        self._draft = [(key[:, :, i].clone(), value[:, :, i].clone()) for i in range(nodes)]
        self._parents = parents
        return self._stack(self._anchor, self._draft)

    def commit_tree(self, accepted) -> None:
        if self._draft is None:
            raise ValueError("commit_tree: no draft tree to commit (append_tree first)")
        paths = check_accepted(accepted, self._parents, self.spec.batch, same_length=True)
        batch = torch.arange(self.spec.batch, device=self.spec.device)
        for depth in range(len(paths[0])):
            nodes = [path[depth] for path in paths]  # each batch row's node at this depth
            keys = torch.stack([self._draft[node][0] for node in nodes])  # (B, B, H, D)
            values = torch.stack([self._draft[node][1] for node in nodes])
            # Row b takes batch row b of its own node.
            self._rows[self._anchor + depth] = (keys[batch, batch], values[batch, batch])
        self._n = self._anchor + len(paths[0])
        self._anchor = self._n
        self._draft, self._parents = None, ()


class TreeAnchorFollowsTruncate(TreeAnchorSurvivesTruncate):
    """The twin: truncate moves the draft anchor to the new length."""

    move_anchor = True
