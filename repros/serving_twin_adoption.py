"""SGLang 0.5.23, class 3 (a deviation from the kit's contract, not a defect): RadixCache points
a request at the tree's copy of pages it computed itself.

Two requests with the same 8-token prompt are prefilled at once (neither finds the other's
pages). The first caches its pages; the second then does what RadixCache._insert_cache and
checkpoint() do (python/sglang/srt/mem_cache/radix_cache.py, lines 450-540): insert, free its
own slots the tree already holds (line 504, free_segment of
kv_indices[cache_protected_len:prefix_len]), and take the tree's slots instead (line 526,
path_device_indices, written into req_to_token at line 531). Its rows are now the first
request's, computed in another batch: here they differ in the last bit, and the request
reads rows it never wrote. SGLang's design: it saves the twin's memory, and the rows agree to
rounding; the kit's contract asks a cache to return the rows it was given, bit for bit
(docs/contract.md, section 9.1), hence the deviation.

SGLang's files, no SGLang install: `pip install --no-deps --target DIR 'sglang==0.5.23'` (its
wheel pins another torch), then `KVCHECK_SGLANG_PATH=DIR python repros/serving_twin_adoption.py`.
Its modules are imported from DIR directly. Stubs are unavoidable here: the sglang packages'
__init__ files import its whole server (orjson, psutil, triton, ...), so the packages are
entered as empty namespaces over DIR's folders without running their __init__, and the nine
modules the cache's files import for triton kernels, msgspec events, metrics and the server's
utils are minimal sys.modules entries holding the names imported (none of that code runs on
these paths). Every line of RadixCache and of the paged allocator that runs is SGLang's.
Exits 0.
"""

import importlib
import os
import sys
import types
from array import array

import torch

ROOT = os.environ.get("KVCHECK_SGLANG_PATH") or (sys.argv[1] if len(sys.argv) > 1 else "")
if not os.path.isfile(os.path.join(ROOT, "sglang", "srt", "mem_cache", "radix_cache.py")):
    sys.exit("set KVCHECK_SGLANG_PATH to a folder holding sglang/ (pip install --no-deps --target)")


def entry(name, **names):
    module = types.ModuleType(name)
    module.__path__ = []
    module.__dict__.update(names)
    sys.modules[name] = module


def unused(*names):
    return {n: type(n, (), {}) for n in names}


# The packages, as namespaces over SGLang's folders (their __init__ files would start the server).
for package in (
    "sglang",
    "sglang.srt",
    "sglang.srt.mem_cache",
    "sglang.srt.mem_cache.allocator",
    "sglang.srt.mem_cache.cpp_utils",
    "sglang.srt.mem_cache.unified_cache",
    "sglang.kernels",
    "sglang.kernels.ops",
):
    module = types.ModuleType(package)
    module.__path__ = [os.path.join(ROOT, *package.split("."))]
    sys.modules[package] = module
# The heavy modules the cache's files import, with the names they import.
entry(
    "sglang.srt.disaggregation.kv_events",
    **unused("StorageMedium", "AllBlocksCleared", "BlockRemoved", "BlockStored"),
    namespaced_block_hash=None,
    kv_event_namespace_seed=None,
)
entry(
    "sglang.kernels.ops.kvcache.mla_buffer",
    **unused(
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
)
entry("sglang.kernels.ops.memory.allocator", **unused("alloc_decode_kernel", "alloc_extend_kernel"))
entry("sglang.srt.mem_cache.memory_pool", **unused("ReqToTokenPool", "KVCache"))
entry(
    "sglang.srt.observability.metrics_collector",
    **unused("RadixCacheMetricsCollector"),
    resolve_collector_class=None,
    radix_cache_metric_labels=None,
    STAT_LOGGER_ROLE_RADIX_CACHE="radix_cache",
)
entry("sglang.srt.runtime_context", get_parallel=None, get_observability=None)
entry(
    "sglang.srt.platforms",
    current_platform=types.SimpleNamespace(
        capabilities=types.SimpleNamespace(supports_triton=False)
    ),
)
entry(
    "sglang.srt.utils",
    get_bool_env_var=lambda name, default="false": (
        os.environ.get(name, default).lower() in ("true", "1")
    ),
    is_hip=lambda: False,
    next_power_of_2=lambda n: 1 << (n - 1).bit_length() if n > 0 else 1,
    get_num_new_pages=None,
)
entry("sglang.srt.utils.common", ceil_align=lambda x, a: -(-x // a) * a)

base = importlib.import_module("sglang.srt.mem_cache.allocator.base")
sys.modules[
    "sglang.srt.mem_cache.allocator"
].BaseTokenToKVPoolAllocator = base.BaseTokenToKVPoolAllocator
radix = importlib.import_module("sglang.srt.mem_cache.radix_cache")
paged = importlib.import_module("sglang.srt.mem_cache.allocator.paged")
prefix = importlib.import_module("sglang.srt.mem_cache.base_prefix_cache")
init = importlib.import_module("sglang.srt.mem_cache.cache_init_params")

PAGE = 4
allocator = paged.PagedTokenToKVPoolAllocator(
    size=16 * PAGE, page_size=PAGE, dtype=torch.float32, device="cpu", kvcache=None, need_sort=False
)
tree = radix.RadixCache(
    init.CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=allocator, page_size=PAGE
    )
)
kv = torch.zeros(17 * PAGE, dtype=torch.float64)  # one number per slot: the "rows"

tokens = array("q", [0, 1, 0, 1, 0, 1, 0, 1])
key = radix.RadixKey(tokens)
assert tree.match_prefix(prefix.MatchPrefixParams(key=key)).device_prefix_len == 0

# Both requests prefill at once: each gets slots of its own and writes its rows.
slots_a = allocator.alloc(len(tokens))
slots_b = allocator.alloc(len(tokens))
rows = torch.linspace(0.1, 0.8, len(tokens), dtype=torch.float64)
kv[slots_a] = rows
written = torch.nextafter(rows, rows + 1)  # the same rows, computed in another batch
kv[slots_b] = written

# Request a caches its pages; request b caches its pages as _insert_cache + checkpoint do.
tree.insert(prefix.InsertParams(key=key, value=slots_a.clone()))
result = tree.insert(prefix.InsertParams(key=key, value=slots_b.clone()))
allocator.free_segment(slots_b[0 : result.prefix_len], start_pos=0)
node = tree.match_prefix(prefix.MatchPrefixParams(key=key)).last_device_node
req_to_token_b = tree.path_device_indices(node)

read = kv[req_to_token_b]
print(f"request b wrote slots {slots_b.tolist()}, now reads slots {req_to_token_b.tolist()}")
differ = int((read != written).sum())
print(f"it reads {differ} of {len(tokens)} rows it did not write (they differ in the last bit)")
seen = "seen" if differ else "no longer seen"
print(
    f"class 3: deviation from the kit's contract, not a defect ({seen}): SGLang shares the "
    "tree's twin of a request's pages by design"
)
