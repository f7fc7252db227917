"""The built-in caches. ``CACHES`` holds them by the short names the kit knows them by
(``--kv-impl concat``; naming any cache is the kit's, ``kvcheck.selection``)."""

from __future__ import annotations

from kvimpl.chunked import ChunkedCache
from kvimpl.concat import ConcatCache
from kvimpl.paged import PagedCache, PagedPool
from kvimpl.paged import pool as paged_pool
from kvimpl.preallocated import PreallocatedCache
from kvimpl.sdpa import SdpaCache
from kvimpl.streaming import StreamingCache
from kvimpl.unrotated import UnrotatedCache
from kvimpl.window import WindowCache
from kvref.protocol import CacheFactory

CACHES: dict[str, CacheFactory] = {
    "concat": ConcatCache,
    "preallocated": PreallocatedCache,
    "unrotated": UnrotatedCache,  # keys kept before RoPE: a context shift deletes exactly
    "chunked": ChunkedCache,
    "window": WindowCache,
    "streaming": StreamingCache,  # attention sinks beside a window (StreamingLLM)
    "paged": paged_pool,  # one pool of blocks shared by every cache it makes
    "sdpa": SdpaCache,  # attend by torch's fused attention, declaring its backend's domain
}

__all__ = [
    "CACHES",
    "ChunkedCache",
    "ConcatCache",
    "PagedCache",
    "PagedPool",
    "PreallocatedCache",
    "SdpaCache",
    "StreamingCache",
    "UnrotatedCache",
    "WindowCache",
]
