"""Broken streaming caches (docs/contract.md, section 8.5): each a ``StreamingCache`` or a
``SinkListCache`` (tests/independent) with one bug in how it keeps its attention sinks."""

from __future__ import annotations

from collections import deque

from torch import Tensor

from kvimpl import StreamingCache
from kvref import check_reorder
from tests.independent.sink_list_cache import SinkListCache


class SinkEvictedOnWrap(StreamingCache):
    """The ring's modulus counts the sink slots: the first wrap writes over sink 0.

    Stands for StreamingLLM-style caches whose ring index runs over the whole buffer, sinks
    included, so the first token evicted when the window fills is a sink (the sinks are the
    part of the buffer that must never move).
    """

    def _slots(self, indices: Tensor) -> Tensor:
        return indices % self.key.shape[2]


class SinksNotReordered(SinkListCache):
    """``reorder`` moves the recent window's rows and leaves the sinks in their rows: after a
    beam search reorder each row attends its own window beside another row's sinks.

    Stands for caches kept in two parts whose reorder reaches one of them (transformers
    48700: a quantized cache's reorder indexed the residual only, the quantized part left
    unreordered): the other properties draw no sinks, so the part left out is empty there.
    """

    def reorder(self, indices: Tensor) -> None:
        check_reorder(self.spec, indices)
        self._chunks = deque(
            (k.index_select(0, indices), v.index_select(0, indices)) for k, v in self._chunks
        )


class TruncateKeepsSinks(SinkListCache):
    """``truncate`` back into the sinks cuts the recent window and leaves the sinks whole:
    the tokens given next are appended after sinks that should have been forgotten.

    Stands for rollbacks that shorten a cache's ring and its length but not the part kept
    apart (HF's SinkCache and its crop; a speculative rejection of a prompt still inside the
    sinks): a truncate that stays past the sinks is right.
    """

    def truncate(self, length: int) -> None:
        sinks = (self._sink_k, self._sink_v)
        super().truncate(length)
        self._sink_k, self._sink_v = sinks


class SinksMaskedOnceWrapped(StreamingCache):
    """``attend`` masks with the sliding window alone: the sinks are seen while the window
    still covers them, and masked out once it has moved past them (the ring wrapped).

    Stands for a sliding-window kernel handed a sink cache's rows without the sinks in its
    mask (FlashAttention's ``window_size`` knows no sinks; gpt-oss and vLLM's sink support
    came as a separate term): a model whose prompts fit in the window never shows it, and
    ``append`` returns the sinks, so only the attend path does.
    """

    def _visible(self, query_positions: Tensor, key_positions: Tensor) -> Tensor:
        keys, queries = key_positions[None, :], query_positions[:, None]
        visible = keys <= queries
        if self.spec.window is not None:
            visible &= keys > queries - self.spec.window
        return visible


class WindowCountsTheSinks(StreamingCache):
    """``attend``'s window counts the sinks: beside S sinks a query sees the last W - S
    positions, not the last W (the window measured from the sinks' end of the buffer).

    Stands for Hugging Face's ``SinkCache(window_length, num_sink_tokens)``, whose
    window_length is sinks and recent tokens together: a cache sized that way, driven by a
    model whose window is W without its sinks, attends S recent keys too few once the
    session passes S + W.
    """

    def _visible(self, query_positions: Tensor, key_positions: Tensor) -> Tensor:
        keys, queries = key_positions[None, :], query_positions[:, None]
        visible = keys <= queries
        if self.spec.window is not None:
            recent = max(1, self.spec.window - self.sinks)
            visible &= (keys > queries - recent) | (keys < self.sinks)
        return visible


SINKS_MUTANTS = (
    SinkEvictedOnWrap,
    SinksNotReordered,
    TruncateKeepsSinks,
    SinksMaskedOnceWrapped,
    WindowCountsTheSinks,
)
