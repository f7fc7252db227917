"""A streaming cache: StreamingLLM's attention sinks beside a sliding window, in one buffer.

With ``spec.window = W`` and ``spec.sinks = S`` a query sees the session's first S tokens
(the sinks, which soak up attention a model puts on its first tokens whatever they say)
and the last W positions; nothing else is ever read again, so memory is bounded by
S + W - 1 + the largest append, however long the session runs.

The buffer's first S slots hold the sinks, written once; the rest is a ring. The token of
index i since the reset lives in slot i while i < S, and in slot S + (i - S) % ring after:
the ring wraps past the sinks, never over them (counting them into the ring's modulus is
the bug that evicts a sink on the first wrap). ``append`` returns the sinks, then the ring's
rows oldest first: rule 7's recent run, as ``kvref.protocol.kept_rows`` lays it out. Keys
keep the positions they were given, whichever positions the model gives the sinks (contract,
section 8.5).

``attend`` appends, then computes attention itself over the sinks and the ring in one pass
(scores, softmax and sums in float32 or wider, rounded once), each key at the position it
was given: a query at p sees the sinks and p - W + 1 to p, the window counted from the
query alone (section 8.5's "original" positions; the model attends itself under "in
cache").

With ``sinks = 0`` it is a plain ring-buffer window cache; with no window the ring keeps
every row and doubles when full.

Only then do its rows move (section 11.2, ``kvimpl.movable.RecentRunMixin``, as ``window``'s):
``kvref.CacheRows`` is one run of the most recent rows, which has no place for the sinks, so
``export_rows`` and ``import_rows`` refuse a cache with sinks (not designed yet).
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import Tensor

from kvimpl.movable import RecentRunMixin
from kvref.checks import check_append, check_attend, check_reorder, check_truncate
from kvref.protocol import CacheSpec, kept_rows


class StreamingCache(RecentRunMixin):
    # The sink counts it takes beside a window (contract, section 8.5); 0 is a plain window.
    kv_sizes: ClassVar[dict] = {"supports": {"sinks": (0, 1, 2, 4, 8)}}

    def __init__(self, spec: CacheSpec) -> None:
        self.spec = spec
        self.sinks = spec.sinks
        # The rows before the new ones that an append must keep besides the sinks: each new
        # query looks back W - 1 positions; without a window, to the start.
        self.lookback = math.inf if spec.window is None else spec.window - 1
        self.key, self.value = self._storage(self.sinks), self._storage(self.sinks)
        self.reset()

    @property
    def length(self) -> int:
        return self._length

    @property
    def ring(self) -> int:
        """Slots after the sinks."""
        return self.key.shape[2] - self.sinks

    @property
    def nbytes(self) -> int:
        return self.key.nbytes + self.value.nbytes

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        new_tokens = check_append(self.spec, self._length, key, value)
        past_sinks = max(0, self._length + new_tokens - max(self._length, self.sinks))
        self._make_room(past_sinks)
        slots = self._slots(self._indices(self._length, self._length + new_tokens))
        self.key[:, :, slots] = key
        self.value[:, :, slots] = value
        self._length += new_tokens
        self._recent = min(self._recent + past_sinks, self.ring)
        return self._rows_to_move()

    def attend(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        """Append ``key`` and ``value``, then attend ``query`` (B, H, T, D) over the rows
        held: the sinks and the ring, masked by the positions they were given."""
        first = self._length
        check_attend(self.spec, first, query, key, value)  # before anything changes
        keys, values = self.append(key, value)
        held = kept_rows(self.sinks, keys.shape[2], self._length)
        key_positions = torch.tensor(held, device=query.device)
        query_positions = torch.arange(first, self._length, device=query.device)
        visible = self._visible(query_positions, key_positions)
        return grouped_softmax_attention(query, keys, values, visible)

    def _visible(self, query_positions: Tensor, key_positions: Tensor) -> Tensor:
        """(T, rows): whether each query sees each key held: causal, and with a window the
        last W positions up to the query's own, or a sink."""
        keys, queries = key_positions[None, :], query_positions[:, None]
        visible = keys <= queries
        if self.spec.window is not None:
            visible &= (keys > queries - self.spec.window) | (keys < self.sinks)
        return visible

    def _rows_to_move(self) -> tuple[Tensor, Tensor]:
        return self._read(self.key), self._read(self.value)

    def _movable(self, call: str) -> CacheSpec:
        if self.sinks:
            raise ValueError(
                f"{call}: this streaming cache keeps {self.sinks} attention sinks beside its "
                f"window; kvref.CacheRows is one run of the most recent rows, with no place "
                f"for sinks, so a cache with sinks does not move (not designed yet)"
            )
        return self.spec

    def truncate(self, length: int) -> None:
        """Forget every token from index ``length`` on; refused when the query there would
        need a row the ring has already overwritten (the sinks are never overwritten)."""
        check_truncate(self._length, length)
        oldest = self._length - self._recent  # the oldest index the ring holds
        needed = max(self.sinks, length - self.lookback)  # the oldest the next query sees
        if needed < length and oldest > needed:
            raise ValueError(
                f"truncate: cannot go back to {length} tokens: positions {needed}..{oldest - 1} "
                f"are gone (this streaming cache holds its {self.sinks} sinks and "
                f"{oldest}..{self._length - 1}), and the query at {length} needs them"
            )
        self._recent = max(0, length - max(oldest, self.sinks))
        self._length = length

    def reorder(self, indices: Tensor) -> None:
        check_reorder(self.spec, indices)
        self.key.copy_(self.key.index_select(0, indices))
        self.value.copy_(self.value.index_select(0, indices))

    def reset(self) -> None:
        self._length = 0
        self._recent = 0  # rows past the sinks still in the ring

    def _slots(self, indices: Tensor) -> Tensor:
        """The slot of each token index: its own below the sinks, the ring's past them."""
        past = self.sinks + (indices - self.sinks) % max(1, self.ring)
        return torch.where(indices < self.sinks, indices, past)

    def _held(self) -> Tensor:
        """The indices of the rows held, oldest first: the sinks, then the ring's run."""
        sinks = self._indices(0, min(self.sinks, self._length))
        return torch.cat((sinks, self._indices(self._length - self._recent, self._length)))

    def _indices(self, start: int, end: int) -> Tensor:
        return torch.arange(start, end, device=self.spec.device)

    def _read(self, buffer: Tensor) -> Tensor:
        slots = self._slots(self._held())
        if len(slots) and bool((slots.diff() == 1).all()):  # one run of slots: a view
            first = int(slots[0])
            return buffer[:, :, first : first + len(slots)]
        return buffer[:, :, slots]

    def _make_room(self, past_sinks: int) -> None:
        """Grow the ring if writing ``past_sinks`` rows into it would overwrite a row the
        new queries still need, keeping the sinks and the rows still needed."""
        keep = min(self._recent, self.lookback)
        if keep + past_sinks <= self.ring:
            return
        if self.spec.window is None:
            ring = max(keep + past_sinks, 2 * self.ring)
        else:
            ring = self.lookback + past_sinks
        indices = self._held()[-keep:] if keep else self._held()[:0]
        kept = [buffer[:, :, self._slots(indices)] for buffer in (self.key, self.value)]
        sinks = [buffer[:, :, : self.sinks] for buffer in (self.key, self.value)]
        self.key, self.value = self._storage(self.sinks + ring), self._storage(self.sinks + ring)
        for buffer, old_sinks, rows in zip((self.key, self.value), sinks, kept, strict=True):
            buffer[:, :, : self.sinks] = old_sinks
            buffer[:, :, self._slots(indices)] = rows
        self._recent = keep

    def _storage(self, rows: int) -> Tensor:
        s = self.spec
        shape = (s.batch, s.kv_heads, rows, s.head_dim)
        return torch.zeros(shape, dtype=s.dtype, device=s.device)


def grouped_softmax_attention(
    query: Tensor, keys: Tensor, values: Tensor, visible: Tensor, scale: float | None = None
) -> Tensor:
    """softmax(q k^T x scale) v of ``query`` (B, H, T, D) over ``keys`` (B, H_kv, rows, D)
    and ``values`` (B, H_kv, rows, D_v), the query heads grouped onto their kv head (no
    copies of the keys), only where ``visible`` (T, rows); ``scale`` 1/sqrt(D) unless
    given; accumulated in float32 or wider, rounded once."""
    batch, heads, new_tokens, head_dim = query.shape
    kv_heads = keys.shape[1]
    wide = torch.promote_types(query.dtype, torch.float32)
    grouped = query.to(wide).reshape(batch, kv_heads, heads // kv_heads, new_tokens, head_dim)
    scale = 1 / math.sqrt(head_dim) if scale is None else scale
    scores = grouped @ keys.to(wide)[:, :, None].transpose(-2, -1) * scale
    weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    mixed = weights @ values.to(wide)[:, :, None]
    return mixed.reshape(batch, heads, new_tokens, -1).to(query.dtype)
