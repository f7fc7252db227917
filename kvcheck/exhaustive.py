"""The bounded-exhaustive mode: every plan of a property within a scope, not a random search.

``--kv-exhaustive N`` (or a test class's ``exhaustive = N``) runs, for each property that
enumerates its plans (``Property.every_plan``), every plan of up to N tokens on the scope's
models (``kvcheck.scope``) instead of a Hypothesis search; ``auto`` runs each property to its
own ``exhaustive_tokens``, the nightly job's. The plans are split into blocks of ``BLOCK``,
one test each: pytest's progress counts them, pytest-xdist shares them among its workers, and
``--kv-exhaustive-resume`` passes over a block an earlier run of the same cache code held.

Plans run fewest tokens first, so the first plan of a block that fails is its smallest: every
plan before it held. The block stops there and hands that plan to the property's Hypothesis
test as a pinned example, which reports it as every failure of the kit is reported (where it
diverged, and the ``drawn=`` to pin). The verdict says "exhaustive to N tokens: M plans, all
hold" only for a property every block of which ran and held. docs/exhaustive.md says what that
proves and what it does not.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported without torch: the plugin reads --kv-exhaustive with parse()
    from kvcheck.scope import Scope

BLOCK = 50  # plans per test: the unit of progress, of sharing among workers, of resuming
AUTO = "auto"
# The run's setting (--kv-exhaustive), set by the plugin: None (a search), a token count, or
# AUTO; and the pytest cache a resumed run reads the held blocks from (None: no resuming).
_chosen: list = [None]
_resume: list = [None]


def parse(value: object) -> int | str | None:
    """``--kv-exhaustive``'s (or a class's ``exhaustive``) value checked: None, a positive
    token count, or ``auto``; a ValueError that names the problem otherwise."""
    if value is None or value == AUTO:
        return value
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"--kv-exhaustive: {value!r} is neither a positive number of tokens nor {AUTO!r}"
        )
    return value


def choose(value: object, resume_store: Any = None) -> None:
    _chosen[:] = [parse(value)]
    _resume[:] = [resume_store]


def setting_for(test_class: type | None) -> int | str | None:
    """The run's setting, else the test class's own ``exhaustive``."""
    if _chosen[0] is not None:
        return _chosen[0]
    return parse(getattr(test_class, "exhaustive", None))


def tokens_for(prop, setting: int | str | None) -> int | None:
    """The tokens ``prop`` is enumerated to under ``setting``; None: it is searched."""
    if setting is None or prop.every_plan is None:
        return None
    return prop.exhaustive_tokens if setting == AUTO else setting


@dataclass(frozen=True)
class Block:
    """Plans ``first`` to ``stop`` - 1 of a property's ``total`` within ``scope``."""

    scope: Scope
    first: int
    stop: int
    total: int

    size = BLOCK

    @property
    def index(self) -> int:
        return self.first // BLOCK

    @property
    def count(self) -> int:
        return -(-self.total // BLOCK)

    def __str__(self) -> str:
        # Zero-padded, so that test ids sort as the plans do: the verdict names the first
        # failure by id, which is then the smallest plan that fails.
        width = len(str(self.total))
        return f"exhaustive {self.first + 1:0{width}}-{self.stop} of {self.total}"


def plans_of(prop, scope: Scope) -> tuple:
    """Every plan of ``prop`` within ``scope``, in its enumeration's order, for the sizes in
    force (the cache's declared domain)."""
    from kvcheck import sizes

    key = (prop.name, prop.every_plan, scope, repr(sizes.current()))
    if key not in _enumerated:
        _enumerated[key] = tuple(prop.every_plan(scope))
    return _enumerated[key]


# Each property's plans, enumerated once per process (at collection, then run by blocks).
_enumerated: dict[tuple, tuple] = {}


def blocks(prop, scope: Scope) -> list[Block]:
    """The blocks of ``prop``'s plans within ``scope``: at least one, so that a property
    with no plan in the scope still reports so."""
    total = len(plans_of(prop, scope))
    return [
        Block(scope, first, min(first + BLOCK, total), total)
        for first in range(0, max(total, 1), BLOCK)
    ]


# What the block running now did, for its verdict entry (the plugin collects it).
_records: list[dict] = []


@contextmanager
def recording() -> Iterator[dict]:
    record: dict = {}
    _records.append(record)
    try:
        yield record
    finally:
        _records.remove(record)


def _record(**fields) -> None:
    if _records:
        _records[-1].update(fields)


def note_searched() -> None:
    """Say that the test running now searches its property, in an exhaustive run: it
    enumerates no plans, or the cache does not offer them to it."""
    _record(searched=True)


def fingerprint(factory: object, block: Block, test_id: str) -> str:
    """What a held block is remembered under: the test, the block, the scope, the kit's
    version and the source of the module the factory is defined in. A cache whose code lives
    in other modules too is remembered by that module's alone (docs/exhaustive.md)."""
    try:
        source = inspect.getsource(inspect.getmodule(factory) or factory)
    except (OSError, TypeError):
        source = repr(factory)
    try:
        version = metadata.version("kvcache-verify")
    except metadata.PackageNotFoundError:
        version = "unknown"
    name = getattr(factory, "__qualname__", None) or type(factory).__qualname__
    shown = repr(factory)  # a pool's block size, say; not an address, which changes per run
    text = "\n".join(
        (test_id, name, "" if " at 0x" in shown else shown, str(block), repr(block.scope))
    )
    text += "\n".join((version, source))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def run_block(
    prop,
    block: Block,
    check: Callable[[Any], None],
    rerun: Callable[[Any], None],
    *,
    factory: object,
    test_id: str,
) -> None:
    """Run every plan of ``block`` through ``check``, in order, inside the sizes in force.

    The first plan that fails (raises anything) stops the block: ``rerun(plan)`` runs it
    again as the property's pinned Hypothesis example, whose failure is raised with where it
    sits in the enumeration noted on it; a plan that holds when rerun is flaky, and fails
    the block as such. A plan outside the cache's declared domain, and one that calls what
    the cache does not offer (``NotOffered``), is counted apart, neither held nor failed."""
    from kvcheck import reach
    from kvcheck.failures import NotOffered, OutsideDomain

    tokens = block.scope.tokens
    _record(tokens=tokens, total=block.total, first=block.first, stop=block.stop)
    _record(blocks=block.count, scope=block.scope.as_json())
    store, key = _resume[0], f"kvcheck/exhaustive/{fingerprint(factory, block, test_id)}"
    if store is not None and (earlier := store.get(key, None)):
        reach.note(*earlier["reached"])  # what its plans reached then, as if run again
        _record(
            held=earlier["held"],
            outside=earlier["outside"],
            not_offered=earlier.get("not offered", 0),
            resumed=True,
        )
        return
    plans = plans_of(prop, block.scope)[block.first : block.stop]
    held = outside = not_offered = 0
    for offset, plan in enumerate(plans):
        try:
            check(plan)
        except NotOffered:
            not_offered += 1
            continue
        except OutsideDomain:
            outside += 1
            continue
        except Exception as error:
            _record(
                held=held, outside=outside, not_offered=not_offered, failed=block.first + offset + 1
            )
            where = (
                f"exhaustive to {tokens} tokens ({block.scope.describe()}): plan "
                f"#{block.first + offset + 1} of {block.total} fails, the first of its block "
                f"(#{block.first + 1}-{block.stop}) to: every plan before it there held"
            )
            try:
                rerun(plan)
            except BaseException as shown:
                shown.add_note(where)
                raise
            raise AssertionError(
                f"{where}; it held when run again as a pinned example: flaky"
            ) from error
        held += 1
    _record(held=held, outside=outside, not_offered=not_offered, resumed=False)
    if store is not None:
        reached = sorted(reach._reached[-1]) if reach._reached else []
        counts = {"held": held, "outside": outside, "not offered": not_offered}
        store.set(key, {**counts, "reached": reached})
