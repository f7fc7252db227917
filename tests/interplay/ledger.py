"""Style: a block pool whose allocator keeps a ledger of what each cache owes it, as a
serving engine's block manager keeps a block list per sequence id, with swapping.

Each cache registers with the pool under an owner id. ``append`` takes blocks through
``pool.take(owner, count)``, which hands out ids from a free stack and writes them in the
ledger under the owner; ``truncate`` gives single blocks back (``give_back``); ``reset`` and
the cache's finalizer settle the owner's account in one call (``settle``: everything the
ledger says it owes goes back). The cache keeps its own block tables for reading. Each block
id has its own key and value tensors, made the first time it serves a spec and reused after
(stale rows and all: a cache reads only the rows it wrote). ``offload`` copies the rows to
host tensors and settles the account; ``restore`` checks for room, allocates blocks for the
rows and copies them back.

The one bug (``RestoreSkipsLedger``): ``restore`` allocates with the allocator's raw call
(``pool.allocate(count)``: the swap-in path builds its tables from the host copy, not
through ``take``) and never enters the blocks in the ledger.

- First event: ``offload`` then ``restore`` (a request swapped out under memory pressure and
  back in), leaving "blocks in the tables that the ledger does not list".
- Second event: ``reset`` or the cache being dropped (the request finishes), or a
  ``truncate`` followed by one.
- A correct cache gives every block back when it finishes; this one settles a ledger that
  lacks the restored blocks, so they never return: the pool's ``blocks_in_use`` stays above
  the live tables' ids, and a tight pool runs dry. Restored rows read back bit for bit, and
  appends after a restore are entered as usual (their blocks come back), so every answer
  stays right: only the books show it.

Stands for swap-in paths that rebuild a sequence's block table outside the allocator's
bookkeeping (BUGS.md class 9 of its table, "swap mapping errors", and section 7 on offload
and preemption), and for the leak class of the catalogue's ``TruncateLeaksBlocks``: the
answers stay right while a pool runs dry. The twin (``RestoreEntersLedger``) records them.
"""

from __future__ import annotations

import itertools
import math
import weakref

import torch
from torch import Tensor

from kvref import check_append, check_truncate


class RestoreSkipsLedger:
    """The pool (the factory the kit takes: ``block_size``, ``blocks_in_use``,
    ``blocks_free``, ``with_blocks``)."""

    record_restores = False  # the bug: restored blocks are not entered in the ledger

    def __init__(self, block_size: int = 4, num_blocks: int = 4096) -> None:
        self.block_size = block_size
        self.capacity = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: the lowest id on top
        self._ledger: dict[int, list[int]] = {}
        self._owners = itertools.count()
        self._tensors: dict[tuple[int, tuple], tuple[Tensor, Tensor]] = {}

    @property
    def __name__(self) -> str:  # the label the kit shows for a factory
        return type(self).__name__

    def __call__(self, spec) -> LedgerCache:
        return LedgerCache(self, spec)

    def with_blocks(self, num_blocks: int) -> RestoreSkipsLedger:
        return type(self)(self.block_size, num_blocks)

    @property
    def blocks_in_use(self) -> int:
        return self.capacity - len(self._free)

    @property
    def blocks_free(self) -> int:
        return len(self._free)

    # --- the allocator ---------------------------------------------------------------

    def register(self) -> int:
        owner = next(self._owners)
        self._ledger[owner] = []
        return owner

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise ValueError(
                f"block pool exhausted: {count} blocks needed, {len(self._free)} free of "
                f"{self.capacity}"
            )
        return [self._free.pop() for _ in range(count)]

    def take(self, owner: int, count: int) -> list[int]:
        ids = self.allocate(count)
        self._ledger[owner].extend(ids)
        return ids

    def record(self, owner: int, ids: list[int]) -> None:
        self._ledger[owner].extend(ids)

    def give_back(self, owner: int, ids: list[int]) -> None:
        owed = self._ledger[owner]
        for block in ids:
            if block in owed:
                owed.remove(block)
            self._free.append(block)

    def settle(self, owner: int) -> None:
        """Everything the ledger says ``owner`` holds goes back to the free stack."""
        self._free.extend(reversed(self._ledger[owner]))
        self._ledger[owner] = []

    def close(self, owner: int) -> None:
        self.settle(owner)
        del self._ledger[owner]

    def tensors(self, block: int, spec) -> tuple[Tensor, Tensor]:
        shape = (spec.kv_heads, spec.head_dim, spec.value_width, spec.dtype, str(spec.device))
        pair = self._tensors.get((block, shape))
        if pair is None:
            like = {"dtype": spec.dtype, "device": spec.device}
            rows = (spec.kv_heads, self.block_size)
            pair = (
                torch.zeros((*rows, spec.head_dim), **like),
                torch.zeros((*rows, spec.value_width), **like),
            )
            self._tensors[(block, shape)] = pair
        return pair


class LedgerCache:
    def __init__(self, pool: RestoreSkipsLedger, spec) -> None:
        self.pool, self.spec = pool, spec
        self._owner = pool.register()
        self._tables: list[list[int]] = [[] for _ in range(spec.batch)]
        self._n = 0
        self._host: tuple[Tensor, Tensor] | None = None  # the rows while offloaded
        weakref.finalize(self, pool.close, self._owner)

    @property
    def length(self) -> int:
        return self._n

    @property
    def offloaded(self) -> bool:
        return self._host is not None

    @property
    def block_tables(self) -> list[list[int]]:
        return [list(table) for table in self._tables]

    @property
    def nbytes(self) -> int:
        if self._host is not None:
            return self._host[0].nbytes + self._host[1].nbytes
        s = self.spec
        per_block = s.kv_heads * self.pool.block_size * (s.head_dim + s.value_width)
        return sum(map(len, self._tables)) * per_block * s.dtype.itemsize

    def _blocks(self, length: int) -> int:
        return math.ceil(length / self.pool.block_size)

    def _gather(self) -> tuple[Tensor, Tensor]:
        keys, values = [], []
        for table in self._tables:
            pairs = [self.pool.tensors(block, self.spec) for block in table]
            if pairs:
                keys.append(torch.cat([k for k, _ in pairs], dim=1)[:, : self._n])
                values.append(torch.cat([v for _, v in pairs], dim=1)[:, : self._n])
        if not keys:
            s, like = self.spec, {"dtype": self.spec.dtype, "device": self.spec.device}
            return (
                torch.zeros((s.batch, s.kv_heads, 0, s.head_dim), **like),
                torch.zeros((s.batch, s.kv_heads, 0, s.value_width), **like),
            )
        return torch.stack(keys), torch.stack(values)

    def _write(self, key: Tensor, value: Tensor, at: int) -> None:
        """Rows ``key``/``value`` (B, H, T, D) into the blocks of positions at .. at+T-1."""
        size, end = self.pool.block_size, at + key.shape[2]
        position = at
        while position < end:  # one block's share of the rows at a time
            block, slot = divmod(position, size)
            count = min(size - slot, end - position)
            for row, table in enumerate(self._tables):
                k, v = self.pool.tensors(table[block], self.spec)
                k[:, slot : slot + count] = key[row, :, position - at : position - at + count]
                v[:, slot : slot + count] = value[row, :, position - at : position - at + count]
            position += count

    def _not_offloaded(self, call: str) -> None:
        if self._host is not None:
            raise ValueError(f"{call}: the cache is offloaded; restore() it first")

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        new = check_append(self.spec, self._n, key, value)
        self._not_offloaded("append")
        more = self._blocks(self._n + new) - self._blocks(self._n)
        ids = self.pool.take(self._owner, more * self.spec.batch)  # refuses before any change
        for row, table in enumerate(self._tables):
            table.extend(ids[row * more : (row + 1) * more])
        self._write(key, value, self._n)
        self._n += new
        return self._gather()

    def truncate(self, length: int) -> None:
        check_truncate(self._n, length)
        self._not_offloaded("truncate")
        keep = self._blocks(length)
        for table in self._tables:
            self.pool.give_back(self._owner, table[keep:])
            del table[keep:]
        self._n = length

    def reset(self) -> None:
        self.pool.settle(self._owner)
        self._tables = [[] for _ in range(self.spec.batch)]
        self._n = 0
        self._host = None

    def offload(self) -> None:
        self._not_offloaded("offload")
        keys, values = self._gather()
        self._host = (keys.cpu().clone(), values.cpu().clone())
        self.pool.settle(self._owner)
        self._tables = [[] for _ in range(self.spec.batch)]

    def restore(self) -> None:
        if self._host is None:
            raise ValueError("restore: the cache is not offloaded")
        per_row = self._blocks(self._n)
        ids = self.pool.allocate(per_row * self.spec.batch)  # refuses before any change
        if self.pool.record_restores:
            self.pool.record(self._owner, ids)
        # Bug (record_restores False): the ledger never hears of these blocks.
        self._tables = [ids[row * per_row : (row + 1) * per_row] for row in range(self.spec.batch)]
        keys, values = self._host
        self._host = None
        device = torch.device(self.spec.device)
        self._write(keys.to(device), values.to(device), 0)


class RestoreEntersLedger(RestoreSkipsLedger):
    """The twin pool: restored blocks are entered in the ledger."""

    record_restores = True


RESTORE_SKIPS_LEDGER = RestoreSkipsLedger()
RESTORE_ENTERS_LEDGER = RestoreEntersLedger()
