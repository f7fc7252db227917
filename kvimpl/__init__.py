"""Built-in caches and how to name any cache: a built-in name or ``MODULE:ATTR``."""

from __future__ import annotations

import importlib
from typing import NamedTuple

from kvimpl.chunked import ChunkedCache
from kvimpl.concat import ConcatCache
from kvimpl.paged import PagedCache, PagedPool
from kvimpl.paged import pool as paged_pool
from kvimpl.preallocated import PreallocatedCache
from kvimpl.window import WindowCache
from kvref.protocol import CacheFactory

CACHES: dict[str, CacheFactory] = {
    "concat": ConcatCache,
    "preallocated": PreallocatedCache,
    "chunked": ChunkedCache,
    "window": WindowCache,
    "paged": paged_pool,  # one pool of blocks shared by every cache it makes
}


def load_factory(name: str) -> CacheFactory:
    """The factory called ``name``: a key of CACHES, or ``MODULE:ATTR`` importable from here.

    Raises ValueError with a one-line reason when the name does not resolve to a callable.
    """
    name = name.strip()
    if name in CACHES:
        return CACHES[name]
    module_name, colon, attr_path = name.partition(":")
    if not colon or not module_name or not attr_path:
        raise ValueError(
            f"{name!r} is neither a built-in cache ({', '.join(CACHES)}) nor MODULE:ATTR"
        )
    try:
        target = importlib.import_module(module_name)
    except Exception as error:  # any import-time failure is the user's to see, in one line
        raise ValueError(
            f"{name!r}: cannot import module {module_name!r}: {type(error).__name__}: {error}"
        ) from error
    for attr in attr_path.split("."):
        try:
            target = getattr(target, attr)
        except AttributeError:
            raise ValueError(
                f"{name!r}: module {module_name!r} has no attribute {attr_path!r}"
            ) from None
    if not callable(target):
        raise ValueError(f"{name!r} is a {type(target).__name__}, not a callable cache factory")
    return target


class Selected(NamedTuple):
    """A cache under test: the name it was given by, and its factory."""

    name: str
    factory: CacheFactory


def select(option_names: list[str], env_value: str | None) -> dict[str, Selected]:
    """The caches under test, by test id: the names given with --kv-impl, else the
    comma-separated KV_IMPL, else every built-in. A name given twice is refused."""
    names = option_names or (env_value or "").split(",")
    names = [name.strip() for name in names if name.strip()] or list(CACHES)
    for name in names:
        if names.count(name) > 1:
            raise ValueError(f"{name!r} is named {names.count(name)} times; name each cache once")
    return {cache_label(name, names): Selected(name, load_factory(name)) for name in names}


def cache_label(name: str, all_names: list[str]) -> str:
    """A short test id: ATTR of MODULE:ATTR unless another selected name has the same ATTR."""
    short = name.rpartition(":")[2]
    clashes = [other for other in all_names if other.rpartition(":")[2] == short]
    return short if len(clashes) == 1 else name


__all__ = [
    "CACHES",
    "ChunkedCache",
    "ConcatCache",
    "PagedCache",
    "PagedPool",
    "PreallocatedCache",
    "Selected",
    "WindowCache",
    "cache_label",
    "load_factory",
    "select",
]
