"""The contract's versions (docs/contract.md, section 12), and a run held to one of them.

Every property (``Property.since``) and bad-input case (``BadInput.since``) says the version
it arrived in. A run is held to the kit's own ``VERSION`` unless the user pins an earlier one
(``--kv-contract``, the ini option ``kv_contract``, ``KV_CONTRACT``): then what arrived after
the pin runs and is reported, but is not counted against the cache.
"""

from __future__ import annotations

import os
import re

# Each version and what arrived in it, oldest first; the last is the kit's own.
VERSIONS: dict[str, str] = {
    "1.0": "the protocol, the rules, bad input, optional capabilities, block pools, sizes",
    "1.1": "a declared domain (kv_sizes supports)",
    "1.2": "rows of their own: mixed lengths, context shift, attention sinks",
    "1.3": "serving pools: prefix caching, tree drafts, offload",
    "1.4": "compressed caches: lossy storage, latent caches, layers that share one cache",
    "1.5": "distributed inference: shards, moves between layouts; the contract's versions",
    "1.6": "every capability with every other: lossy pools and rows, float8 codes and groups "
    "along tokens, shared layers through rows and trees, shifts per row, sinks and latents "
    "on the attend path",
    "1.7": "engines under the kit: the model as the unit, driven by token ids (section 13)",
    "1.8": "interactions: every pair of events a cache offers, run by construction (section 14)",
}
VERSION = list(VERSIONS)[-1]
ENV = "KV_CONTRACT"


def key(version: str) -> tuple[int, ...]:
    """``version`` as a tuple that sorts as versions do ("1.10" after "1.9")."""
    return tuple(int(part) for part in version.split("."))


def newer(since: str, held_to: str) -> bool:
    """Whether something that arrived in ``since`` is beyond a run held to ``held_to``."""
    return key(since) > key(held_to)


def check(version: str, origin: str) -> str:
    """``version`` if the kit knows it, else a ValueError naming the versions it knows."""
    text = str(version).strip()
    if text in VERSIONS:
        return text
    known = ", ".join(VERSIONS)
    well_formed = re.fullmatch(r"[1-9]\d*\.(0|[1-9]\d*)", text) is not None
    if well_formed and newer(text, VERSION):
        raise ValueError(
            f"{origin} {version!r}: this kit checks contract {VERSION} at most (it knows "
            f"{known}); upgrade kvcache-verify to be held to {text}"
        )
    form = "" if well_formed else " (MAJOR.MINOR, e.g. 1.4)"
    raise ValueError(f"{origin} {version!r} is not a version of the contract{form}; it has {known}")


def held_to(option: str | None, ini: str | None) -> str:
    """The version a run is held to: the option, else ``KV_CONTRACT``, else the ini option,
    else the kit's own. A value the kit does not know raises ValueError, an empty one too
    where it was given (``--kv-contract=``, ``KV_CONTRACT=``: a pin is never ignored)."""
    for value, origin in (
        (option, "--kv-contract"),
        (os.environ.get(ENV), ENV),
        (ini or None, "the ini option kv_contract"),
    ):
        if value is not None:
            return check(value, origin)
    return VERSION


def of_property(mark) -> str:
    """The version a ``kv_property(name, since)`` marker names ("1.0" where it names none)."""
    return mark.args[1] if len(mark.args) > 1 else "1.0"


def not_counted(since: str, held: str) -> str | None:
    """Why a result is not counted in a run held to ``held``: it arrived later; else None."""
    if newer(since, held):
        return f"new in contract {since}, after the {held} this run is held to: not counted"
    return None
