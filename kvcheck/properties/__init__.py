"""Every property of the kit, one area module each, and the registry collected from them.

An area module (``core``, ``reset``, ...) holds its plans, their strategies, its checks, its
``Property`` declarations and its test class. ``ALL`` is every ``Property`` the area modules
declare, in ``AREAS`` order and, within a module, in the order declared: the verdict's
order. To add a property, follow ``docs/development.md``: one area module changes.
"""

from __future__ import annotations

from kvcheck.kit import Property
from kvcheck.properties import (
    attend,
    core,
    edits,
    interactions,
    isolation,
    memory,
    moves,
    pool,
    rejection,
    requests,
    reset,
    rows,
    serving,
    sharded,
    shared,
    shift,
    sinks,
    stateful,
    tree,
)

# The verdict's order: what everything rests on first, then the capabilities.
AREAS = (
    core,
    reset,
    isolation,
    rejection,
    memory,
    stateful,
    requests,
    shared,
    attend,
    pool,
    serving,
    tree,
    edits,
    rows,
    shift,
    sinks,
    moves,
    sharded,
    interactions,
)


def _declared(module) -> list[Property]:
    return [value for value in vars(module).values() if isinstance(value, Property)]


ALL: tuple[Property, ...] = tuple(prop for module in AREAS for prop in _declared(module))
BY_NAME = {prop.name: prop for prop in ALL}
NAMES = [prop.name for prop in ALL]  # the verdict's rows, in order (plain data for xdist)
SINCE = {prop.name: prop.since for prop in ALL}  # and the contract version each arrived in
if len(BY_NAME) != len(ALL):
    raise RuntimeError("two kit properties share a name")

__all__ = ["ALL", "AREAS", "BY_NAME", "Property"]
