"""Broken caches: each a few lines away from a built-in, with exactly one bug.

The first line of each docstring names the bug; the rest says which real failure it stands
for and what it takes to show it. All of them are silent: they return tensors of plausible
shapes or raise nothing of their own, so only the suite can tell that they are wrong.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from kvimpl import ChunkedCache, ConcatCache, PreallocatedCache, WindowCache
from kvref import CacheSpec, check_append, check_reorder, check_truncate


class WrongAxis(ConcatCache):
    """Concatenates along the heads axis, not the length axis (seen through a heads x length
    view, so the shapes come out right and nothing crashes).

    Stands for layout mix-ups between (batch, heads, length, dim) and a flattened or
    (batch, length, heads, dim) layout: with kv_heads > 1, rows of new tokens land in other
    heads. A bare ``torch.cat(dim=1)`` would crash loudly; this is the silent form.
    """

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        check_append(self.spec, self.length, key, value)
        self.key = _join_heads_major(self.key, key)
        self.value = _join_heads_major(self.value, value)
        return self.key, self.value


def _join_heads_major(held: Tensor, new: Tensor) -> Tensor:
    batch, heads, _, head_dim = new.shape
    joined = torch.cat((held.flatten(1, 2), new.flatten(1, 2)), dim=1)
    return joined.view(batch, heads, -1, head_dim)


class Prepends(ConcatCache):
    """Puts new tokens in front of the held ones instead of after them.

    Stands for ``torch.cat((new, old))`` argument-order slips: every shape is right and a
    one-token prompt hides it, but positions no longer line up with rows.
    """

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        super().append(key, value)
        new_tokens = key.shape[2]
        self.key, self.value = self.key.roll(new_tokens, 2), self.value.roll(new_tokens, 2)
        return self.key, self.value


class ForgetsPrefix(PreallocatedCache):
    """Never stores the prompt: the prefill hands the prompt's keys and values straight back.

    Stands for a prefill fast path that bypasses the cache ("nothing to attend to yet"): the
    prompt's own logits are right, and every decode step attends to zeros or stale rows
    where the prompt should be.
    """

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        if self.length == 0:
            self._length = check_append(self.spec, 0, key, value, capacity=self.spec.max_length)
            return key, value
        return super().append(key, value)


class WholeBuffer(PreallocatedCache):
    """Returns the whole preallocated buffer, unwritten rows included.

    Stands for returning ``self.key`` instead of ``self.key[:, :, :end]``: a model that
    trusted the cache would attend to zero rows; it is right only when the buffer is full.
    """

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        super().append(key, value)
        return self.key, self.value


class _RowWriter(PreallocatedCache):
    """PreallocatedCache with the write of the new rows in a method of its own, so that a
    mutant can get only that wrong (not a mutant itself)."""

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        start = self._length
        end = start + check_append(self.spec, start, key, value, capacity=self.spec.max_length)
        self._write(self.key, start, key)
        self._write(self.value, start, value)
        self._length = end
        return self.key[:, :, :end], self.value[:, :, :end]

    def _write(self, buffer: Tensor, start: int, rows: Tensor) -> None:
        buffer[:, :, start : start + rows.shape[2]] = rows


class OffByOneWrite(_RowWriter):
    """Writes new rows from the last held position instead of the next free one.

    Stands for a write index taken from the last token's position (``length - 1``), clamped
    at 0 so that the prefill works: on a warm cache each append overwrites the newest held
    row and leaves its own last row unwritten.
    """

    def _write(self, buffer: Tensor, start: int, rows: Tensor) -> None:
        super()._write(buffer, max(start - 1, 0), rows)


class MiddleRowsUnwritten(_RowWriter):
    """On a warm cache, writes only the first and last of the new rows.

    Stands for a decode path written for one token (or a speculative pair) and then fed a
    chunk: it breaks only for appends of 3 or more tokens to a warm cache, which one-token
    decoding never tries.
    """

    def _write(self, buffer: Tensor, start: int, rows: Tensor) -> None:
        if start == 0:
            super()._write(buffer, start, rows)
            return
        buffer[:, :, start] = rows[:, :, 0]
        buffer[:, :, start + rows.shape[2] - 1] = rows[:, :, -1]


WINDOW = 48


class WrapsPast48(_RowWriter):
    """Past 48 tokens, wraps around and overwrites the oldest rows.

    Stands for a sliding-window ring buffer (or a hard-coded context size) in front of a
    full-attention model: correct for every prompt a quick test tries, wrong past 48 tokens.
    """

    def _write(self, buffer: Tensor, start: int, rows: Tensor) -> None:
        positions = torch.arange(start, start + rows.shape[2], device=buffer.device)
        buffer.index_copy_(2, positions % WINDOW, rows)


class SwapsKeysAndValues(PreallocatedCache):
    """Stores keys as values and values as keys.

    Stands for ``cache.update(v, k)``: every shape is the same, so nothing complains.
    """

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        return super().append(value, key)


class MixesBatchRows(PreallocatedCache):
    """Stores batch row b in slot batch - 1 - b and reads the slots back in order.

    Stands for a slot or beam reordering applied on write but not on read (continuous
    batching, beam search): invisible with batch 1.
    """

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        return super().append(key.flip(0), value.flip(0))


class FirstKvHeadOnly(PreallocatedCache):
    """Stores kv head 0 for every kv head.

    Stands for a cache written for multi-query attention (one kv head) and used with
    grouped-query attention: invisible with kv_heads 1.
    """

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        return super().append(key[:, :1].expand_as(key), value[:, :1].expand_as(value))


class KeepsCallersTensors(ConcatCache):
    """Keeps the prompt's key and value tensors themselves, not copies of them.

    Stands for ``if empty: self.key = key`` fast paths: when the caller reuses its input
    buffers (static buffers, CUDA graphs), the stored prompt changes under the cache.
    """

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        if self.length == 0:
            check_append(self.spec, 0, key, value)
            self.key, self.value = key, value
            return key, value
        return super().append(key, value)


class ResetKeepsChunks(ChunkedCache):
    """``reset()`` rewinds the length but keeps the chunks, old rows and all.

    Stands for a reset meant to reuse allocations: ``length`` says 0, yet whenever the old
    prompt spanned more chunks than the new one, its rows come back with the new ones.
    """

    def reset(self) -> None:
        self._length = 0
        self.chunks = getattr(self, "chunks", [])  # none yet when __init__ calls reset()


class CountsAppends(ConcatCache):
    """``length`` counts append calls, not tokens.

    Stands for decode loops written for one token per step (``self.pos += 1``): right for a
    one-token prompt decoded token by token, wrong once a prompt or chunk is longer.
    """

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        self.appends += 1
        return super().append(key, value)

    def reset(self) -> None:
        super().reset()
        self.appends = 0

    @property
    def length(self) -> int:
        return self.appends


class StoresFloat32(PreallocatedCache):
    """Stores in float32 and casts back: float64 keys and values silently lose precision.

    Stands for a cache that hard-codes its storage dtype (or quantises) and still returns
    the caller's dtype: right for float32 models, about 1e-7 off for float64 ones.
    """

    def __init__(self, spec: CacheSpec) -> None:
        super().__init__(spec)
        self.key, self.value = self.key.float(), self.value.float()

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        keys, values = super().append(key, value)
        return keys.to(self.spec.dtype), values.to(self.spec.dtype)


class StoresFloat16AsBfloat16(PreallocatedCache):
    """Stores float16 keys and values as bfloat16 and casts them back: three bits short.

    Stands for a cache whose half-precision storage is hard-coded to bfloat16 (the usual
    choice on recent accelerators): right for every other dtype, and for a float16 model
    rows that come back changed and logits that drift, by about the model's own float16
    error, which no fixed tolerance loose enough for half precision would notice.
    """

    def __init__(self, spec: CacheSpec) -> None:
        super().__init__(spec)
        if spec.dtype == torch.float16:
            self.key, self.value = self.key.bfloat16(), self.value.bfloat16()

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        keys, values = super().append(key, value)
        return keys.to(self.spec.dtype), values.to(self.spec.dtype)


class DropsFullLastChunk(ChunkedCache):
    """Joins no rows of the last chunk when it is exactly full (the length is a multiple of
    the chunk size).

    Stands for ``length % chunk_size`` used as "rows in the last chunk": it is 0, not
    chunk_size, exactly at a chunk boundary, so 16 tokens vanish there and only there.
    """

    def _joined(self, which: int) -> Tensor:
        rows_in_last = self._length % self.chunk_size
        parts = [chunk[which] for chunk in self.chunks[:-1]]
        parts.append(self.chunks[-1][which][:, :, :rows_in_last])
        return torch.cat(parts, dim=2)


class SharedStorage(PreallocatedCache):
    """Every cache built for the same spec writes into one buffer (a distinct object per
    layer, but shared storage).

    Stands for buffers memoised per shape "to save allocations" (or a class-level buffer):
    the model accepts the caches, since they are different objects, but each layer's history
    is overwritten by the next layer's, and two caches from one factory are not independent.
    """

    def __init__(self, spec: CacheSpec) -> None:
        super().__init__(spec)
        self.key, self.value = _shared_buffers(spec)


@functools.lru_cache(maxsize=4)
def _shared_buffers(spec: CacheSpec) -> tuple[Tensor, Tensor]:
    shape = (spec.batch, spec.kv_heads, spec.max_length, spec.head_dim)
    return (
        torch.zeros(shape, dtype=spec.dtype, device=spec.device),
        torch.zeros(shape, dtype=spec.dtype, device=spec.device),
    )


def same_cache_every_layer(spec: CacheSpec) -> ConcatCache:
    """Hands out one cache per spec, reset, to every caller: all layers get the same object.

    Stands for a cache pool keyed by shape. The model rejects the same object for two layers
    (its ValueError is a catch); with one layer the pool is harmless.
    """
    cache = _pooled_cache(spec)
    cache.reset()
    return cache


@functools.lru_cache(maxsize=1)
def _pooled_cache(spec: CacheSpec) -> ConcatCache:
    return ConcatCache(spec)


class CastsWrongDtype(ConcatCache):
    """Casts keys and values of another dtype to its own instead of refusing them.

    Stands for a "forgiving" cache that hides a caller's dtype bug (a float32 model writing
    into a float64 cache, or the reverse) where the protocol says to refuse it.
    """

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        if isinstance(key, Tensor) and isinstance(value, Tensor):
            key, value = key.to(self.spec.dtype), value.to(self.spec.dtype)
        return super().append(key, value)


class MovesOnRefusal(PreallocatedCache):
    """A refused append still moves the write position by one.

    Stands for bookkeeping updated before validation: the error is raised, but the cache is
    left one row longer than what it was given, with an unwritten row in it.
    """

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        try:
            return super().append(key, value)
        except ValueError:
            self._length += 1
            raise


class TrimsLongerValue(ConcatCache):
    """Accepts a value with more tokens than its key, cutting it to the key's length.

    Stands for a cache that trusts the key's shape for both tensors: a caller that passes
    mismatched keys and values loses rows without an error.
    """

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        if isinstance(key, Tensor) and isinstance(value, Tensor) and key.ndim == value.ndim == 4:
            value = value[:, :, : key.shape[2]]
        return super().append(key, value)


class CountsKeysOnly(ConcatCache):
    """``nbytes`` counts the keys and forgets the values.

    Stands for memory accounting that under-reports by half: a server sizing its batch by
    nbytes would run out of memory.
    """

    @property
    def nbytes(self) -> int:
        return self.key.nbytes


class StaleRowsAfterReset(PreallocatedCache):
    """After reset(), hands back every row up to the most it ever held, old ones included.

    Stands for a returned slice computed from a high-water mark instead of the length: the
    rows past the length are stale, from before the reset, and a mask would hide them.
    """

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        super().append(key, value)
        self.most = max(getattr(self, "most", 0), self._length)
        return self.key[:, :, : self.most], self.value[:, :, : self.most]


class WrapsAtCapacity(PreallocatedCache):
    """Past max_length, wraps around and overwrites the oldest rows instead of refusing.

    Stands for a ring buffer used where the protocol promises to refuse or hold everything:
    the caller is never told that tokens were lost.
    """

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        new = check_append(self.spec, self._length, key, value)  # no capacity: never refuses
        rows = (self._length + torch.arange(new)) % self.spec.max_length
        self.key[:, :, rows], self.value[:, :, rows] = key, value
        self._length += new
        held = min(self._length, self.spec.max_length)
        return self.key[:, :, :held], self.value[:, :, :held]


class VagueErrors(ConcatCache):
    """Refuses bad input with ``ValueError("invalid input")``, naming nothing.

    Stands for a catch-all ``except Exception: raise ValueError("invalid input")`` around an
    append: the caller learns that something was wrong, never what. The suite accepts any
    wording that names the axis or shows the values, and still fails this one.
    """

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        try:
            return super().append(key, value)
        except (TypeError, ValueError):
            raise ValueError("invalid input") from None


class WindowOffByOne(WindowCache):
    """Keeps W - 2 rows before the new ones instead of W - 1: once the session reaches W
    tokens, every new query's window lacks its oldest key.

    Stands for the off-by-one between a window that counts the query itself (keys
    p - W + 1 .. p) and one that does not, and for updates that broke exactly when the total
    length reached the window (transformers 37574, a strict against a non-strict
    inequality): every session shorter than the window is right.
    """

    def __init__(self, spec: CacheSpec) -> None:
        super().__init__(spec)
        if spec.window is not None:
            self.lookback = max(spec.window - 2, 0)


class WrapSlotBeforeFull(WindowCache):
    """Writes position p in slot p % W while it reads p from slot p % capacity: once an
    append of several tokens has grown the ring past W slots, positions W and on land on
    rows still needed, before the ring is even full.

    Stands for read and write slots computed by different formulas (transformers 47708:
    ``past_length % sliding_window`` as the start of the range, right only once the cache
    holds a full window). With one-token appends the ring has exactly W slots, and the two
    formulas agree.
    """

    def _write(self, buffer: Tensor, first: int, rows: Tensor) -> None:
        if self.spec.window is None:
            super()._write(buffer, first, rows)
            return
        positions = torch.arange(first, first + rows.shape[2], device=buffer.device)
        buffer.index_copy_(2, positions % self.spec.window, rows)


class ChunkOverwritesOwnWindow(WindowCache):
    """A ring of exactly W slots whatever the append: a chunk of T > 1 tokens overwrites
    rows its own earlier queries still need, and only the last W rows come back.

    Stands for a ring sized to the window and indexed ``input_pos % max_cache_len``
    (litgpt 2182, a prefill longer than the window): decoding one token at a time is right,
    a prefill or chunk that crosses the window is not.
    """

    def __init__(self, spec: CacheSpec) -> None:
        super().__init__(spec)
        if spec.window is not None:
            self.key, self.value = self._storage(spec.window), self._storage(spec.window)

    def _make_room(self, new_tokens: int) -> None:
        if self.spec.window is None:
            super()._make_room(new_tokens)

    def _write(self, buffer: Tensor, first: int, rows: Tensor) -> None:
        # Written in order into W slots, a chunk's later rows overwrite its earlier ones.
        overwritten = max(0, rows.shape[2] - self.capacity)
        super()._write(buffer, first + overwritten, rows[:, :, overwritten:])


class WindowTruncateUnchecked(WindowCache):
    """``truncate`` never refuses: taken back past the rows the ring still holds, it leaves
    the next queries without keys they need, and the next appends return too few rows.

    Stands for a rotating cache whose trim only moves its offset (ollama 14912: ``Trim()``
    on a wrapped RotatingKVCache corrupted its state instead of reporting failure).
    """

    def truncate(self, length: int) -> None:
        check_truncate(self._length, length)
        self._held = max(0, length - (self._length - self._held))
        self._length = length


class TruncateZeroIsNoOp(ChunkedCache):
    """``truncate(0)`` keeps everything.

    Stands for a crop that reads a length <= 0 as "that many from the end" (transformers
    47433: ``DynamicCache.crop(0)`` kept the whole cache): every other length is right.
    """

    def truncate(self, length: int) -> None:
        check_truncate(self._length, length)
        if length == 0:  # read as "drop nothing from the end"
            return
        super().truncate(length)


class TruncateKeepsRows(ConcatCache):
    """``truncate`` moves a length counter and keeps the rows; the next append recomputes
    the length from the rows it holds, dropped ones included.

    Stands for mlx-lm's ConcatenateKVCache.trim (fixed in ml-explore/mlx-lm#1502): it only
    decremented ``offset``, and the next update recomputed ``offset`` from the stored keys,
    so the trimmed tokens came back; the trim itself looked right.
    """

    def truncate(self, length: int) -> None:
        check_truncate(self.length, length)
        self.offset = length

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        keys, values = super().append(key, value)
        self.offset = keys.shape[2]
        return keys, values

    def reset(self) -> None:
        super().reset()
        self.offset = 0

    @property
    def length(self) -> int:
        return self.offset


class TruncateForgetsPosition(PreallocatedCache):
    """``truncate`` lowers ``length`` but not the write position: the next append writes
    after the dropped rows, and the rows it returns hold dropped ones where the new ones
    belong.

    Stands for a cache that keeps its write index apart from its length and rolls back only
    one of them when a speculative draft is rejected. (Its write position wraps at the end of
    the buffer, so that it never crashes.)
    """

    def __init__(self, spec: CacheSpec) -> None:
        super().__init__(spec)
        self.write_at = 0

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        new = check_append(self.spec, self._length, key, value, capacity=self.spec.max_length)
        slots = torch.arange(self.write_at, self.write_at + new) % self.spec.max_length
        self.key.index_copy_(2, slots.to(self.key.device), key)
        self.value.index_copy_(2, slots.to(self.value.device), value)
        self.write_at += new
        self._length += new
        return self.key[:, :, : self._length], self.value[:, :, : self._length]

    def reset(self) -> None:
        super().reset()
        self.write_at = 0


class ReorderKeysOnly(ConcatCache):
    """``reorder`` permutes the keys and leaves the values in the old order.

    Stands for a reorder written out for one tensor and copied for the other, with the copy
    never updated (a value cache rebuilt from the key cache's code): invisible with batch 1
    or when the beams stay in place.
    """

    def reorder(self, indices: Tensor) -> None:
        check_reorder(self.spec, indices)
        self.key = self.key.index_select(0, indices)


class ReorderIgnoresRepeats(PreallocatedCache):
    """``reorder`` scatters (``new[indices] = old``) instead of gathering (``new = old[indices]``).

    Stands for a reorder written as the inverse permutation: right for swaps (their own
    inverse), wrong for a cycle of three or more beams, and with repeated indices (a beam
    that splits in two) it loses the row to copy and keeps one it should have dropped.
    """

    def reorder(self, indices: Tensor) -> None:
        check_reorder(self.spec, indices)
        valid = self._length
        for buffer in (self.key, self.value):
            buffer[indices, :, :valid] = buffer[:, :, :valid].clone()


class ReorderSkipped(WindowCache):
    """``reorder`` validates its argument and does nothing.

    Stands for beam search that never reorders the cache (transformers 46612: the reorder
    was silently skipped for caches kept under another name than ``past_key_values``): each
    beam keeps attending to its own old history.
    """

    def reorder(self, indices: Tensor) -> None:
        check_reorder(self.spec, indices)


class RefusesTruncateZero(WindowCache):
    """Refuses ``truncate(0)`` once its ring has dropped position 0, as if the next query
    needed it.

    Stands for a rollback check that forgets a query at position 0 (or with a window of 1)
    needs no earlier position: "regenerate from scratch" fails on a long session, the
    crop(0) class of bug (transformers 47433) in its refusing form.
    """

    def truncate(self, length: int) -> None:
        check_truncate(self._length, length)
        oldest = self._length - self._held
        if oldest > max(0, length - self.lookback):
            raise ValueError(f"truncate: positions before {oldest} are gone")
        super().truncate(length)


class TruncateDropsPendingReorder(PreallocatedCache):
    """Applies a reorder lazily, at the next append, and forgets it on ``truncate``.

    Stands for a deferred beam reorder kept beside the cache (applied when the next token is
    written): a speculative rollback between the reorder and that token discards it, and
    every beam continues from another beam's history.
    """

    pending: Tensor | None = None

    def reorder(self, indices: Tensor) -> None:
        check_reorder(self.spec, indices)
        self.pending = indices if self.pending is None else self.pending[indices]

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        if self.pending is not None:
            held = self._length
            for buffer in (self.key, self.value):
                buffer[:, :, :held] = buffer[:, :, :held].index_select(0, self.pending)
            self.pending = None
        return super().append(key, value)

    def truncate(self, length: int) -> None:
        super().truncate(length)
        self.pending = None

    def reset(self) -> None:
        super().reset()
        self.pending = None


class ReorderFromSlotZero(WindowCache):
    """Reorders the ring's first ``held`` slots instead of the slots its held rows are in.

    Stands for a ring buffer whose beam reorder assumes its rows start at slot 0: true while
    it has not wrapped, wrong once a rollback leaves the held rows elsewhere in the ring.
    """

    def reorder(self, indices: Tensor) -> None:
        check_reorder(self.spec, indices)
        for buffer in (self.key, self.value):
            buffer[:, :, : self._held] = buffer[:, :, : self._held].index_select(0, indices)


class LengthFromContents(PreallocatedCache):
    """Counts its tokens as the slots of the longest row's first head holding a non-zero key.

    Stands for caches that infer what they hold from their contents, as transformers'
    ``StaticCache.get_seq_length`` did before 4.42 (``key_cache[0, 0].any(dim=-1).sum()``):
    right while every row is noise, short by one for each all-zero row (a padding token's
    embedding is zeros, and so are its keys and values in the first layer), and the next
    append then writes over the rows past that length.
    """

    @property
    def length(self) -> int:
        longest = max(range(self._rows()), key=self._lengths.__getitem__)
        written = self._lengths[longest]  # its rows: the others are shorter or as long
        return int(self.key[longest, 0, :written].any(dim=-1).sum())


class LengthFromSentinel(PreallocatedCache):
    """Fills its free slots with the dtype's lowest finite value and counts its tokens as the
    slots of the longest row's first head whose key does not begin with it.

    Stands for caches that tell written slots from free ones by a sentinel (the lowest value,
    as an attention mask is filled): right while rows are noise, short by one for each row
    whose first number is that value, and the next append then writes over the rows past
    that length.
    """

    def __init__(self, spec: CacheSpec) -> None:
        super().__init__(spec)
        self.key.fill_(torch.finfo(spec.dtype).min)

    @property
    def length(self) -> int:
        longest = max(range(self._rows()), key=self._lengths.__getitem__)
        written = self.key[longest, 0, : self._lengths[longest], 0]
        return int((written != torch.finfo(self.key.dtype).min).sum())


CACHE_MUTANTS = (
    WrongAxis,
    LengthFromContents,
    LengthFromSentinel,
    Prepends,
    ForgetsPrefix,
    WholeBuffer,
    OffByOneWrite,
    MiddleRowsUnwritten,
    WrapsPast48,
    SwapsKeysAndValues,
    MixesBatchRows,
    FirstKvHeadOnly,
    KeepsCallersTensors,
    ResetKeepsChunks,
    CountsAppends,
    StoresFloat32,
    StoresFloat16AsBfloat16,
    DropsFullLastChunk,
    SharedStorage,
    same_cache_every_layer,
    CastsWrongDtype,
    MovesOnRefusal,
    TrimsLongerValue,
    CountsKeysOnly,
    StaleRowsAfterReset,
    WrapsAtCapacity,
    VagueErrors,
    WindowOffByOne,
    WrapSlotBeforeFull,
    ChunkOverwritesOwnWindow,
    WindowTruncateUnchecked,
    TruncateZeroIsNoOp,
    TruncateKeepsRows,
    TruncateForgetsPosition,
    ReorderKeysOnly,
    ReorderIgnoresRepeats,
    ReorderSkipped,
    RefusesTruncateZero,
    TruncateDropsPendingReorder,
    ReorderFromSlotZero,
)
