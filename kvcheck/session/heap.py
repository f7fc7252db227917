"""Garbage collection inside a session, kept to what the session made."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def young_objects_only() -> Iterator[None]:
    """Collections inside look only at objects made inside: a full collection of a test
    process's heap takes some 200 ms, and a plan drops caches many times."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
