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


SINKS_MUTANTS = (SinkEvictedOnWrap, SinksNotReordered, TruncateKeepsSinks)
