"""SGLang's prefix cache under the kit: its ``RadixCache`` and ``PagedTokenToKVPoolAllocator``
doing the bookkeeping of a prefix-caching block pool (contract, sections 9.1 and 9.3).

What is SGLang's and what is ours:

- **The engine's** (loaded from the installed ``sglang`` wheel's own source files, unchanged):
  ``sglang/srt/mem_cache/radix_cache.py`` (``RadixCache``, ``RadixKey``: match, insert,
  split, evict, ``inc_lock_ref``/``dec_lock_ref``, the evictable and protected sizes),
  ``base_prefix_cache.py``, ``cache_init_params.py``, ``events.py``, ``evict_policy.py``,
  ``utils.py``, ``environ.py``, ``cpp_utils/native_hash.py``,
  ``unified_cache/component_type.py``, and ``allocator/base.py`` + ``allocator/paged.py``
  (``PagedTokenToKVPoolAllocator``: the free pages, ``alloc``, ``free``). Every slot id a
  row is stored at, every free and every eviction is theirs.
- **Ours** (this file): the rows, in one tensor pair per storage shape indexed by SGLang's
  slot ids (page id * page size + offset; page 0 is SGLang's padding page, never handed out);
  a kit cache row plays one SGLang request (its slot list is the request's
  ``req_to_token`` row, its locked node ``req.last_node``); publishing a row's full declared
  pages follows SGLang's ``RadixCache.checkpoint`` / ``_insert_cache`` (insert, free the
  duplicate slots the tree already had, point the row at the tree's slots, move the lock;
  with ``adopt_twins=False`` a row whose pages the tree already holds as twins keeps its
  own and publishes nothing past them, for the kit's bit-for-bit rule);
  an append that finds too few free pages first calls ``RadixCache.evict`` for the shortfall,
  as SGLang's scheduler does. SGLang has no truncate, fork, reorder or per-layer keying:
  a layer (and storage shape) is SGLang's ``extra_key`` namespace, a salt its
  ``cache_salt``; a truncate back into a page the tree holds copies the kept rows of that
  page into a fresh page (SGLang never writes a tree page); a fork or a repeated row in a
  reorder locks the tree part again and copies the row's own pages (SGLang shares only
  through the tree).
- **Stubbed** (the modules SGLang's files import that would pull its server, triton or
  msgspec; none of their code runs here): ``sglang.srt.disaggregation.kv_events`` (event
  classes: events are off), ``sglang.kernels.ops.kvcache.mla_buffer`` and
  ``sglang.kernels.ops.memory.allocator`` (triton kernels, unused: ``alloc`` is the plain
  path), ``sglang.srt.mem_cache.memory_pool`` (``ReqToTokenPool``, a type only),
  ``sglang.srt.observability.metrics_collector`` and ``sglang.srt.runtime_context``
  (metrics are off), ``sglang.srt.platforms`` (``current_platform``: no triton),
  ``sglang.srt.utils`` and ``sglang.srt.utils.common`` (``get_bool_env_var``, ``is_hip``,
  ``next_power_of_2``, ``get_num_new_pages``, ``ceil_align``: tiny functions of ours), and
  the packages' ``__init__`` files (empty packages: SGLang's own would import its server).

No validation of our own: nothing is checked, cast or copied at the boundary beyond
converting tensors to SGLang's ``array('q')`` keys and int64 slot tensors; bad input reaches
SGLang (or torch indexing) as it is. An allocation that needs more pages than SGLang has
free or evictable is refused with ``ValueError`` before anything changes (SGLang's scheduler
admits no request past that; its allocator would answer ``None``), since that is how the
kit's pools refuse.

Where SGLang's source is: ``KVCHECK_SGLANG_PATH`` (a folder holding ``sglang/``), else the
folder an installed ``sglang`` is found in (``pip install --no-deps sglang==0.5.23``).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
import weakref
from array import array

import torch
from torch import Tensor

SGLANG_VERSION = "0.5.23"

_STUBBED = (
    "sglang.srt.disaggregation.kv_events",
    "sglang.kernels.ops.kvcache.mla_buffer",
    "sglang.kernels.ops.memory.allocator",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.observability.metrics_collector",
    "sglang.srt.runtime_context",
    "sglang.srt.platforms",
    "sglang.srt.utils",
    "sglang.srt.utils.common",
)


def sglang_root() -> str | None:
    """The folder holding SGLang's ``sglang/`` package source, or None."""
    where = os.environ.get("KVCHECK_SGLANG_PATH")
    if where:
        return where if os.path.isfile(os.path.join(where, "sglang", "__init__.py")) else None
    try:
        spec = importlib.util.find_spec("sglang")  # finds, does not run, the package
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    return os.path.dirname(os.path.dirname(spec.origin))


class _Named:
    """A stand-in class for a name an SGLang file imports and never uses here."""


def _stub(name: str, **names) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = []
    module.__dict__.update(names)
    return module


def _stubs() -> dict[str, types.ModuleType]:
    def named(*what):
        return {n: type(n, (_Named,), {}) for n in what}

    caps = types.SimpleNamespace(supports_triton=False)
    return {
        "sglang.srt.disaggregation.kv_events": _stub(
            "sglang.srt.disaggregation.kv_events",
            **named("StorageMedium", "AllBlocksCleared", "BlockRemoved", "BlockStored"),
            namespaced_block_hash=None,
            kv_event_namespace_seed=None,
        ),
        "sglang.kernels.ops.kvcache.mla_buffer": _stub(
            "sglang.kernels.ops.kvcache.mla_buffer",
            **named(
                "set_mla_kv_buffer_triton",
                "set_mla_kv_buffer_triton_fp8_quant",
                "set_mla_kv_scale_buffer_triton",
                "set_mla_kv_scale_buffer_kernel",
                "set_mla_kv_buffer_dcp_sharded_triton",
                "set_mla_kv_buffer_kernel",
                "set_mla_kv_buffer_fp8_quant_kernel",
                "get_mla_kv_buffer_kernel",
                "get_mla_kv_buffer_triton",
            ),
        ),
        "sglang.kernels.ops.memory.allocator": _stub(
            "sglang.kernels.ops.memory.allocator",
            **named("alloc_decode_kernel", "alloc_extend_kernel"),
        ),
        "sglang.srt.mem_cache.memory_pool": _stub(
            "sglang.srt.mem_cache.memory_pool", **named("ReqToTokenPool", "KVCache")
        ),
        "sglang.srt.observability.metrics_collector": _stub(
            "sglang.srt.observability.metrics_collector",
            **named("RadixCacheMetricsCollector"),
            resolve_collector_class=None,
            radix_cache_metric_labels=None,
            STAT_LOGGER_ROLE_RADIX_CACHE="radix_cache",
        ),
        "sglang.srt.runtime_context": _stub(
            "sglang.srt.runtime_context", get_parallel=None, get_observability=None
        ),
        "sglang.srt.platforms": _stub(
            "sglang.srt.platforms",
            current_platform=types.SimpleNamespace(capabilities=caps),
        ),
        "sglang.srt.utils": _stub(
            "sglang.srt.utils",
            get_bool_env_var=lambda name, default="false": (
                os.environ.get(name, default).lower() in ("true", "1")
            ),
            is_hip=lambda: False,
            next_power_of_2=lambda n: 1 << (n - 1).bit_length() if n > 0 else 1,
            get_num_new_pages=None,
        ),
        "sglang.srt.utils.common": _stub(
            "sglang.srt.utils.common", ceil_align=lambda x, a: -(-x // a) * a
        ),
    }


class _Finder:
    """Import SGLang's packages as empty namespaces over its source folders (their
    ``__init__`` files would import the server) and the stubbed modules as ours; every other
    ``sglang`` module is SGLang's own file."""

    def __init__(self, root: str, stubs: dict[str, types.ModuleType]) -> None:
        self.root = root
        self.stubs = stubs

    def find_spec(self, name, path=None, target=None):
        if name in self.stubs:
            return importlib.util.spec_from_loader(name, self, is_package=True)
        if name == "sglang" or name.startswith("sglang."):
            folder = os.path.join(self.root, *name.split("."))
            if os.path.isdir(folder):
                spec = importlib.util.spec_from_loader(name, self, is_package=True)
                spec.submodule_search_locations = [folder]
                return spec
        return None

    def create_module(self, spec):
        if spec.name in self.stubs:
            return self.stubs[spec.name]
        module = types.ModuleType(spec.name)
        module.__path__ = list(spec.submodule_search_locations)
        return module

    def exec_module(self, module) -> None:
        pass


_ENGINE: types.SimpleNamespace | None = None


def load_sglang() -> types.SimpleNamespace:
    """SGLang's radix cache and paged allocator modules, loaded from its source files."""
    global _ENGINE
    if _ENGINE is not None:
        return _ENGINE
    root = sglang_root()
    if root is None:
        raise ImportError(
            "SGLang's source is not installed: pip install --no-deps sglang==0.5.23 "
            "(or set KVCHECK_SGLANG_PATH to a folder holding sglang/)"
        )
    if any(n == "sglang" or n.startswith("sglang.") for n in sys.modules):
        raise ImportError("sglang is already imported: load its radix cache in a fresh process")
    finder = _Finder(root, _stubs())
    sys.meta_path.insert(0, finder)
    try:
        base = importlib.import_module("sglang.srt.mem_cache.allocator.base")
        # allocator/__init__.py would import every allocator; base_prefix_cache.py needs one name
        sys.modules[
            "sglang.srt.mem_cache.allocator"
        ].BaseTokenToKVPoolAllocator = base.BaseTokenToKVPoolAllocator
        radix = importlib.import_module("sglang.srt.mem_cache.radix_cache")
        paged = importlib.import_module("sglang.srt.mem_cache.allocator.paged")
        params = importlib.import_module("sglang.srt.mem_cache.base_prefix_cache")
        init = importlib.import_module("sglang.srt.mem_cache.cache_init_params")
    finally:
        sys.meta_path.remove(finder)
    _ENGINE = types.SimpleNamespace(
        root=root,
        RadixCache=radix.RadixCache,
        RadixKey=radix.RadixKey,
        Allocator=paged.PagedTokenToKVPoolAllocator,
        CacheInitParams=init.CacheInitParams,
        MatchPrefixParams=params.MatchPrefixParams,
        InsertParams=params.InsertParams,
        EvictParams=params.EvictParams,
    )
    return _ENGINE


def _storage_key(spec) -> tuple:
    return (str(spec.dtype), str(torch.device(spec.device)), spec.kv_heads, spec.head_dim)


class _Slab:
    """Ours: the rows of every slot of one storage shape, indexed by SGLang's slot ids, grown
    by doubling up to the pool's slots."""

    def __init__(self, spec, limit: int) -> None:
        self.limit = limit
        shape = (0, spec.kv_heads, spec.head_dim)
        self.keys = torch.zeros(shape, dtype=spec.dtype, device=spec.device)
        self.values = torch.zeros(shape, dtype=spec.dtype, device=spec.device)

    def hold(self, slots: int) -> None:
        size = self.keys.shape[0]
        if slots <= size:
            return
        grown = min(self.limit, max(slots, 2 * size, 64))
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros((grown, *old.shape[1:]))
            new[:size] = old
            setattr(self, name, new)


class _Row:
    """One batch row of one layer's cache: what SGLang keeps for a request."""

    __slots__ = ("node", "own", "protected", "slots", "tokens")

    def __init__(self, root) -> None:
        self.slots: list[int] = []  # req_to_token: a slot id per page position taken
        self.node = root  # req.last_node: locked while not the root
        self.protected = 0  # cache_protected_len: the tree-owned prefix of slots
        self.tokens: list[int] = []  # the declared tokens
        # Pages below ``protected`` the row owns all the same: twins it kept (adopt_twins off)
        self.own: set[int] = set()

    def owned(self, size: int, start: int = 0) -> list[int]:
        """The slots from ``start`` on that this row owns (SGLang frees them when it leaves)."""
        return [
            slot
            for i, slot in enumerate(self.slots[start:], start)
            if i >= self.protected or i // size in self.own
        ]


class SGLangRadixPool:
    """A cache factory whose caches' rows lie in slots SGLang's paged allocator hands out and
    whose full declared pages SGLang's ``RadixCache`` publishes, matches, locks and evicts."""

    def __init__(
        self, block_size: int = 4, num_blocks: int = 1 << 16, *, adopt_twins: bool = True
    ) -> None:
        eng = load_sglang()
        # SGLang's _insert_cache frees a request's pages the tree already holds for the same
        # tokens and points the request at the tree's (adopt_twins=True, SGLang's way). Off,
        # the request keeps its own copy until it leaves and publishes nothing past it (the
        # kit's contract: a cache returns the rows it was given, bit for bit).
        self.adopt_twins = adopt_twins
        self.block_size = block_size
        self.room = num_blocks
        self.kv_sizes = {"page": block_size}
        self.allocator = eng.Allocator(
            size=num_blocks * block_size,
            page_size=block_size,
            dtype=torch.float32,
            device="cpu",
            kvcache=None,
            need_sort=False,
        )
        self.tree = eng.RadixCache(
            eng.CacheInitParams(
                disable=False,
                req_to_token_pool=None,
                token_to_kv_pool_allocator=self.allocator,
                page_size=block_size,
            )
        )
        self._eng = eng
        self._storage: dict[tuple, _Slab] = {}

    def __call__(self, spec) -> SGLangRadixCache:
        return SGLangRadixCache(self, spec)

    def with_blocks(self, num_blocks: int, *, block_hash=None) -> SGLangRadixPool:
        # block_hash is not used: SGLang's tree keys pages by their tokens themselves.
        return SGLangRadixPool(self.block_size, num_blocks, adopt_twins=self.adopt_twins)

    # The books, from SGLang's counters (in tokens) and free pages.
    @property
    def blocks_cached(self) -> int:
        return (self.tree.evictable_size() + self.tree.protected_size()) // self.block_size

    @property
    def blocks_evictable(self) -> int:
        return self.tree.evictable_size() // self.block_size

    @property
    def blocks_free(self) -> int:
        return self.allocator.available_size() // self.block_size + self.blocks_evictable

    @property
    def blocks_in_use(self) -> int:
        return self.room - self.blocks_free

    def lookup_prefix(self, caches, tokens, *, salt=None) -> int:
        eng = self._eng
        size = self.block_size
        rows = tokens.tolist()
        keys = []
        for layer, cache in enumerate(caches):
            extra = f"layer {layer} {_storage_key(cache.spec)}"
            most = min(len(rows[0]), cache.spec.max_length) // size * size
            keys.append(
                [eng.RadixKey(array("q", row[:most]), extra, cache_salt=salt) for row in rows]
            )
        found = [
            self.tree.match_prefix(eng.MatchPrefixParams(key=key)).device_prefix_len
            for layer_keys in keys
            for key in layer_keys
        ]
        hit = min(found, default=0)
        for cache, layer_keys in zip(caches, keys, strict=True):
            cache._salt = salt
            cache._extra = layer_keys[0].extra_key if layer_keys else None
            cache._looked_up = True
            for row, key, ids in zip(cache._rows, layer_keys, rows, strict=True):
                node = self.tree.match_prefix(eng.MatchPrefixParams(key=key[:hit])).last_device_node
                self.tree.inc_lock_ref(node)
                row.node = node
                row.slots = self.tree.path_device_indices(node).tolist()
                row.protected = hit
                row.own = set()
                row.tokens = list(ids)
            cache._count = hit
        return hit

    # Pages.
    def _storage_for(self, spec) -> _Slab:
        key = _storage_key(spec)
        if key not in self._storage:
            self._storage[key] = _Slab(spec, (self.room + 1) * self.block_size)
        return self._storage[key]

    def _take_pages(self, pages: int, slab: _Slab) -> list[int]:
        """``pages`` pages' slots from SGLang's allocator, evicting for the shortfall first;
        ValueError, changing nothing but evictions, where SGLang has too few."""
        need = pages * self.block_size
        if need == 0:
            return []
        if pages > self.blocks_free:  # SGLang's scheduler admits no more than free + evictable
            raise ValueError(
                f"SGLang's pool has {self.blocks_free} free or evictable pages; the call "
                f"needs {pages}"
            )
        shortfall = need - self.allocator.available_size()
        if shortfall > 0:
            self.tree.evict(self._eng.EvictParams(num_tokens=shortfall))
        taken = self.allocator.alloc(need)
        if taken is None:
            raise ValueError(
                f"SGLang's allocator has {self.allocator.available_size() // self.block_size} "
                f"free pages after evicting; the call needs {pages}"
            )
        taken = taken.tolist()
        slab.hold(max(taken) + 1)
        return taken

    def _free_slots(self, slots: list[int]) -> None:
        if slots:
            self.allocator.free(torch.tensor(slots, dtype=torch.int64))

    def _release(self, row: _Row) -> None:
        """What SGLang does for a request that leaves without caching more: free the slots
        it owns (past the tree-owned prefix), unlock its node."""
        self._free_slots(row.owned(self.block_size))
        self.tree.dec_lock_ref(row.node)
        row.node = self.tree.root_node
        row.slots = []
        row.protected = 0
        row.own = set()


def _release_all(pool: SGLangRadixPool, rows: list[_Row]) -> None:
    for row in rows:
        pool._release(row)


class SGLangRadixCache:
    """One layer of one request; each batch row an SGLang request of its own."""

    def __init__(self, pool: SGLangRadixPool, spec) -> None:
        self.pool = pool
        self.spec = spec
        self._slab = pool._storage_for(spec)
        self._rows = [_Row(pool.tree.root_node) for _ in range(spec.batch)]
        self._count = 0
        self._salt = None
        self._extra: str | None = None
        self._looked_up = False
        self._undeclared_from: int | None = None
        self._host: tuple[Tensor, Tensor] | None = None
        weakref.finalize(self, _release_all, pool, self._rows)

    @property
    def _keys(self) -> Tensor:
        return self._slab.keys

    @property
    def _values(self) -> Tensor:
        return self._slab.values

    @property
    def length(self) -> int:
        return self._count

    @property
    def nbytes(self) -> int:
        if self._host is not None:
            return self._host[0].nbytes + self._host[1].nbytes
        per_slot = 2 * self.spec.kv_heads * self.spec.head_dim * self._keys.element_size()
        return per_slot * sum(len(row.slots) for row in self._rows)

    @property
    def block_tables(self) -> list[list[int]]:
        size = self.pool.block_size
        return [[slot // size for slot in row.slots[::size]] for row in self._rows]

    @property
    def offloaded(self) -> bool:
        return self._host is not None

    def reset(self) -> None:
        _release_all(self.pool, self._rows)
        for row in self._rows:
            row.tokens = []
        self._count = 0
        self._salt = None
        self._extra = None
        self._looked_up = False
        self._undeclared_from = None
        self._host = None

    def declare_tokens(self, tokens: Tensor) -> None:
        for row, ids in zip(self._rows, tokens.tolist(), strict=True):
            row.tokens.extend(ids)

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        size = self.pool.block_size
        new = key.shape[2]
        pages = -(-(self._count + new) // size) - len(self._rows[0].slots) // size
        taken = self.pool._take_pages(pages * len(self._rows), self._slab)
        for row in self._rows:
            row.slots.extend(taken[: pages * size])
            del taken[: pages * size]
        self._scatter(self._count, key, value)
        self._count += new
        if len(self._rows[0].tokens) < self._count and self._undeclared_from is None:
            self._undeclared_from = len(self._rows[0].tokens)
        self._checkpoint()
        return self._gather()

    def truncate(self, length: int) -> None:
        pool = self.pool
        size = pool.block_size
        keep = -(-length // size) * size
        for row in self._rows:
            pool._free_slots(row.owned(size, keep))
            del row.slots[keep:]
            row.own = {i for i in row.own if i * size < keep}
            del row.tokens[length:]
            if length < row.protected:
                self._unprotect(row, length)
        if self._undeclared_from is not None and length <= self._undeclared_from:
            self._undeclared_from = None
        self._count = length

    def reorder(self, indices: Tensor) -> None:
        order = indices.tolist()
        old = self._rows
        for i, row in enumerate(old):
            if i not in order:
                self.pool._release(row)  # first, so that its pages can hold the copies
        new = []
        used = set()
        for i in order:
            new.append(self._copy_row(old[i]) if i in used else old[i])
            used.add(i)
        self._rows[:] = new

    def fork(self) -> SGLangRadixCache:
        child = SGLangRadixCache(self.pool, self.spec)
        child._rows[:] = [self._copy_row(row) for row in self._rows]
        child._count = self._count
        child._salt = self._salt
        child._extra = self._extra
        child._looked_up = self._looked_up
        child._undeclared_from = self._undeclared_from
        return child

    def offload(self) -> None:
        keys, values = self._gather()
        self._host = (keys.to("cpu", copy=True), values.to("cpu", copy=True))
        _release_all(self.pool, self._rows)

    def restore(self) -> None:
        if self._host is None:
            raise ValueError("restore: the cache is not offloaded")
        size = self.pool.block_size
        pages = -(-self._count // size)
        if pages * len(self._rows) > self.pool.blocks_free:
            raise ValueError(
                f"restore needs {pages * len(self._rows)} pages, {self.pool.blocks_free} free"
            )
        taken = self.pool._take_pages(pages * len(self._rows), self._slab)
        for row in self._rows:
            row.slots = taken[: pages * size]
            del taken[: pages * size]
        keys, values = self._host
        self._host = None
        if self._count:
            device = torch.device(self.spec.device)
            self._scatter(0, keys.to(device), values.to(device))
        self._checkpoint()

    # Inner workings.
    def _slot_tensor(self, slots: list[int]) -> Tensor:
        return torch.tensor(slots, dtype=torch.int64, device=self._keys.device)

    def _scatter(self, start: int, key: Tensor, value: Tensor) -> None:
        for b, row in enumerate(self._rows):
            where = self._slot_tensor(row.slots[start : start + key.shape[2]])
            self._keys[where] = key[b].transpose(0, 1)
            self._values[where] = value[b].transpose(0, 1)

    def _gather(self) -> tuple[Tensor, Tensor]:
        where = torch.stack([self._slot_tensor(row.slots[: self._count]) for row in self._rows])
        return self._keys[where].transpose(1, 2), self._values[where].transpose(1, 2)

    def _checkpoint(self) -> None:
        """SGLang's ``RadixCache.checkpoint`` for each row: insert the full declared pages,
        free the duplicates the tree already held, take the tree's slots, move the lock."""
        if not self._looked_up:
            return
        pool, eng = self.pool, self.pool._eng
        tree = pool.tree
        size = pool.block_size
        keyed = min(self._count, len(self._rows[0].tokens))
        if self._undeclared_from is not None:
            keyed = min(keyed, self._undeclared_from)
        full = keyed // size * size
        for row in self._rows:
            if full <= row.protected:
                continue
            key = eng.RadixKey(array("q", row.tokens[:full]), self._extra, cache_salt=self._salt)
            if not pool.adopt_twins:
                held = tree.match_prefix(eng.MatchPrefixParams(key=key)).device_prefix_len
                if held > row.protected:
                    continue  # the tree holds a twin of a page of ours: publish no more
            values = self._slot_tensor(row.slots[:full])
            result = tree.insert(eng.InsertParams(key=key, value=values, inserted_len=0))
            node = tree.match_prefix(eng.MatchPrefixParams(key=key)).last_device_node
            if pool.adopt_twins:
                pool._free_slots(row.slots[row.protected : result.prefix_len])
                row.slots[:full] = tree.path_device_indices(node).tolist()
            tree.dec_lock_ref(row.node)
            tree.inc_lock_ref(node)
            row.node = node
            row.protected = full

    def _unprotect(self, row: _Row, length: int) -> None:
        """Ours (SGLang has no truncate): move the lock back to the node of the whole pages
        below ``length``, and copy the kept rows of a tree page ``length`` ends inside into a
        fresh page, so that the tree's page is never written."""
        pool, eng = self.pool, self.pool._eng
        size = pool.block_size
        whole = length // size * size
        key = eng.RadixKey(array("q", row.tokens[:whole]), self._extra, cache_salt=self._salt)
        node = pool.tree.match_prefix(eng.MatchPrefixParams(key=key)).last_device_node
        pool.tree.inc_lock_ref(node)
        pool.tree.dec_lock_ref(row.node)
        row.node = node
        row.protected = whole
        if length > whole and whole // size not in row.own:
            fresh = pool._take_pages(1, self._slab)
            source = self._slot_tensor(row.slots[whole:length])
            target = self._slot_tensor(fresh[: length - whole])
            self._keys[target] = self._keys[source]
            self._values[target] = self._values[source]
            row.slots[whole:] = fresh

    def _copy_row(self, row: _Row) -> _Row:
        """Ours: a second row with the same rows: the tree part locked again (shared), the
        row's own pages copied into fresh ones."""
        pool = self.pool
        twin = _Row(pool.tree.root_node)
        size = pool.block_size
        own = [
            i for i in range(0, len(row.slots), size) if i >= row.protected or i // size in row.own
        ]
        fresh = pool._take_pages(len(own), self._slab)
        twin.slots = list(row.slots)
        for n, i in enumerate(own):
            source = self._slot_tensor(row.slots[i : i + size])
            target = self._slot_tensor(fresh[n * size : (n + 1) * size])
            self._keys[target] = self._keys[source]
            self._values[target] = self._values[source]
            twin.slots[i : i + size] = fresh[n * size : (n + 1) * size]
        pool.tree.inc_lock_ref(row.node)
        twin.node = row.node
        twin.protected = row.protected
        twin.own = set(row.own)
        twin.tokens = list(row.tokens)
        return twin
