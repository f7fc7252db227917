"""Pool: a factory that is a ``kvref.BlockPool`` keeps its books, and refuses when empty.

- ``pool``: the request plans of ``kvcheck.properties.requests`` on a tight pool, its books
  audited after every event (``kvcheck.pool_books``), every block back at the end;
- ``exhausted pool``: on a tight pool (``with_blocks``) a cache A is warmed (and, for a
  fork-write, forked into F while blocks are left); a filler cache then takes blocks until
  ``blocks_free`` is 0, 1 or 2. A call that needs more blocks than are left under any
  correct pool (more rows than the room in the target's last block and in that many blocks
  more) must then be refused with a ``ValueError``: ``append`` or ``attend`` on A, or a
  write to the fork F (which copy-on-write pools must also copy first). Afterwards nothing
  may have changed: lengths, block tables, the pool's counts, and, once the filler is
  dropped and its blocks are back, the rows A and F return, bit for bit.
"""

from __future__ import annotations

import dataclasses
import gc
import math
from dataclasses import dataclass
from typing import Literal

import torch
from hypothesis import strategies as st

from kvcheck import asserts as kvassert
from kvcheck import failures
from kvcheck import sizes as kvsizes
from kvcheck import strategies as kvst
from kvcheck import tensors as kvtensors
from kvcheck.harness import build, random_query
from kvcheck.kit import KitTests, Property, offered, property_test
from kvcheck.properties.requests import (
    PINNED,
    REQUEST_EDGES,
    every_requests_plan,
    request_plans,
    serve,
)
from kvref import BlockTables, CacheFactory, CacheSpec
from kvref.quantized import storage
from kvref.reprs import short_repr

# Words a refusal for want of blocks may use; any one names the problem.
WORDS = (
    "block", "pool", "free", "exhaust", "full", "capacity", "memory", "room", "space",
    "available", "out of", "left", "need", "enough",
)  # fmt: skip


@short_repr
@dataclass(frozen=True)
class ExhaustionPlan:
    """A cache A warmed by ``chunks``; the call tried on a full pool and its extra rows."""

    spec: CacheSpec  # A's spec (no window: every row stays in its block)
    chunks: tuple[int, ...]
    call: Literal["append", "attend", "fork-write"]
    extra: int  # rows beyond the room left in the target's last block and `left` blocks
    left: int  # blocks the filler leaves free: fewer than the call needs

    def describe(self) -> str:
        target = "a fork F of A" if self.call == "fork-write" else "A"
        return (
            f"cache A warmed by appends of {list(self.chunks)} rows, the pool filled up, "
            f"with {self.left} blocks left free, then {self.call} on {target} of the rows "
            f"left in its last block + {self.left} blocks' worth + {self.extra}; built for "
            f"{self.spec}"
        )

    def summary(self) -> tuple[str, str, str]:
        return self.describe(), "1 cache", str(self.spec.batch)


@st.composite
def exhaustion_plans(draw) -> ExhaustionPlan:
    spec = draw(kvst.cache_specs(), label="spec")
    chunks = draw(kvst.chunk_plans(2 * kvst.EDGE + 1, min_chunks=1, max_chunks=3), label="warm")
    calls = ("append", "fork-write") if spec.value_dim else ("append", "attend", "fork-write")
    call = draw(st.sampled_from(calls), label="call")  # attend: no latent form yet
    extra = draw(st.integers(1, 3), label="extra rows")
    left = draw(st.integers(0, 2), label="blocks left")
    room = sum(chunks) + (left + 2) * 2 * kvst.EDGE + 8  # blocks of up to 32 rows
    spec = dataclasses.replace(spec, window=None, max_length=room)
    return ExhaustionPlan(spec, tuple(chunks), call, extra, left)


class _Given:
    """A cache and the rows it was given, to read it back after the refusal."""

    def __init__(self, cache, spec: CacheSpec) -> None:
        self.cache = cache
        self.keys = kvtensors.random_rows(spec, 0, seed=0)
        self.values = kvtensors.random_rows(spec, 0, seed=0, values=True)
        self.storage = storage(cache)  # read back within its bound (contract, 10.1)

    @property
    def quantized_below(self) -> list[int]:
        """Keys' and values' rows that may be in codes: all but the declared recent run."""
        held = self.keys.shape[2]
        return [max(0, held - part.recent) if part else 0 for part in self.storage]

    def append(self, key, value):
        returned = self.cache.append(key.clone(), value.clone())
        self.keys = torch.cat((self.keys, key), dim=2)
        self.values = torch.cat((self.values, value), dim=2)
        return returned


def _state(pool, caches: dict[str, _Given]) -> dict:
    state = {"blocks_in_use": pool.blocks_in_use, "blocks_free": pool.blocks_free}
    for name, given in caches.items():
        state[f"{name}.length"] = given.cache.length
        if isinstance(given.cache, BlockTables):
            state[f"{name}.block_tables"] = given.cache.block_tables
    return state


def fill(pool, spec: CacheSpec, left: int, where: str) -> list:
    """Caches of batch 1 that take a block per append until the pool has ``left`` free (one
    cache, unless the domain's largest max_length holds fewer rows than the pool)."""
    size = pool.block_size
    longest = kvsizes.longest(pool.blocks_free * size + 1)
    filler_spec = dataclasses.replace(spec, batch=1, max_length=longest)
    fillers = []
    while pool.blocks_free > left:
        if not fillers or fillers[-1].length + size > longest:
            fillers.append(build(pool, filler_spec))
        free = pool.blocks_free
        rows = kvtensors.random_rows(filler_spec, size, seed=free)
        value = kvtensors.as_values(filler_spec, rows)
        error = kvassert.raised_by(lambda: fillers[-1].append(rows, value))  # noqa: B023
        if error is not None:
            raise failures.RefusesValidInput(
                f"the pool: blocks_free is {free}, yet an append that needs one block was "
                f"refused with {type(error).__name__}: {error}\n  at {where}"
            ) from error
    return fillers


def check_exhausted_pool(factory: CacheFactory, plan: ExhaustionPlan) -> None:
    """On a pool with fewer free blocks than a call needs, the call is refused and changes
    nothing."""
    spec, size = plan.spec, factory.block_size
    call = plan.call if plan.call.split("-")[0] in offered(factory) else "append"
    held = math.ceil(sum(plan.chunks) / size) * spec.batch
    # Room for A, a full copy of A (a pool may copy at fork), and a filler of two blocks per
    # batch row at least, so that dropping the filler leaves room to read A and F back.
    pool = factory.with_blocks(2 * held + 2 * spec.batch + 1 + plan.left)
    caches = {"A": _Given(build(pool, spec), spec)}
    for step, rows in enumerate(plan.chunks):
        keys = kvtensors.random_rows(spec, rows, seed=step)
        caches["A"].append(keys, kvtensors.random_rows(spec, rows, seed=50 + step, values=True))
    if call == "fork-write":
        fork = _Given(caches["A"].cache.fork(), spec)
        fork.keys, fork.values = caches["A"].keys, caches["A"].values
        caches["F"] = fork
    where = plan.describe()
    free_before_filler = pool.blocks_free
    filler = fill(pool, spec, plan.left, where)
    target = caches["F" if call == "fork-write" else "A"]
    length = target.cache.length
    # Past the room in the last block, more blocks than are left: at least left + 1 per
    # batch row.
    rows = (-length) % size + plan.left * size + plan.extra
    key = kvtensors.random_rows(spec, rows, seed=99)
    before = _state(pool, caches)
    if call == "attend":
        query = random_query(key, seed=98)
        attempt = lambda: target.cache.attend(query, key.clone(), kvtensors.as_values(spec, key, 2))  # noqa: E731
    else:
        attempt = lambda: target.cache.append(key.clone(), kvtensors.as_values(spec, key, 2))  # noqa: E731
    error = kvassert.raised_by(attempt)
    what = f"{call} of {rows} rows on a cache holding {length} in blocks of {size}"
    if error is None:
        raise failures.DataLoss(
            f"the pool: {what} needs more blocks than the pool had free (blocks_free "
            f"{plan.left}), and the call was not refused: blocks_free is wrong or the pool "
            f"overcommits\n"
            f"  at {where}"
        )
    if not isinstance(error, ValueError):
        raise failures.UnclearError(
            f"the pool: {what} on an exhausted pool refused with {type(error).__name__}, not "
            f"ValueError: {error}\n  at {where}"
        ) from error
    after = _state(pool, caches)
    for item, was in before.items():
        if after[item] != was:
            raise failures.RefusalChangedState(
                f"the pool: {item} is {after[item]} after a refused {what}, was {was}\n  at {where}"
            )
    if not any(word in str(error).lower() for word in WORDS):
        raise failures.UnclearError(
            f"the pool: {what} on an exhausted pool refused with {str(error)!r}, a message "
            f"that names neither the pool nor its blocks (a word such as {WORDS[:6]})\n"
            f"  at {where}"
        )
    del filler  # its blocks go back: room to read A (and F) back
    gc.collect()  # the kit freezes older objects around every check: only young ones looked at
    if pool.blocks_free != free_before_filler:
        raise failures.DataLoss(
            f"the pool: blocks_free is {pool.blocks_free} after the filler cache was dropped "
            f"and collected, but was {free_before_filler} before it took its blocks: a "
            f"dropped cache must give its blocks back\n  at {where}"
        )
    for name, given in caches.items():
        row = kvtensors.random_rows(spec, 1, seed=77)
        returned = given.append(row, kvtensors.as_values(spec, row, -1))
        for which, (part, got, want) in enumerate(
            zip(("keys", "values"), returned, (given.keys, given.values), strict=True)
        ):
            bad, beyond = ["all"], ""
            if got.shape == want.shape:
                every = list(range(want.shape[2]))
                bad, beyond = kvassert.rows_not_held(given, which, got, want, every)
            if bad:
                raise failures.RefusalChangedState(
                    f"cache {name}: after a refused {what}, reading it back returned {part} "
                    f"shaped {tuple(got.shape)} unlike the rows given, at rows {bad[:8]} "
                    f"(expected {tuple(want.shape)}){beyond}\n  at {where}"
                )


POOL = Property(
    "pool",
    "a pool's books: blocks in use are the live caches' distinct blocks, tables fit the "
    "rows, nbytes covers them, all back at the end",
    serve,
    request_plans(),
    failures.DATA_LOSS,
    requires=("block pool",),
    pinned=PINNED,
    reaches=REQUEST_EDGES,
    # The requests property's plans, on a tight pool: every interleaving of up to two.
    every_plan=every_requests_plan,
    exhaustive_tokens=4,
    since="1.0",
    holds=(
        "the requests plans on a tight pool, its books checked after every event ([contract.md, "
        '"Block pools"](contract.md#block-pools))'
    ),
)
EXHAUSTED_POOL = Property(
    "exhausted pool",
    "an exhausted pool refuses append, attend and a fork's write with ValueError, changing nothing",
    check_exhausted_pool,
    exhaustion_plans(),
    failures.REFUSAL_CHANGED_STATE,
    requires=("block pool",),
    since="1.0",
    holds=(
        "on a tight pool filled until 0 to 2 blocks are free, an `append`, `attend` or a fork's "
        "write that needs more is refused with `ValueError` naming the pool or its blocks, and "
        "changes nothing, down to the rows read back bit for bit once blocks are free again"
    ),
)


class PoolTests(KitTests):
    """A factory that is a ``kvref.BlockPool`` (a paged pool): run when it is one."""

    test_pool_books_match_the_live_caches = property_test(POOL)
    test_exhausted_pool_refuses_and_changes_nothing = property_test(EXHAUSTED_POOL)
