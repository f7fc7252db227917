"""Broken cross-layer sharing through rows of their own and trees (docs/contract.md, section
10.3): each model mutant a patch of the reference model's reader (``SharedRows``,
``SharedReader``) with one bug, run on a correct cache (the uncached oracle has no cache to
read an offset or a tree from, so it takes none of the patched paths); the cache mutant a
tree cache whose returned rows a later layer's call overwrites.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import ClassVar
from unittest import mock

import torch
from torch import Tensor

from kvimpl import ChunkedCache
from kvref import shared, tree


@contextmanager
def reader_at_each_rows_length_after_the_append() -> Iterator[None]:
    """A reader through ``append_rows`` puts row b's queries at its source's
    ``row_lengths[b]`` after this step's append, not before it: each row sits as many
    positions late as it brought tokens.

    Stands for mlx-lm 1702's class (a shared layer reading ``cache.offset`` after the source
    advanced it) in a batched cache with an offset per row (mlx-lm 1384: Gemma 3n's shared
    layers under the batched cache): a decode step is off by one position, a prompt by its
    length, and a row that brought nothing is right.
    """

    def after(self: shared.SharedRows) -> tuple[int, ...]:
        return tuple(self.cache.row_lengths)

    with mock.patch.object(shared.SharedRows, "row_offsets", property(after)):
        yield


@contextmanager
def reader_at_row_zeros_offset() -> Iterator[None]:
    """A reader through ``append_rows`` puts every row's queries at row 0's offset (its
    length before the append), whatever each row holds.

    Stands for a shared layer that reads one scalar ``offset`` of a batched cache (the first
    row's, or the cache's ``length``) where the rows have offsets of their own: right while
    every row holds as many tokens, wrong for a row of another length (mlx-lm 1384, 748).
    """

    def first_rows(self: shared.SharedRows) -> tuple[int, ...]:
        return (self.rows_before[0],) * len(self.rows_before)

    with mock.patch.object(shared.SharedRows, "row_offsets", property(first_rows)):
        yield


@contextmanager
def reader_sees_the_tree_siblings() -> Iterator[None]:
    """A reader under a tree draft attends over its source's rows with the causal mask alone,
    not the tree mask: a node sees every node at its depth or above, its siblings' branches
    among them.

    Stands for a shared layer handed the source's keys and values but not the attention
    metadata of the draft (the tree mask built per layer, or built for the layers that
    write their own cache only): linear drafts are right, any tree with two branches is
    wrong at the reader.
    """

    def causal_only(self: shared.SharedReader, drafted: tree.TreeBatch) -> tree.TreeBatch:
        return dataclasses.replace(drafted, seen=torch.ones_like(drafted.seen))

    with mock.patch.object(shared.SharedReader, "tree_batch", causal_only):
        yield


class TreeRowsInASharedWorkspace(ChunkedCache):
    """``append_tree`` gathers the rows it returns into one workspace that every cache of the
    class shares, so a layer's rows change as soon as the next layer drafts its tree.

    Stands for a verify step's gather into a workspace reused across layers: correct while
    each layer reads its rows before the next layer runs, wrong for a layer that reads
    another's rows later (a KV-shared reader, Gemma 3n, YOCO), which rule 2 allows until the
    source's next call.
    """

    workspace: ClassVar[dict] = {}  # shared by every cache of the class: the bug

    def append_tree(self, key: Tensor, value: Tensor, parents) -> tuple[Tensor, Tensor]:
        keys, values = super().append_tree(key, value, parents)
        shape = (2, *keys.shape)
        space = self.workspace.get(shape)
        if space is None or space.dtype != keys.dtype or space.device != keys.device:
            space = self.workspace[shape] = torch.empty(shape, dtype=keys.dtype, device=keys.device)
        space[0], space[1] = keys, values
        return space[0], space[1]


# Bugs of the model's reader, run on a correct cache with rows of their own (the first two)
# and a correct tree cache (the third).
SHARED_ROWS_MODEL_MUTANTS = (
    reader_at_each_rows_length_after_the_append,
    reader_at_row_zeros_offset,
)
SHARED_TREE_MODEL_MUTANTS = (reader_sees_the_tree_siblings,)
SHARED_MUTANTS = (TreeRowsInASharedWorkspace,)
