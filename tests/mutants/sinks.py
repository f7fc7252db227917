"""Broken streaming caches (docs/contract.md, section 8.5): each a ``StreamingCache`` with
one bug in how it keeps its attention sinks."""

from __future__ import annotations

from torch import Tensor

from kvimpl import StreamingCache


class SinkEvictedOnWrap(StreamingCache):
    """The ring's modulus counts the sink slots: the first wrap writes over sink 0.

    Stands for StreamingLLM-style caches whose ring index runs over the whole buffer, sinks
    included, so the first token evicted when the window fills is a sink (the sinks are the
    part of the buffer that must never move).
    """

    def _slots(self, indices: Tensor) -> Tensor:
        return indices % self.key.shape[2]


SINKS_MUTANTS = (SinkEvictedOnWrap,)
