"""Tree drafts (contract, section 9.2): speculative decoding that verifies a tree of draft
tokens in one call (``DraftTree``, the model's ``forward_tree``), then keeps one path per
batch row (``CommitTree``, every layer's ``commit_tree``).

A draft's check: every node no poisoned node reaches gives the uncached model's logits on
the committed tokens and that node's path (the oracle: no books to keep, the uncached pass
over the tree computes it), and every layer's ``append_tree`` returned the committed rows and
the nodes as handed to it (``kvcheck.session.tree_tap``). The poisoned nodes are the plan's
way to show that a node attends only to its ancestors: a node that sees a poisoned sibling
is far from any tolerance. A commit's books: the history is the committed tokens and each
row's path, and each layer's recorder holds the rows given before the tree and the accepted
nodes as handed, so every later call (a feed, a truncate, a reorder, a fork, a reset, the
next tree) is checked against them; rows that accept paths of different lengths go on by
row. What holds right after it: every layer's length and, by row, its ``row_lengths``. No
cache may refuse a commit of a path from a root down per row.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from kvcheck import asserts as kvassert
from kvcheck import failures
from kvcheck.session.compare import assert_logits
from kvcheck.session.events.base import Event, Session
from kvcheck.session.request import Request
from kvcheck.session.tree_tap import TreeTap, committed_below, committed_rows
from kvref.tree import tree_depths, tree_paths

Paths = tuple[tuple[int, ...], ...]  # per batch row, node indices


def histories(request: Request) -> Tensor:
    """The committed tokens of every row, (B, L): a tree starts after one length."""
    if request.rows is None:
        return request.history
    return torch.stack(request.rows)


def node_said(node: int, parents, row: int, poisoned, accepted) -> str:
    path = tree_paths(parents)[node]
    return (
        f"row {row}, node {node} (path {list(path)}, depth {len(path) - 1}; the row accepts "
        f"{list(accepted)}, its poisoned nodes {list(poisoned)})"
    )


@dataclass
class DraftTree(Event):
    """The draft tree ``parents`` of tokens ``new`` (B, T) verified for ``request`` in one
    call, the nodes ``poisoned[b]`` of row b poisoned (``poison``) on the way into every
    layer; ``accepted`` (the paths the plan will commit) only for the messages. The result is
    the node rows each layer was handed, (keys, values) (B, H_kv, T, D), poisoned where the
    plan says: what ``CommitTree`` takes."""

    request: Request
    parents: tuple[int, ...]
    new: Tensor
    poisoned: Paths
    poison: float
    accepted: Paths
    label: str

    def before(self, engine: Session) -> None:
        request, parents = self.request, self.parents
        self.history = histories(request)
        self.first = request.firsts[0] if request.firsts else 0
        self.held, nodes = self.history.shape[1], len(parents)
        self.depths = tree_depths(parents)
        first, held = self.first, self.held
        self.where = engine.where(
            f"{request.name}, its step #{request.steps}: {self.label}, a draft tree of {nodes} "
            f"node{'s' * (nodes > 1)} (parents {list(parents)}) after {held} tokens, at "
            f"absolute positions {first + held}..{first + held + max(self.depths)}"
        )

    def apply(self, engine: Session) -> None:
        request = self.request
        self.taps = [
            TreeTap(recorder, self.poisoned, self.poison, f"{request.name}'s layer {layer}")
            for layer, recorder in enumerate(request.caches)
        ]
        for tap in self.taps:
            tap.where = self.where
        try:
            self.logits = engine.model.forward_tree(self.new, self.parents, self.taps)
        except Exception as error:
            error.add_note(f"  at {self.where}")
            raise

    def update(self, engine: Session) -> None:
        self.request.steps += 1

    def verify(self, engine: Session) -> None:
        history, new, parents, first = self.history, self.new, self.parents, self.first
        logits, nodes = self.logits, len(parents)
        expected = engine.model.forward_tree_uncached(history, new, parents, start_position=first)
        truth = functools.cache(
            lambda: engine.truth.forward_tree_uncached(history, new, parents, start_position=first)
        )
        paths = tree_paths(parents)
        compared = [  # (row, node): those no poisoned row reaches (the others' logits say nothing)
            (row, node)
            for row in range(new.shape[0])
            for node in range(nodes)
            if not set(self.poisoned[row]).intersection(paths[node])
        ]
        if compared:  # all at once first, each node a position; one by one where one diverges
            index = tuple(
                torch.tensor(axis, device=logits.device) for axis in zip(*compared, strict=True)
            )
            reference = truth()[index][None] if kvassert.needs_reference(expected.dtype) else None
            if not kvassert.diverging_positions(
                logits[index][None], expected[index][None], 1, reference
            ):
                compared = []
        for row, node in compared:
            position = first + self.held + self.depths[node]
            at = slice(node, node + 1)
            said = node_said(node, parents, row, self.poisoned[row], self.accepted[row])
            try:
                assert_logits(
                    logits[row : row + 1, at],
                    expected[row : row + 1, at],
                    lambda row=row, at=at: truth()[row : row + 1, at],
                    where=f"{said}, at absolute position {position}\n  at {self.where}",
                    start=position,
                    path="append",  # append_tree returns rows: the model attends over them
                    what="the draft node's logits and the uncached model's on the committed "
                    "tokens and its path",
                    lossy=kvassert.coarsest(self.request.caches),  # rows in codes: their budget
                )
            except failures.WrongResults as error:
                error.add_note(
                    "  diagnosis: every layer's append_tree returned the committed rows and the "
                    "nodes as given, so the model saw other rows than its ancestors' (mask, "
                    "positions)"
                )
                raise

    def result(self) -> list[tuple[Tensor, Tensor]]:
        return [tap.nodes for tap in self.taps]


@dataclass
class CommitTree(Event):
    """``commit_tree(accepted)`` on every layer of ``request``, after the draft whose node
    rows each layer was ``handed`` (``DraftTree``'s result) of tokens ``new``."""

    request: Request
    handed: list[tuple[Tensor, Tensor]]
    new: Tensor
    accepted: Paths
    label: str

    def before(self, engine: Session) -> None:
        self.said = [list(path) for path in self.accepted]
        self.what = f"{self.label}, commit_tree({self.said})"
        self.where = engine.where(f"{self.request.name}: {self.what}")

    def apply(self, engine: Session) -> Exception | None:
        for layer, recorder in enumerate(self.request.caches):
            recorder.views = recorder.returned = recorder.rows_returned = None
            error = kvassert.raised_by(
                lambda cache=recorder.cache: cache.commit_tree(self.accepted)
            )
            if error is not None:  # the layers after it are not called
                self.layer = layer
                return error
        return None

    def refused(self, engine: Session, error: Exception) -> None:
        raise failures.RefusesValidInput(
            f"{self.request.name}'s layer {self.layer}: commit_tree({self.said}), a path from "
            f"a root down per row, refused with {type(error).__name__}: {error}\n"
            f"  at {self.where}"
        ) from error

    def update(self, engine: Session) -> None:
        request, accepted, new = self.request, self.accepted, self.new
        by_row = request.rows is not None or len({len(path) for path in accepted}) > 1
        for recorder, nodes in zip(request.caches, self.handed, strict=True):
            committed = committed_rows(recorder, nodes)
            kept = [  # per row, (keys, values) (H_kv, rows, D): what it holds now
                tuple(
                    torch.cat((held[row], rows[row][:, list(path)]), dim=1)
                    for held, rows in zip(committed, nodes, strict=True)
                )
                for row, path in enumerate(accepted)
            ]
            held, count = committed[0].shape[2], nodes[0].shape[2]
            below = [
                committed_below(recorder, held, count, rows[0].shape[1], row)
                for row, rows in enumerate(kept)
            ]
            if by_row:
                recorder.given, recorder.rows_given = None, kept  # fed by row from now on
                recorder.rows_below = below
            else:
                recorder.given = tuple(
                    torch.stack([row[which] for row in kept]) for which in (0, 1)
                )
                recorder.quantized_below = below[0]
        paths = [new[row, list(path)] for row, path in enumerate(accepted)]
        if by_row:
            request.rows = [torch.cat(both) for both in zip(histories(request), paths, strict=True)]
        else:
            request.history = torch.cat((request.history, torch.stack(paths)), dim=1)
        request.steps += 1

    def verify(self, engine: Session) -> None:
        request, what, where = self.request, self.what, self.where
        for layer, recorder in enumerate(request.caches):
            who = f"{request.name}'s layer {layer}"
            kvassert.assert_length(recorder, request.held, who=who, where=where)
            if request.rows is not None:
                want = tuple(len(row) for row in request.rows)
                if tuple(recorder.cache.row_lengths) != want:
                    raise failures.DataLoss(
                        f"{who}: row_lengths {tuple(recorder.cache.row_lengths)} after {what}; "
                        f"the rows hold {want}\n  at {where}"
                    )
