"""Broken caches with rows of their own (docs/contract.md, section 8): each a
``PreallocatedCache`` or the independent left-padded cache with one bug in a member of
section 8; and a patch of the model's side of it, run on the left-padded cache."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import ClassVar
from unittest import mock

import torch
from torch import Tensor

from kvimpl import PreallocatedCache
from kvref import check_append_rows, model, shared, varlen
from tests.independent.left_padded_batch_cache import LeftPaddedBatchCache


class OneOffsetForAllRows(PreallocatedCache):
    """Writes every row's new tokens at the longest row's end: one cache position for the
    whole batch.

    Stands for batched generation that keeps one offset or cache position for all rows, so a
    shorter row's new keys land past a gap of stale slots (unsloth 3699, mlx-vlm 1946).
    """

    def append_rows(self, key: Tensor, value: Tensor, counts) -> tuple[Tensor, Tensor, Tensor]:
        counts = check_append_rows(self.spec, self._lengths, key, value, counts)
        start = self.length
        for row, count in enumerate(counts):
            self.key[row, :, start : start + count] = key[row, :, :count]
            self.value[row, :, start : start + count] = value[row, :, :count]
            self._lengths[row] += count
        return self._held_rows()


class RollbackZeroesRejectedRows(PreallocatedCache):
    """``truncate_rows`` zeroes a row's rejected keys and values instead of removing them: the
    row keeps its length, and attends them.

    Stands for per-row speculative rollbacks that overwrite rejected draft tokens with zeros
    in a dense batch: a zero key still gets softmax weight (sglang-jax 1297).
    """

    def truncate_rows(self, lengths) -> None:
        before = list(self._lengths)
        super().truncate_rows(lengths)
        for row, (old, new) in enumerate(zip(before, self._lengths, strict=True)):
            self.key[row, :, new:old] = 0
            self.value[row, :, new:old] = 0
        self._lengths = before


class IdleRowAdvancedByNeighbour(PreallocatedCache):
    """A row that brings no tokens in a call is advanced by its neighbours' chunk anyway.

    Stands for batch caches that advance every row's offset by the call's length, whatever
    the row brought: an idle row then reads unwritten slots (mlx-vlm 1962).
    """

    def append_rows(self, key: Tensor, value: Tensor, counts) -> tuple[Tensor, Tensor, Tensor]:
        counts = tuple(counts.tolist() if isinstance(counts, Tensor) else counts)
        returned = super().append_rows(key, value, counts)
        if 0 not in counts or not max(counts):
            return returned
        advanced = zip(self._lengths, counts, strict=True)
        self._lengths = [held + (max(counts) if count == 0 else 0) for held, count in advanced]
        return self._held_rows()


class FirstPositionIgnored(PreallocatedCache):
    """``reset_at`` empties the cache but forgets the first position: positions are counted
    from 0 again.

    Stands for a session resumed at a non-zero position whose cache recounts positions from
    zero (ik_llama.cpp 2459, sglang 11634): the logits hide it, RoPE being relative, but every
    key is rotated at the wrong absolute position, and so is whatever is later joined to it.
    """

    def reset_at(self, first_position) -> None:
        super().reset_at(first_position)
        self._firsts = [0] * self._rows()


class SelectDropsFirstPositions(PreallocatedCache):
    """``select_rows`` keeps each row's length but not its first position.

    Stands for continuous batching that carries a row's length through a batch filter and
    rebuilds its offset from zero, so the row's next keys are rotated at the wrong positions.
    """

    def select_rows(self, indices) -> None:
        super().select_rows(indices)
        self._firsts = [0] * self._rows()


class JoinDropsFirstPositions(PreallocatedCache):
    """``join`` takes the other cache's rows and lengths but starts them at position 0.

    Stands for continuous batching that merges a request prefilled elsewhere into the running
    batch and rebuilds its offsets from the lengths alone, losing where its positions began.
    """

    def join(self, other) -> None:
        rows = self._rows()
        super().join(other)
        self._firsts[rows:] = [0] * (self._rows() - rows)


class MaskDroppedAfterTheFirstDecode(LeftPaddedBatchCache):
    """From its second call on, every slot of every row is marked valid: the left padding of
    the prompts is attended as if it were tokens.

    Stands for batch generation that builds the padding mask for the prefill and extends it
    with ones on the first decode step from the wrong base (or drops it), so shorter rows
    attend their pad slots from then on (mlx-vlm 1946, transformers' left-padded generation).
    """

    calls = 0

    def append_rows(self, key: Tensor, value: Tensor, counts) -> tuple[Tensor, Tensor, Tensor]:
        keys, values, valid = super().append_rows(key, value, counts)
        self.calls += 1
        return keys, values, valid if self.calls == 1 else torch.ones_like(valid)

    def reset(self) -> None:
        super().reset()
        self.calls = 0


class RowsReturnedInASharedWorkspace(PreallocatedCache):
    """``append_rows`` gathers the rows it returns into one workspace that every cache of the
    class shares, so a layer's rows change as soon as the next layer appends.

    Stands for a gather into a workspace buffer reused across layers (the padded batch a
    varlen kernel is handed): correct while each layer reads its rows before the next layer
    runs, wrong for a caller that keeps them, which rule 2 allows until that cache's own
    next call.
    """

    workspace: ClassVar[dict] = {}  # shared by every cache of the class: the bug

    def append_rows(self, key: Tensor, value: Tensor, counts) -> tuple[Tensor, Tensor, Tensor]:
        keys, values, valid = super().append_rows(key, value, counts)
        shape = (2, *keys.shape)
        space = self.workspace.get(shape)
        if space is None or space.dtype != keys.dtype or space.device != keys.device:
            space = self.workspace[shape] = torch.empty(shape, dtype=keys.dtype, device=keys.device)
        space[0], space[1] = keys, values
        return space[0], space[1], valid


class JoinGivesEveryRowTheFirstJoinersPosition(LeftPaddedBatchCache):
    """``join`` gives every joining row the first joining row's first position.

    Stands for a merge of a request prefilled elsewhere that carries one offset for all of
    its rows: one sample's value applied to every row (lalamo 242), a scalar ``offset`` on
    one cache where the batch keeps one per row (mlx-lm 748); the rows' keys after the join
    are rotated at the wrong positions.
    """

    def join(self, other: LeftPaddedBatchCache) -> None:
        rows = self.batch
        super().join(other)
        self._first[rows:] = [other.first_position[0]] * other.batch


class JoinGivesEveryRowTheLongestLength(LeftPaddedBatchCache):
    """``join`` records every joining row as long as the joining request's longest: its
    shorter rows' left padding joins as tokens.

    Stands for a merge that takes a prefilled request's one length (its ``offset``, a scalar
    on a single cache: mlx-lm 748; ``extend`` merging caches of different lengths: mlx-lm
    1141), so the zeros in front of its shorter rows are attended as keys.
    """

    def join(self, other: LeftPaddedBatchCache) -> None:
        rows = self.batch
        super().join(other)
        self._lengths[rows:] = [other.length] * other.batch


class SelectTakesAPermutationAsTheIdentity(LeftPaddedBatchCache):
    """``select_rows`` does nothing when every row stays, whatever their new order.

    Stands for a batch filter that only acts when rows leave, so a reorder of every row is
    silently skipped (transformers 46612, the beam-search reorder skipped "silently"): each
    row then decodes on another row's keys and values.
    """

    def select_rows(self, indices: Tensor) -> None:
        if sorted(indices.tolist()) != list(range(self.batch)):
            super().select_rows(indices)


class SelectAppliesTheInversePermutation(LeftPaddedBatchCache):
    """``select_rows`` with every row staying moves row b to slot ``indices[b]`` (a scatter)
    instead of taking row ``indices[b]`` into slot b (a gather).

    Stands for gather and scatter confused in a batch re-index (the batch-axis re-indexing
    class of BUGS.md): the same for a swap of two rows, wrong for any longer cycle.
    """

    def select_rows(self, indices: Tensor) -> None:
        if sorted(indices.tolist()) == list(range(self.batch)):
            indices = torch.argsort(indices)
        super().select_rows(indices)


class TruncateToZeroKeepsTheRow(LeftPaddedBatchCache):
    """``truncate_rows`` leaves a row untouched when asked to keep 0 of its tokens.

    Stands for a per-row rollback that reads a length of 0 as "unchanged" (``n or held``),
    so a row whose every token is rejected, or emptied for reuse by another request, keeps
    its history and its next tokens attend it.
    """

    def truncate_rows(self, lengths) -> None:
        if len(lengths) == self.batch:  # else the parent refuses it, as it should
            lengths = [n or held for n, held in zip(lengths, self.row_lengths, strict=True)]
        super().truncate_rows(lengths)


class RoomCheckedOnTheLongestRow(LeftPaddedBatchCache):
    """``append_rows`` refuses a call whose T slots would take the longest row past
    ``max_length``, though that row brings none of them.

    Stands for batch caches that check capacity as one cache position plus the call's length
    for the whole batch (one ``cache_position`` for every row: unsloth 3699): a row that
    reached the end stops its neighbours from decoding.
    """

    def append_rows(self, key: Tensor, value: Tensor, counts) -> tuple[Tensor, Tensor, Tensor]:
        if self.row_lengths and self.length + key.shape[2] > self.spec.max_length:
            raise ValueError(f"no room: {self.length} + {key.shape[2]} > {self.spec.max_length}")
        return super().append_rows(key, value, counts)


@contextmanager
def positions_count_left_padding() -> Iterator[None]:
    """Each new token is placed at its row's next position plus its slot in the call, pads
    counted: a row's prompt, left-padded, starts as many positions late as it has pads.

    Stands for position ids taken as arange over the padded batch instead of the cumulative
    sum of the attention mask, so the prompt's keys are rotated at positions that count the
    padding while decode steps (no padding) are not (transformers' batched generation with
    RoPE models, unsloth 3699).
    """

    def counting_pads(starts: Tensor, real: Tensor) -> Tensor:
        return starts[:, None] + torch.arange(real.shape[1], device=real.device)

    # Where the positions are taken: the model's layers, and a layer that reads another's
    # cache (kvref.shared).
    with ExitStack() as patches:
        for module in (model, shared):
            patches.enter_context(mock.patch.object(module, "row_positions", counting_pads))
        yield


@contextmanager
def varlen_ranges_from_counts() -> Iterator[None]:
    """The varlen path takes each row's keys as its first ``valid.sum()`` slots, whatever
    ``valid`` marks: right for right-packed rows, a left-padded row's pads read as its oldest
    tokens (and as many of its newest left out).

    Stands for a varlen kernel handed ranges rebuilt from the rows' counts (a dense cumsum of
    lengths) where the storage puts each row's rows elsewhere: page-aligned per request
    (sglang-jax 1297, the window sliding onto a neighbour's page-tail slots), or after left
    padding (mlxcel 75/76, the mask started from the wrong base).
    """

    def first_slots(valid: Tensor) -> slice | None:
        count = int(valid.sum())
        return slice(0, count) if count else None

    with mock.patch.object(varlen, "valid_slots", first_slots):
        yield


@contextmanager
def varlen_reads_the_neighbours_rows() -> Iterator[None]:
    """The varlen path attends row b's query over row b - 1's keys and values, at the slots
    row b's ``valid`` marks: one batch row off in the offsets (cu_seqlens) it reads by.

    Stands for a batched kernel that reads or writes another request's row: flash-attention
    772 (``flash_attn_with_kvcache`` updating the wrong batch row), FlashInfer 353 (wrong when
    some rows had an empty cache).
    """
    varlen = model.varlen_attention

    def off_by_one_row(attend, query, keys, values, *args, **kwargs):
        return varlen(attend, query, keys.roll(1, 0), values.roll(1, 0), *args, **kwargs)

    with mock.patch.object(model, "varlen_attention", off_by_one_row):
        yield


# Bugs of the model's side of rows of their own, run on a correct left-padded cache.
ROWS_MODEL_MUTANTS = (
    positions_count_left_padding,
    varlen_ranges_from_counts,
    varlen_reads_the_neighbours_rows,
)


ROWS_MUTANTS = (
    OneOffsetForAllRows,
    RollbackZeroesRejectedRows,
    IdleRowAdvancedByNeighbour,
    FirstPositionIgnored,
    SelectDropsFirstPositions,
    JoinDropsFirstPositions,
    MaskDroppedAfterTheFirstDecode,
    RowsReturnedInASharedWorkspace,
    JoinGivesEveryRowTheFirstJoinersPosition,
    JoinGivesEveryRowTheLongestLength,
    SelectTakesAPermutationAsTheIdentity,
    SelectAppliesTheInversePermutation,
    TruncateToZeroKeepsTheRow,
    RoomCheckedOnTheLongestRow,
)
