"""Style 8: a paged pool whose free list is a FIFO queue and whose blocks are separate tensors.

Deliberately different from the built-in pool: each block id owns a pair of tensors of its
own (made when the id is first handed out for a spec of that shape, kept and reused after,
stale rows and all); freed ids join the back of a queue, so a freed block is reused only
after every other free one; forks never write a shared block because they never share a
partly filled one: a fork shares the full blocks and copies the partly filled last block at
once (as does a truncate that ends inside a shared block), so copy-on-write happens at fork
time, not at the next write. Attention gathers the blocks into one run of rows and takes
``logsumexp`` over the scores, with its own masks. Validation is one table of checks;
messages are short. ``truncate`` is offered; ``reorder`` is not.
"""

from __future__ import annotations

import math
import weakref
from collections import deque

import torch
from torch import Tensor


class FifoPagedPool:
    """A cache factory owning ``num_blocks`` blocks of ``block_size`` rows each."""

    def __init__(self, block_size: int = 8, num_blocks: int = 4096) -> None:
        self.block_size = block_size
        self.capacity = num_blocks
        self._queue: deque[int] = deque(range(num_blocks))
        self._refs: dict[int, int] = {}
        self._tensors: dict[int, tuple[Tensor, Tensor]] = {}

    def __call__(self, spec) -> FifoPagedCache:
        return FifoPagedCache(self, spec)

    def with_blocks(self, num_blocks: int) -> FifoPagedPool:
        return FifoPagedPool(self.block_size, num_blocks)

    @property
    def blocks_in_use(self) -> int:
        return len(self._refs)

    @property
    def blocks_free(self) -> int:
        return len(self._queue)

    def take(self, count: int, spec) -> list[int]:
        if count > len(self._queue):
            raise ValueError(f"pool exhausted: need {count} blocks, {len(self._queue)} free")
        taken = [self._queue.popleft() for _ in range(count)]
        shape = (spec.kv_heads, self.block_size, spec.head_dim)
        for block in taken:
            self._refs[block] = 1
            old = self._tensors.get(block)
            if old is None or old[0].shape != shape or old[0].dtype != spec.dtype:
                pair = [torch.zeros(shape, dtype=spec.dtype, device=spec.device) for _ in "kv"]
                self._tensors[block] = (pair[0], pair[1])
        return taken

    def share(self, blocks: list[int]) -> None:
        for block in blocks:
            self._refs[block] += 1

    def give_back(self, blocks: list[int]) -> None:
        for block in blocks:
            self._refs[block] -= 1
            if self._refs[block] == 0:
                del self._refs[block]
                self._queue.append(block)

    def shared(self, block: int) -> bool:
        return self._refs[block] > 1

    def rows(self, block: int) -> tuple[Tensor, Tensor]:
        return self._tensors[block]


def _release(pool: FifoPagedPool, tables: list[list[int]]) -> None:
    for table in tables:
        pool.give_back(table)


class FifoPagedCache:
    def __init__(self, pool: FifoPagedPool, spec, *, tables=None, count: int = 0) -> None:
        self.pool = pool
        self.spec = spec
        self._tables: list[list[int]] = tables or [[] for _ in range(spec.batch)]
        self._count = count
        # The blocks go back when the cache is collected; the finalizer holds the list of
        # tables (changed in place from then on), never the cache.
        weakref.finalize(self, _release, pool, self._tables)

    @property
    def length(self) -> int:
        return self._count

    @property
    def nbytes(self) -> int:
        s = self.spec
        per_block = 2 * s.kv_heads * self.pool.block_size * s.head_dim * _itemsize(s.dtype)
        return per_block * sum(len(table) for table in self._tables)

    @property
    def block_tables(self) -> list[list[int]]:
        return [list(table) for table in self._tables]

    def reset(self) -> None:
        self._drop_from(0)
        self._count = 0

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        self._write(key, value)
        return self._gather()

    def attend(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        s = self.spec
        if not isinstance(query, Tensor):
            raise TypeError(f"query: expected a Tensor, got {type(query).__name__}")
        self._check(key, value)
        new = key.shape[2]
        heads = query.shape[1] if query.dim() == 4 else 0
        if (
            query.dim() != 4
            or heads % s.kv_heads
            or (query.shape[0], query.shape[2], query.shape[3]) != (s.batch, new, s.head_dim)
            or query.dtype != s.dtype
        ):
            raise ValueError(
                f"query {tuple(query.shape)} {query.dtype} does not fit keys of "
                f"{tuple(key.shape)} (heads must be a multiple of {s.kv_heads})"
            )
        self._write(key, value)
        keys, values = self._gather()
        group = heads // s.kv_heads
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        end = self._count
        query_at = torch.arange(end - new, end, device=query.device)[:, None]
        key_at = torch.arange(end, device=query.device)[None, :]
        hidden = key_at > query_at
        if s.window is not None:
            hidden |= key_at <= query_at - s.window
        # Half precision is summed in float32 and rounded once, as the contract asks of an
        # attend (docs/contract.md, "The two paths through a cache").
        wide = torch.promote_types(s.dtype, torch.float32)
        query, keys, values = query.to(wide), keys.to(wide), values.to(wide)
        scores = torch.einsum("bhqd,bhkd->bhqk", query, keys) * (1.0 / math.sqrt(s.head_dim))
        scores = scores.masked_fill(hidden, -math.inf)
        weights = torch.exp(scores - torch.logsumexp(scores, dim=-1, keepdim=True))
        return torch.einsum("bhqk,bhkd->bhqd", weights, values).to(s.dtype)

    def fork(self) -> FifoPagedCache:
        full, partial = divmod(self._count, self.pool.block_size)
        copies = self.pool.take(len(self._tables) if partial else 0, self.spec)  # may refuse
        tables = []
        for row, table in enumerate(self._tables):
            self.pool.share(table[:full])
            tables.append(table[:full])
            if partial:
                self._copy_block(table[full], copies[row])
                tables[-1].append(copies[row])
        return FifoPagedCache(self.pool, self.spec, tables=tables, count=self._count)

    def truncate(self, length: int) -> None:
        if isinstance(length, bool) or not isinstance(length, int):
            raise ValueError(f"truncate needs an int, got {length!r}")
        if not 0 <= length <= self._count:
            raise ValueError(f"truncate to {length}: outside 0..{self._count}")
        keep = -(-length // self.pool.block_size)
        partial = length % self.pool.block_size
        # A partly kept block will be written again: it must be this cache's alone.
        must_copy = [
            row
            for row, table in enumerate(self._tables)
            if partial and self.pool.shared(table[keep - 1])
        ]
        copies = self.pool.take(len(must_copy), self.spec)
        for row, block in zip(must_copy, copies, strict=True):
            old = self._tables[row][keep - 1]
            self._copy_block(old, block)
            self._tables[row][keep - 1] = block
            self.pool.give_back([old])
        self._drop_from(keep)
        self._count = length

    def _drop_from(self, keep: int) -> None:
        for table in self._tables:
            self.pool.give_back(table[keep:])
            del table[keep:]

    def _copy_block(self, source: int, target: int) -> None:
        for old, new in zip(self.pool.rows(source), self.pool.rows(target), strict=True):
            new.copy_(old)

    def _write(self, key: object, value: object) -> None:
        self._check(key, value)
        size = self.pool.block_size
        new = key.shape[2]
        needed = -(-(self._count + new) // size) - -(-self._count // size)
        taken = self.pool.take(needed * self.spec.batch, self.spec)
        for row, table in enumerate(self._tables):
            table.extend(taken[row * needed : (row + 1) * needed])
        written = 0
        while written < new:  # one run of rows per block touched
            block, slot = divmod(self._count + written, size)
            rows = min(size - slot, new - written)
            for row, table in enumerate(self._tables):
                k_block, v_block = self.pool.rows(table[block])
                k_block[:, slot : slot + rows] = key[row, :, written : written + rows]
                v_block[:, slot : slot + rows] = value[row, :, written : written + rows]
            written += rows
        self._count += new

    def _gather(self) -> tuple[Tensor, Tensor]:
        s = self.spec
        out = []
        for which in (0, 1):
            rows = [
                torch.cat([self.pool.rows(b)[which] for b in table], dim=1)[:, : self._count]
                if table
                else torch.zeros(s.kv_heads, 0, s.head_dim, dtype=s.dtype, device=s.device)
                for table in self._tables
            ]
            out.append(torch.stack(rows))
        return out[0], out[1]

    def _check(self, key: object, value: object) -> None:
        s = self.spec
        for name, x in (("key", key), ("value", value)):
            if not isinstance(x, Tensor):
                raise TypeError(f"{name}: expected a Tensor, got {type(x).__name__}")
        problems = [
            (key.dim() != 4 or value.dim() != 4, f"rank: key {key.dim()}-D, value {value.dim()}-D"),
            (key.shape != value.shape, f"key {tuple(key.shape)} vs value {tuple(value.shape)}"),
        ]
        for message in (text for bad, text in problems if bad):
            raise ValueError(message)
        b, h, t, d = key.shape
        if (b, h, d) != (s.batch, s.kv_heads, s.head_dim):
            built = (s.batch, s.kv_heads, s.head_dim)
            raise ValueError(f"(B, H, D) = ({b}, {h}, {d}), built for {built}")
        if t == 0:
            raise ValueError("T = 0: nothing to store")
        if key.dtype != s.dtype or value.dtype != s.dtype:
            raise ValueError(f"dtype {key.dtype}/{value.dtype}, built for {s.dtype}")
        wanted = torch.device(s.device)
        for x in (key, value):
            if x.device.type != wanted.type or wanted.index not in (None, x.device.index):
                raise ValueError(f"device {x.device}, built for {wanted}")


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
