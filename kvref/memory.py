"""What a cache reserves (rule 8, ``nbytes``; contract, section 10.1): the least a cache
holding some tokens can reserve (``min_nbytes``, lossy storage counted at its declaration's
least), and the bytes of the tensors an object really holds (``held_nbytes``), which a
cache's ``nbytes`` should not exceed where it keeps its rows in objects of its own.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import types
from collections.abc import Collection, Mapping

import torch
from torch import Tensor

from kvref.protocol import CacheSpec
from kvref.quantized import Quantized


def min_nbytes(
    spec: CacheSpec,
    length: int,
    storage: tuple[Quantized | None, Quantized | None] = (None, None),
    in_codes: tuple[int, int] = (0, 0),
) -> int:
    """The least a cache holding ``length`` tokens can reserve: B x H_kv x rows x (D + the
    value width) x itemsize (2 x D where values are as wide as keys), where rows is
    ``length``, or min(length, W - 1) with a window. A concat cache reserves exactly this.
    Under a declared lossy ``storage`` (section 10.1), of keys and of values the first
    ``in_codes`` rows may be in codes, at their declaration's least (``Quantized.nbytes``),
    or any of them as given where that takes less: "may", and a narrow row's codes with
    their scale and zero point can take more than the row (2 numbers in int8: 6 bytes; in
    bfloat16: 4)."""
    itemsize = torch.empty((), dtype=spec.dtype).element_size()
    rows = spec.rows_needed(length)
    total = 0
    widths = (spec.head_dim, spec.value_width)
    for declared, coded, width in zip(storage, in_codes, widths, strict=True):
        coded = 0 if declared is None else max(0, min(rows, coded - (length - rows)))
        least = (rows - coded) * width * itemsize  # the rows always as given
        if declared is not None:  # any k of the others in codes, the rest as given: the least
            least += min(
                declared.nbytes(k, width) + (coded - k) * width * itemsize for k in range(coded + 1)
            )
        total += least
    return spec.batch * spec.kv_heads * total


# What ``held_nbytes`` knows holds no rows: scalars and names, and what code is made of.
_HOLDS_NOTHING = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    range,
    slice,
    torch.dtype,
    torch.device,
    torch.Size,
    torch.Generator,
    type,
    type(dataclasses),
    type(threading.Lock()),
    type(threading.RLock()),
)


def _slot_names(kind: type) -> tuple[str, ...]:
    slots = vars(kind).get("__slots__", ())
    return (slots,) if isinstance(slots, str) else tuple(slots)


def _class_data(kind: type) -> list:
    """What a class and its bases hold as data that could be rows (an arena its instances
    share, say): tensors and collections, not methods, descriptors or constants."""
    return [
        value
        for base in kind.__mro__[:-1]  # not object
        if base.__module__ != "builtins"
        for name, value in vars(base).items()
        if not name.startswith("__") and isinstance(value, Tensor | Mapping | list | tuple | set)
    ]


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:  # a name not yet bound
        return False
    return True


def held_nbytes(obj: object) -> int | None:
    """The bytes of the tensors ``obj`` holds: reachable through its attributes (``__dict__``
    and every class's ``__slots__``), collections, dicts, bound methods and partials, a
    tensor subclass counted by the inner tensors its ``__tensor_flatten__`` names and an
    array by its ``nbytes``, each storage once and whole (a view holds all of its storage).
    None where it meets an object it cannot see into (an extension type without attributes,
    a tensor whose storage cannot be read), since what that holds is unknown. What a cache's
    ``nbytes`` should be at most, where it keeps its rows in objects of its own (contract,
    section 10.1)."""
    storages: dict[tuple, int] = {}
    seen: set[int] = set()
    todo = [obj]
    while todo:
        item = todo.pop()
        if isinstance(item, _HOLDS_NOTHING) or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, Tensor):
            if type(item) is not Tensor and hasattr(item, "__tensor_flatten__"):
                todo += [getattr(item, name) for name in item.__tensor_flatten__()[0]]
                continue
            try:
                storage = item.untyped_storage()
                key = (storage.data_ptr(), str(item.device), storage.nbytes())
            except (RuntimeError, NotImplementedError):  # sparse, or a wrapper without data
                return None
            storages[key] = storage.nbytes()
        elif isinstance(item, bytes | bytearray | memoryview):
            storages[(id(item),)] = len(item)
        elif hasattr(item, "__array_interface__") and isinstance(
            getattr(item, "nbytes", None), int
        ):
            storages[(id(item),)] = item.nbytes  # a numpy array
        elif isinstance(item, Mapping):
            todo += list(item.values())
        elif isinstance(item, Collection):
            todo += list(item)
        elif isinstance(item, functools.partial):
            todo += [item.func, *item.args, *item.keywords.values()]
        elif hasattr(item, "__self__"):  # a bound method: what it is bound to
            todo.append(item.__self__)
        elif isinstance(item, types.FunctionType):  # what its closure holds, not its module
            todo += [cell.cell_contents for cell in item.__closure__ or () if _filled(cell)]
        else:
            fields = getattr(item, "__dict__", None)
            slots = [name for kind in type(item).__mro__ for name in _slot_names(kind)]
            if fields is None and not slots:
                return None
            todo += list((fields or {}).values())
            todo += [getattr(item, name) for name in slots if hasattr(item, name)]
            todo += _class_data(type(item))
    return sum(storages.values())
