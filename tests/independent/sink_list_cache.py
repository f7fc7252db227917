"""A StreamingLLM cache: attention sinks in one tensor, the recent window in a deque of chunks.

StreamingLLM keeps the first S tokens of a session (the "attention sinks") beside a sliding
window of the last W tokens; a query at position p sees positions 0..S-1 and p-W+1..p
(docs/contract.md, section 8.5). This cache stores the two parts separately:

- ``_sink_k`` / ``_sink_v``: one tensor each, (B, H_kv, s, D), holding the first
  s = min(S, length) tokens. They only ever grow (until S rows) or shrink on ``truncate``.
- ``_chunks``: a ``collections.deque`` of ``(key, value)`` chunk copies, one per append (the
  part of that append past the sinks), covering one unbroken run of positions that ends at
  ``length - 1``. Old chunks leave from the left once no later query can see them; the
  oldest surviving chunk is re-copied down to the rows still needed, so that what the cache
  holds between calls is exactly the sinks and the last W - 1 tokens.

Every ``append`` returns a fresh ``torch.cat`` of the sinks and the chunks, oldest first;
eviction happens after the return value was built, so the return always holds each new
query's whole window. Unlike the built-in streaming cache (a single preallocated ring
buffer written in place), nothing here is preallocated or overwritten: storage is a list of
immutable copies, and ``nbytes`` is the sum of what those copies hold.

Without a window (``spec.window`` None, so no sinks either) nothing is evicted and every row
is returned; the deque is folded into one chunk now and then to keep ``torch.cat`` short.
It never refuses for length: windowed, it drops what no query can see, and without a window
it keeps growing (rule 4 allows either). Offers ``truncate``, ``reorder`` and ``attend``:
unlike the built-in streaming cache's one masked pass, its attention goes query by query,
each gathering the positions it sees (its sinks, then its window) and a softmax over
those alone, in float64.
"""

from __future__ import annotations

from collections import deque
from typing import ClassVar

import torch
from torch import Tensor

from kvref import CacheSpec, check_append, check_attend, check_reorder, check_truncate

# Without a window the deque would get one chunk per append, and each return would cat them
# all; past this many chunks they are folded into one (amortised, and still exact copies).
_MAX_CHUNKS = 32


class SinkListCache:
    kv_sizes: ClassVar[dict[str, dict]] = {"supports": {"sinks": (0, 1, 4)}}

    def __init__(self, spec: CacheSpec) -> None:
        self.spec = spec
        self.reset()

    # ----------------------------------------------------------------------------- state

    @property
    def length(self) -> int:
        return self._length

    @property
    def nbytes(self) -> int:
        # Every tensor held is a contiguous copy of its own, so its nbytes is its storage.
        held = self._sink_k.nbytes + self._sink_v.nbytes
        return held + sum(k.nbytes + v.nbytes for k, v in self._chunks)

    def reset(self) -> None:
        s = self.spec
        empty = (s.batch, s.kv_heads, 0, s.head_dim)
        self._sink_k = torch.empty(empty, dtype=s.dtype, device=s.device)
        self._sink_v = torch.empty(empty, dtype=s.dtype, device=s.device)
        self._chunks: deque[tuple[Tensor, Tensor]] = deque()
        self._length = 0

    def _recent_start(self) -> int:
        """The position of the oldest row in the chunks (``length`` when there are none):
        derived, not stored, so that it can never disagree with the chunks."""
        return self._length - sum(k.shape[2] for k, _ in self._chunks)

    # ---------------------------------------------------------------------------- append

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        # Validate before touching anything, so that a refusal leaves the cache as it was.
        new_tokens = check_append(self.spec, self._length, key, value)
        sinks = self.spec.sinks
        start = self._length

        # The first of the new tokens may still be sinks (positions < S); the rest go to a
        # chunk of their own. Both are copied: the caller may reuse its buffers.
        to_sinks = max(0, min(sinks, start + new_tokens) - start)
        if to_sinks:
            self._sink_k = torch.cat((self._sink_k, key[:, :, :to_sinks]), dim=2)
            self._sink_v = torch.cat((self._sink_v, value[:, :, :to_sinks]), dim=2)
        if to_sinks < new_tokens:
            self._chunks.append((_copy(key[:, :, to_sinks:]), _copy(value[:, :, to_sinks:])))
        self._length = start + new_tokens

        # Built before eviction: the new queries need up to W - 1 rows before the new ones,
        # which the next query no longer does.
        keys = torch.cat((self._sink_k, *(k for k, _ in self._chunks)), dim=2)
        values = torch.cat((self._sink_v, *(v for _, v in self._chunks)), dim=2)

        if self.spec.window is None:
            if len(self._chunks) > _MAX_CHUNKS:
                # ``keys``/``values`` past the (empty) sinks are the whole history: keep a copy
                # of them as the one chunk, not the tensors the caller gets.
                self._chunks = deque([(_copy(keys), _copy(values))])
        else:
            self._evict()
        return keys, values

    # ---------------------------------------------------------------------------- attend

    def attend(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        """Append, then for each query at position p: softmax attention over the keys at
        the sinks' positions and p - W + 1 .. p (the window counted from p alone)."""
        start = self._length
        new_tokens = check_attend(self.spec, start, query, key, value)
        keys, values = self.append(key, value)
        positions = self._positions_of(keys.shape[2])
        group = query.shape[1] // self.spec.kv_heads
        keys = keys.to(torch.float64).repeat_interleave(group, dim=1)
        values = values.to(torch.float64).repeat_interleave(group, dim=1)
        outputs = []
        for i in range(new_tokens):
            seen = [
                slot for slot, position in enumerate(positions) if self._sees(start + i, position)
            ]
            q = query[:, :, i].to(torch.float64)  # (B, H, D)
            scores = torch.einsum("bhd,bhkd->bhk", q, keys[:, :, seen]) / query.shape[-1] ** 0.5
            weights = torch.softmax(scores, dim=-1)
            outputs.append(torch.einsum("bhk,bhkd->bhd", weights, values[:, :, seen]))
        return torch.stack(outputs, dim=2).to(query.dtype)

    def _positions_of(self, returned: int) -> list[int]:
        """The positions of the rows ``append`` just returned: the sinks, then the chunks'
        run, which ends at the last position given."""
        sinks = list(range(self._sink_k.shape[2]))
        return sinks + list(range(self._length - (returned - len(sinks)), self._length))

    def _sees(self, query_position: int, key_position: int) -> bool:
        if key_position > query_position:
            return False
        if self.spec.window is None or key_position < self.spec.sinks:
            return True
        return key_position > query_position - self.spec.window

    def _evict(self) -> None:
        """Drop every chunk row the next query (at position ``length``) cannot see: it sees
        the sinks and positions length - W + 1 onwards."""
        first_needed = max(self.spec.sinks, self._length - self.spec.window + 1)
        start = self._recent_start()
        while self._chunks:
            k, v = self._chunks[0]
            rows = k.shape[2]
            if start + rows <= first_needed:  # wholly out of every later window
                self._chunks.popleft()
                start += rows
                continue
            if start < first_needed:  # straddles: keep a copy of the tail only (exact nbytes)
                cut = first_needed - start
                self._chunks[0] = (_copy(k[:, :, cut:]), _copy(v[:, :, cut:]))
            break

    # ------------------------------------------------------------------- truncate/reorder

    def truncate(self, length: int) -> None:
        check_truncate(self._length, length)
        window, sinks = self.spec.window, self.spec.sinks
        recent_start = self._recent_start()
        if window is not None:
            # The query at ``length`` sees positions max(S, length - W + 1) .. length - 1
            # besides the sinks (always held); refuse if the oldest of them was dropped.
            first_needed = max(sinks, length - window + 1)
            if first_needed < length and first_needed < recent_start:
                raise ValueError(
                    f"truncate: cannot go back to length {length}: the next query needs "
                    f"position {first_needed} (window {window}, {sinks} sinks), but this cache "
                    f"already dropped every position before {recent_start}"
                )

        # Everything below only shrinks; nothing can fail half-way.
        if self._sink_k.shape[2] > length:
            self._sink_k = _copy(self._sink_k[:, :, :length])
            self._sink_v = _copy(self._sink_v[:, :, :length])
        end = self._length
        while self._chunks:
            k, v = self._chunks[-1]
            chunk_start = end - k.shape[2]
            if chunk_start >= length:  # wholly forgotten
                self._chunks.pop()
                end = chunk_start
                continue
            if end > length:  # straddles: keep a copy of the head only
                keep = length - chunk_start
                self._chunks[-1] = (_copy(k[:, :, :keep]), _copy(v[:, :, :keep]))
            break
        self._length = length

    def reorder(self, indices: Tensor) -> None:
        check_reorder(self.spec, indices)
        # index_select makes new tensors, so a repeated index gives rows that share nothing.
        self._sink_k = self._sink_k.index_select(0, indices)
        self._sink_v = self._sink_v.index_select(0, indices)
        self._chunks = deque(
            (k.index_select(0, indices), v.index_select(0, indices)) for k, v in self._chunks
        )


def _copy(t: Tensor) -> Tensor:
    """A contiguous copy that owns its storage (a view would keep its whole base alive)."""
    return t.detach().clone(memory_format=torch.contiguous_format)
