"""How a cache is named for the kit's classes without a ``factory``: with ``--kv-impl NAME``
(repeatable), ``KV_IMPL`` (comma-separated) or the ``kv_impl`` ini option.

NAME is one of

- a built-in's short name (``concat``, ``preallocated``, ``unrotated``, ``chunked``,
  ``window``, ``streaming``, ``paged``, ``sdpa``),
  which stands for the ``MODULE:ATTR`` in ``BUILTINS``;
- ``MODULE:ATTR``, any factory importable from the run (``ATTR`` may be dotted);
- either of those after a label, ``LABEL=NAME`` (``mine=mypkg.caches:MyCache``): the label is
  the cache's test id (``[mine]``) and its heading in the verdict.

Without a label, a cache's test id is its short name, or ``ATTR`` unless two names share it.
Reading names (``labelled``) imports nothing; ``load_factory`` imports the module named, and
nothing else: naming ``concat`` imports ``kvimpl.concat`` (with the ``kvimpl`` package).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from kvref.protocol import CacheFactory

# The built-ins by short name; kvimpl.CACHES holds the same factories (a test checks).
BUILTINS = {
    "concat": "kvimpl.concat:ConcatCache",
    "preallocated": "kvimpl.preallocated:PreallocatedCache",
    "unrotated": "kvimpl.unrotated:UnrotatedCache",
    "chunked": "kvimpl.chunked:ChunkedCache",
    "window": "kvimpl.window:WindowCache",
    "streaming": "kvimpl.streaming:StreamingCache",
    "paged": "kvimpl.paged:pool",  # one pool of blocks shared by every cache it makes
    "sdpa": "kvimpl.sdpa:SdpaCache",
}

NO_CACHE = (
    "no cache to test: name one with --kv-impl MODULE:ATTR (or KV_IMPL, or the kv_impl ini option)"
)


class Selected(NamedTuple):
    """A cache under test: the name it was given by (without its label), and its factory."""

    name: str
    factory: CacheFactory


def names_given(options: list[str], env_value: str | None, ini: list[str]) -> list[str]:
    """The names of a run: those given with --kv-impl, else the comma-separated KV_IMPL (a
    blank one gives none), else the ini option's."""
    names = options or (env_value or "").split(",")
    names = [name.strip() for name in names if name.strip()]
    return names or [name.strip() for name in ini if name.strip()]


def labelled(names: list[str]) -> dict[str, str]:
    """Each name's label (its test id) -> the name without its label, in order; imports
    nothing. Raises ValueError with a one-line reason for a name that cannot be a cache's,
    an empty label, a name given twice or a label given to two caches."""
    for name in names:
        if names.count(name) > 1:
            raise ValueError(f"{name!r} is named {names.count(name)} times; name each cache once")
    parts = [_split(name) for name in names]
    unlabelled = [target for label, target in parts if label is None]
    labels: dict[str, str] = {}
    for (label, target), name in zip(parts, names, strict=True):
        label = label or cache_label(target, unlabelled)
        if label in labels:
            raise ValueError(
                f"{name!r}: the label {label!r} is given to {labels[label]!r} too; "
                "label one of them LABEL=NAME"
            )
        labels[label] = target
    return labels


def _split(name: str) -> tuple[str | None, str]:
    """(label or None, name) of ``LABEL=NAME`` or ``NAME``; the name's form is checked."""
    label, equals, target = name.partition("=")
    if not equals:
        label, target = None, name
    elif not label.strip():
        raise ValueError(f"{name!r}: the label before '=' is empty; write LABEL=MODULE:ATTR")
    target = target.strip()
    _module_attr(target, name)
    return (label.strip() if label is not None else None), target


def _module_attr(target: str, name: str) -> tuple[str, str]:
    """(MODULE, ATTR) of a built-in's short name or of ``MODULE:ATTR``."""
    module_name, colon, attr_path = BUILTINS.get(target, target).partition(":")
    if not colon or not module_name or not attr_path:
        raise ValueError(
            f"{name!r} is neither a built-in cache ({', '.join(BUILTINS)}) nor MODULE:ATTR"
        )
    return module_name, attr_path


def load_factory(name: str) -> CacheFactory:
    """The factory called ``name``: a built-in's short name, or ``MODULE:ATTR`` importable
    from here. Raises ValueError with a one-line reason when it does not resolve to a
    callable."""
    name = name.strip()
    module_name, attr_path = _module_attr(name, name)
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


def select(names: list[str]) -> dict[str, Selected]:
    """The caches ``names`` name, by label, their factories imported (see ``labelled``)."""
    return {label: Selected(name, load_factory(name)) for label, name in labelled(names).items()}


def cache_label(name: str, all_names: list[str]) -> str:
    """A short test id: ATTR of MODULE:ATTR unless another of ``all_names`` has the same ATTR."""
    short = name.rpartition(":")[2]
    clashes = [other for other in all_names if other.rpartition(":")[2] == short]
    return short if len(clashes) == 1 else name
