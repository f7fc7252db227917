"""Style 9: a prefix-caching block pool kept as a radix tree, as SGLang keeps its prefixes.

Written from the contract alone (docs/contract.md, sections 1 to 4, 9.1 and 9.3), in another
style than the built-in pool:

- The index is a trie per root (layer, salt, first position, storage shape): each edge is the
  ``block_size`` token ids of one block, each node the blocks holding that path's rows. A hit
  is a walk down the trie by exact tokens; nothing is hashed (``with_blocks`` takes a
  ``block_hash`` and ignores it). Two requests that wrote the same path each publish their own
  block into its node (twins); a lookup hands out the first one. (SGLang frees the second
  copy and points the request at the tree's; here a cache must keep returning the rows it was
  given, bit for bit, so the copy stays while it is referenced.)
- A node is locked while a live cache references one of its blocks (each block counts its
  references); an unlocked node keeps exactly one block, cached and evictable. An append that
  finds no free id evicts the least recently used unlocked leaf (a timestamp scan), which
  leaves the trie before its block is handed out again.
- Storage is one tensor pair per storage shape (dtype, device, kv heads, head width), indexed
  by block id and grown by doubling up to the room; free ids are a stack, so a freed block is
  reused first. ``append`` returns a gather of the row's blocks, trimmed to ``length``.
- A write into a shared block copies it first; a write into a published block referenced by
  this row alone takes it out of the trie (with whatever hangs below it, all unreferenced).
- ``offload`` copies the rows to CPU tensors and gives every block back; ``restore`` takes
  blocks again, writes the rows back and publishes them again. ``truncate``, ``reorder`` and
  ``fork`` carry the declared tokens with the rows. No ``attend``, no ``append_rows``; a
  window is ignored (every row is kept). Messages are worded in this file's own way.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch import Tensor


class RadixInputError(ValueError):
    """Bad input to a radix pool or to one of its caches; nothing was changed."""


class PoolExhausted(ValueError):
    """The pool has too few free blocks for the call; nothing was changed."""


class _Node:
    """One block-sized step of a prefix: its edge (token ids), the blocks holding its rows."""

    __slots__ = ("blocks", "children", "edge", "parent", "stamp")

    def __init__(self, parent: _Node | None, edge: tuple[int, ...] | None) -> None:
        self.parent = parent
        self.edge = edge
        self.children: dict[tuple[int, ...], _Node] = {}
        self.blocks: list[int] = []
        self.stamp = 0


class _Slab:
    """The keys and values of every block id ever used with one storage shape."""

    def __init__(self, heads: int, rows: int, width: int, dtype, device, limit: int) -> None:
        self.limit = limit
        shape = (0, heads, rows, width)
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)

    def hold(self, block: int) -> None:
        """Grow (by doubling, up to the pool's room) until ``block`` has a slot."""
        size = self.keys.shape[0]
        if block < size:
            return
        grown = min(self.limit, max(block + 1, 2 * size, 8))
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_empty((grown, *old.shape[1:]))
            new[:size] = old
            setattr(self, name, new)

    def copy(self, source: int, target: int) -> None:
        self.keys[target] = self.keys[source]
        self.values[target] = self.values[source]


class RadixPrefixPool:
    """A cache factory whose caches share ``num_blocks`` blocks of ``block_size`` rows and
    find each other's written prefixes in a radix tree."""

    def __init__(self, block_size: int = 4, num_blocks: int = 1 << 16) -> None:
        for name, number, least in (("block_size", block_size, 1), ("num_blocks", num_blocks, 0)):
            if isinstance(number, bool) or not isinstance(number, int) or number < least:
                raise RadixInputError(f"{name} must be an int >= {least}, got {number!r}")
        self.block_size = block_size
        self.room = num_blocks
        self.kv_sizes = {"page": block_size}
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: pop() takes the lowest id
        self._refs: dict[int, int] = {}  # block -> references from live caches' tables
        self._home: dict[int, _Node] = {}  # published block -> its node
        self._roots: dict[tuple, _Node] = {}
        self._nodes: set[_Node] = set()  # every node but the roots, for the eviction scan
        self._slabs: dict[tuple, _Slab] = {}
        self._clock = 0

    def __call__(self, spec) -> RadixPrefixCache:
        return RadixPrefixCache(self, spec)

    def with_blocks(self, num_blocks: int, *, block_hash=None) -> RadixPrefixPool:
        # block_hash is ignored: the tree keys blocks by their tokens themselves.
        return RadixPrefixPool(self.block_size, num_blocks)

    # The books (contract, 9.1).
    @property
    def blocks_in_use(self) -> int:
        return len(self._refs)

    @property
    def blocks_free(self) -> int:
        return self.room - len(self._refs)

    @property
    def blocks_cached(self) -> int:
        return len(self._home)

    @property
    def blocks_evictable(self) -> int:
        return sum(1 for block in self._home if block not in self._refs)

    def lookup_prefix(self, caches, tokens, *, salt=None) -> int:
        """Declare ``tokens`` to one request's empty caches (layer i is ``caches[i]``) and
        make each hold the longest whole-block prefix every row and layer finds; its length."""
        caches = self._check_lookup(caches, tokens, salt)
        rows = tokens.tolist()
        size = self.block_size
        paths = []
        for layer, cache in enumerate(caches):
            root = self._roots.get(cache._root_key(layer, salt))
            most = min(len(rows[0]), cache.spec.max_length) // size
            paths.append([self._walk(root, row, most) for row in rows])
        hit = min((len(path) for layer_paths in paths for path in layer_paths), default=0)
        for layer, (cache, layer_paths) in enumerate(zip(caches, paths, strict=True)):
            cache._take_hit(layer, salt, rows, [path[:hit] for path in layer_paths])
        return hit * size

    def _check_lookup(self, caches, tokens, salt) -> list[RadixPrefixCache]:
        if not isinstance(caches, Sequence) or isinstance(caches, str) or not caches:
            raise RadixInputError(
                "lookup_prefix: caches must be a non-empty list of one request's caches, one "
                f"per layer; got {type(caches).__name__}"
            )
        caches = list(caches)
        for layer, cache in enumerate(caches):
            if not isinstance(cache, RadixPrefixCache) or cache.pool is not self:
                raise RadixInputError(
                    f"lookup_prefix: the cache of layer {layer} is not of this pool"
                )
            if cache.offloaded or cache.length:
                raise RadixInputError(
                    f"lookup_prefix: the cache of layer {layer} is not empty (length "
                    f"{cache.length}{', offloaded' if cache.offloaded else ''})"
                )
        if len({id(cache) for cache in caches}) != len(caches):
            raise RadixInputError("lookup_prefix: one cache object is given for two layers")
        try:
            hash(salt)
        except TypeError:
            raise RadixInputError(f"lookup_prefix: salt {salt!r} cannot key a tree") from None
        batches = {cache.spec.batch for cache in caches}
        if len(batches) > 1:
            raise RadixInputError(f"lookup_prefix: caches of different batches {sorted(batches)}")
        _check_tokens("lookup_prefix", tokens, batches.pop())
        return caches

    def _walk(self, root: _Node | None, row: list[int], most: int) -> list[_Node]:
        path: list[_Node] = []
        node = root
        size = self.block_size
        while node is not None and len(path) < most:
            start = len(path) * size
            node = node.children.get(tuple(row[start : start + size]))
            if node is not None:
                path.append(node)
        return path

    # Blocks: taking, sharing, giving back.
    def _slab(self, spec) -> _Slab:
        key = _storage_key(spec)
        if key not in self._slabs:
            self._slabs[key] = _Slab(
                spec.kv_heads, self.block_size, spec.head_dim, spec.dtype, spec.device, self.room
            )
        return self._slabs[key]

    def _take(self, count: int, slab: _Slab) -> list[int]:
        if count > self.blocks_free:
            raise PoolExhausted(
                f"block pool exhausted: the call needs {count} more blocks, "
                f"{self.blocks_free} of the pool's {self.room} are free"
            )
        taken = []
        for _ in range(count):
            block = self._free.pop() if self._free else self._evict()
            self._refs[block] = 1
            slab.hold(block)
            taken.append(block)
        return taken

    def _share(self, block: int) -> None:
        # A hit may reference a cached block no one referenced: it is in use from then on.
        self._refs[block] = self._refs.get(block, 0) + 1

    def _release(self, block: int) -> None:
        left = self._refs[block] - 1
        if left:
            self._refs[block] = left
            return
        del self._refs[block]
        home = self._home.get(block)
        if home is None:
            self._free.append(block)
        elif len(home.blocks) > 1:  # a twin: the node keeps another copy of these rows
            home.blocks.remove(block)
            del self._home[block]
            self._free.append(block)
        # else: the node's only block stays published, cached and evictable

    def _evict(self) -> int:
        # The least recently used unlocked leaf (an unlocked node's subtree is all unlocked,
        # so there is one whenever a cached block is unreferenced).
        victim = min(
            (
                node
                for node in self._nodes
                if not node.children and all(block not in self._refs for block in node.blocks)
            ),
            key=lambda node: node.stamp,
        )
        (block,) = victim.blocks
        del victim.parent.children[victim.edge]
        self._nodes.discard(victim)
        del self._home[block]
        return block

    # The tree.
    def _root(self, key: tuple) -> _Node:
        if key not in self._roots:
            self._roots[key] = _Node(None, None)
        return self._roots[key]

    def _touch(self, node: _Node) -> None:
        self._clock += 1
        node.stamp = self._clock

    def _publish(self, parent: _Node, edge: tuple[int, ...], block: int) -> _Node:
        node = parent.children.get(edge)
        if node is None:
            node = parent.children[edge] = _Node(parent, edge)
            self._nodes.add(node)
        for other in [b for b in node.blocks if b not in self._refs]:
            node.blocks.remove(other)  # an unreferenced copy of the same rows: not needed
            del self._home[other]
            self._free.append(other)
        node.blocks.append(block)
        self._home[block] = node
        return node

    def _unpublish(self, block: int) -> None:
        node = self._home.pop(block)
        node.blocks.remove(block)
        if not node.blocks:
            self._cut(node)

    def _cut(self, top: _Node) -> None:
        """Take ``top`` and everything under it out of the tree."""
        del top.parent.children[top.edge]
        stack = [top]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            self._nodes.discard(node)
            for block in node.blocks:
                del self._home[block]
                if block not in self._refs:
                    self._free.append(block)


def _give_back(pool: RadixPrefixPool, tables: list[list[int]]) -> None:
    for table in tables:
        for block in table:
            pool._release(block)
        table.clear()


def _storage_key(spec) -> tuple:
    return (str(spec.dtype), str(torch.device(spec.device)), spec.kv_heads, spec.head_dim)


def _check_tokens(where: str, tokens: object, batch: int) -> None:
    if not isinstance(tokens, Tensor):
        raise RadixInputError(f"{where}: tokens must be a tensor, got {type(tokens).__name__}")
    if tokens.dtype != torch.int64:
        raise RadixInputError(f"{where}: tokens must be int64 ids, got dtype {tokens.dtype}")
    if tokens.ndim != 2 or tokens.shape[0] != batch:
        raise RadixInputError(
            f"{where}: tokens must be shaped (batch, T) with batch {batch}, got "
            f"{tuple(tokens.shape)}"
        )


class RadixPrefixCache:
    """One layer of one request, its rows in blocks of the pool (one table per batch row)."""

    def __init__(self, pool: RadixPrefixPool, spec) -> None:
        self.pool = pool
        self.spec = spec
        self._slab = pool._slab(spec)
        self._tables: list[list[int]] = [[] for _ in range(spec.batch)]  # changed in place
        self._anchors: list[list[_Node]] = [[] for _ in range(spec.batch)]
        self._tokens: list[list[int]] = [[] for _ in range(spec.batch)]
        self._key: tuple | None = None  # the tree root this cache publishes under
        self._undeclared_from: int | None = None  # rows from here on were given undeclared
        self._count = 0
        self._host: tuple[Tensor, Tensor] | None = None
        weakref.finalize(self, _give_back, pool, self._tables)

    @property
    def length(self) -> int:
        return self._count

    @property
    def nbytes(self) -> int:
        if self._host is not None:
            return self._host[0].nbytes + self._host[1].nbytes
        s = self.spec
        per_block = 2 * s.kv_heads * self.pool.block_size * s.head_dim * _itemsize(s.dtype)
        return per_block * sum(len(table) for table in self._tables)

    @property
    def block_tables(self) -> list[list[int]]:
        return [list(table) for table in self._tables]

    @property
    def offloaded(self) -> bool:
        return self._host is not None

    def reset(self) -> None:
        _give_back(self.pool, self._tables)
        self._anchors = [[] for _ in self._tables]
        self._tokens = [[] for _ in self._tables]
        self._key = None
        self._undeclared_from = None
        self._count = 0
        self._host = None

    def declare_tokens(self, tokens: Tensor) -> None:
        self._not_offloaded("declare_tokens")
        _check_tokens("declare_tokens", tokens, len(self._tables))
        for row, ids in zip(self._tokens, tokens.tolist(), strict=True):
            row.extend(ids)

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        self._not_offloaded("append")
        new = self._check_rows(key, value)
        self._make_room(new)  # may refuse, before anything changed
        self._scatter(self._count, key, value)
        self._count += new
        declared = len(self._tokens[0])
        if declared < self._count and self._undeclared_from is None:
            self._undeclared_from = declared
        self._publish_full_blocks()
        return self._gather()

    def truncate(self, length: int) -> None:
        self._not_offloaded("truncate")
        if isinstance(length, bool) or not isinstance(length, int):
            raise RadixInputError(f"truncate: length must be an int, not {length!r}")
        if not 0 <= length <= self._count:
            raise RadixInputError(f"truncate: length {length} outside 0..{self._count}")
        size = self.pool.block_size
        keep = -(-length // size)
        for row, table in enumerate(self._tables):
            for block in table[keep:]:
                self.pool._release(block)
            del table[keep:]
            del self._anchors[row][length // size :]
            del self._tokens[row][length:]
        if self._undeclared_from is not None and length <= self._undeclared_from:
            self._undeclared_from = None
        self._count = length
        # A kept, partly filled block may still be published: it is copied or taken out of
        # the tree when it is written again (_make_room), and is read only up to length.

    def reorder(self, indices: Tensor) -> None:
        self._not_offloaded("reorder")
        batch = len(self._tables)
        if not isinstance(indices, Tensor):
            raise RadixInputError(
                f"reorder: indices must be a tensor, not {type(indices).__name__}"
            )
        wanted = torch.device(self.spec.device)
        if (
            indices.dtype != torch.int64
            or tuple(indices.shape) != (batch,)
            or indices.device.type != wanted.type
            or wanted.index not in (None, indices.device.index)
        ):
            raise RadixInputError(
                f"reorder: indices must be int64 of shape ({batch},) on {wanted}; got "
                f"{indices.dtype} {tuple(indices.shape)} on {indices.device}"
            )
        order = indices.tolist()
        if any(not 0 <= i < batch for i in order):
            raise RadixInputError(f"reorder: indices {order} must lie in [0, {batch})")
        tables = [list(self._tables[i]) for i in order]
        for table in tables:
            for block in table:
                self.pool._share(block)
        for table in self._tables:
            for block in table:
                self.pool._release(block)
        self._tables[:] = tables
        self._anchors = [list(self._anchors[i]) for i in order]
        self._tokens = [list(self._tokens[i]) for i in order]

    def fork(self) -> RadixPrefixCache:
        self._not_offloaded("fork")
        child = RadixPrefixCache(self.pool, self.spec)
        for row, table in enumerate(self._tables):
            for block in table:
                self.pool._share(block)
            child._tables[row].extend(table)
        child._anchors = [list(anchors) for anchors in self._anchors]
        child._tokens = [list(tokens) for tokens in self._tokens]
        child._key = self._key
        child._undeclared_from = self._undeclared_from
        child._count = self._count
        return child

    def offload(self) -> None:
        self._not_offloaded("offload")
        keys, values = self._gather()
        self._host = (keys.to("cpu", copy=True), values.to("cpu", copy=True))
        _give_back(self.pool, self._tables)
        self._anchors = [[] for _ in self._tables]

    def restore(self) -> None:
        if self._host is None:
            raise RadixInputError("restore: this cache is not offloaded")
        per_row = -(-self._count // self.pool.block_size)
        taken = self.pool._take(per_row * len(self._tables), self._slab)  # may refuse
        for row, table in enumerate(self._tables):
            table.extend(taken[row * per_row : (row + 1) * per_row])
        keys, values = self._host
        self._host = None
        if self._count:
            device = torch.device(self.spec.device)
            self._scatter(0, keys.to(device), values.to(device))
        self._publish_full_blocks()

    # Inner workings.
    def _root_key(self, layer: int, salt) -> tuple:
        return (layer, salt, 0, *_storage_key(self.spec))  # 0: the first position

    def _take_hit(self, layer: int, salt, rows: list[list[int]], paths: list[list[_Node]]) -> None:
        self._key = self._root_key(layer, salt)
        self._tokens = [list(row) for row in rows]
        self._undeclared_from = None
        for row, path in enumerate(paths):
            for node in path:
                block = node.blocks[0]
                self.pool._share(block)
                self.pool._touch(node)
                self._tables[row].append(block)
            self._anchors[row] = list(path)
        self._count = len(paths[0]) * self.pool.block_size if paths else 0

    def _not_offloaded(self, what: str) -> None:
        if self._host is not None:
            raise RadixInputError(f"{what}: the cache's rows are offloaded; restore() first")

    def _check_rows(self, key: object, value: object) -> int:
        s = self.spec
        for name, tensor in (("key", key), ("value", value)):
            if not isinstance(tensor, Tensor):
                raise RadixInputError(f"{name} is a {type(tensor).__name__}, not a tensor")
        if key.ndim != 4 or value.ndim != 4:
            raise RadixInputError(
                f"key and value need 4 dims (B, H_kv, T, D), got ndim {key.ndim} and {value.ndim}"
            )
        if key.shape != value.shape:
            raise RadixInputError(
                f"key {tuple(key.shape)} and value {tuple(value.shape)} do not match"
            )
        batch, heads, new, width = key.shape
        for axis, got, want in (
            ("batch", batch, s.batch),
            ("kv_heads", heads, s.kv_heads),
            ("head_dim", width, s.head_dim),
        ):
            if got != want:
                raise RadixInputError(
                    f"{axis} {got} where this cache holds {want} (shape {tuple(key.shape)})"
                )
        if new == 0:
            raise RadixInputError("zero tokens given: append at least one")
        wanted = torch.device(s.device)
        for name, tensor in (("key", key), ("value", value)):
            if tensor.dtype != s.dtype:
                raise RadixInputError(f"{name} dtype {tensor.dtype}; this cache holds {s.dtype}")
            if tensor.device.type != wanted.type or wanted.index not in (
                None,
                tensor.device.index,
            ):
                raise RadixInputError(
                    f"{name} on device {tensor.device}; this cache is on {wanted}"
                )
        if self._count + new > s.max_length:
            raise RadixInputError(
                f"{self._count} held + {new} new tokens would exceed max_length {s.max_length}"
            )
        return new

    def _make_room(self, new: int) -> None:
        """Give every row a writable block for each position of the next ``new`` rows."""
        size = self.pool.block_size
        at = self._count // size  # the block the first new row lands in
        blocks_after = -(-(self._count + new) // size)
        fresh = blocks_after - len(self._tables[0])
        copies, private = [], []
        for row, table in enumerate(self._tables):
            if at < len(table):  # a partly filled block, written again
                block = table[at]
                if self.pool._refs[block] > 1:
                    copies.append(row)
                elif block in self.pool._home:
                    private.append(block)
        taken = self.pool._take(len(copies) + fresh * len(self._tables), self._slab)
        for row in copies:
            source, target = self._tables[row][at], taken.pop()
            self._slab.copy(source, target)
            self._tables[row][at] = target
            self.pool._release(source)
        for block in private:
            self.pool._unpublish(block)
        for table in self._tables:
            table.extend(taken.pop() for _ in range(fresh))

    def _scatter(self, start: int, key: Tensor, value: Tensor) -> None:
        size = self.pool.block_size
        device = torch.device(self.spec.device)
        positions = range(start, start + key.shape[2])
        blocks = torch.tensor(
            [[table[p // size] for p in positions] for table in self._tables], device=device
        )
        slots = torch.tensor([p % size for p in positions], device=device).expand_as(blocks)
        self._slab.keys[blocks, :, slots] = key.permute(0, 2, 1, 3)
        self._slab.values[blocks, :, slots] = value.permute(0, 2, 1, 3)

    def _gather(self) -> tuple[Tensor, Tensor]:
        s = self.spec
        if not self._count:
            empty = (s.batch, s.kv_heads, 0, s.head_dim)
            return (
                torch.empty(empty, dtype=s.dtype, device=s.device),
                torch.empty(empty, dtype=s.dtype, device=s.device),
            )
        ids = torch.tensor(self._tables, device=torch.device(s.device))
        out = []
        for slab in (self._slab.keys, self._slab.values):
            rows = slab[ids].permute(0, 2, 1, 3, 4)  # (B, H, blocks, block_size, D), a copy
            out.append(rows.reshape(s.batch, s.kv_heads, -1, s.head_dim)[:, :, : self._count])
        return out[0], out[1]

    def _publish_full_blocks(self) -> None:
        """Publish every block whose positions are all written and declared."""
        if self._key is None:
            return  # never looked up: no tokens to key by
        size = self.pool.block_size
        keyed = min(self._count, len(self._tokens[0]))
        if self._undeclared_from is not None:
            keyed = min(keyed, self._undeclared_from)
        full = keyed // size
        for table, anchors, tokens in zip(self._tables, self._anchors, self._tokens, strict=True):
            while len(anchors) < full:
                index = len(anchors)
                parent = anchors[-1] if anchors else self.pool._root(self._key)
                edge = tuple(tokens[index * size : (index + 1) * size])
                block = table[index]
                home = self.pool._home.get(block)
                if home is None:
                    home = self.pool._publish(parent, edge, block)
                elif home.parent is not parent or home.edge != edge:
                    break  # published for other tokens (declared inconsistently): stop here
                self.pool._touch(home)
                anchors.append(home)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
