"""SGLang's RadixCache points a request at the tree's copy of pages it computed itself.

Two requests with the same 8-token prompt are prefilled at once (neither finds the other's
pages). The first caches its pages; the second then does what RadixCache._insert_cache and
checkpoint() do (sglang 0.5.23, python/sglang/srt/mem_cache/radix_cache.py lines 450-540):
insert, free its own slots the tree already holds (line 504, free_segment of
kv_indices[cache_protected_len:prefix_len]), and take the tree's slots instead (line 526,
path_device_indices, written into req_to_token at line 531). Its rows are now the first
request's, computed in another batch: here they differ in the last bit, and the request
reads back rows it never wrote. SGLang's design (the values agree to rounding); a cache
under the kit's contract returns the rows it was given, bit for bit.

Run with SGLang's source installed (pip install --no-deps --target DIR sglang==0.5.23;
PYTHONPATH=DIR:. python repros/serving_twin_adoption.py). SGLang's package __init__ pulls
its whole server, so its bookkeeping modules are loaded from their files by
kvimpl/sglang_radix.load_sglang (stubs for the modules they import that need triton or
msgspec; no kvcheck). Exits with AssertionError while SGLang adopts the twin.
"""

from array import array

import torch

from kvimpl.sglang_radix import load_sglang

eng = load_sglang()
PAGE = 4
allocator = eng.Allocator(
    size=16 * PAGE, page_size=PAGE, dtype=torch.float32, device="cpu", kvcache=None, need_sort=False
)
tree = eng.RadixCache(
    eng.CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=allocator, page_size=PAGE
    )
)
kv = torch.zeros(17 * PAGE, dtype=torch.float64)  # one number per slot: the "rows"

tokens = array("q", [0, 1, 0, 1, 0, 1, 0, 1])
key = eng.RadixKey(tokens)
assert tree.match_prefix(eng.MatchPrefixParams(key=key)).device_prefix_len == 0

# Both requests prefill at once: each gets slots of its own and writes its rows.
slots_a = allocator.alloc(len(tokens))
slots_b = allocator.alloc(len(tokens))
rows = torch.linspace(0.1, 0.8, len(tokens), dtype=torch.float64)
kv[slots_a] = rows
written = torch.nextafter(rows, rows + 1)  # the same rows, computed in another batch
kv[slots_b] = written

# Request a caches its pages.
tree.insert(eng.InsertParams(key=key, value=slots_a.clone()))
# Request b caches its pages as _insert_cache + checkpoint do.
result = tree.insert(eng.InsertParams(key=key, value=slots_b.clone()))
allocator.free_segment(slots_b[0 : result.prefix_len], start_pos=0)
node = tree.match_prefix(eng.MatchPrefixParams(key=key)).last_device_node
req_to_token_b = tree.path_device_indices(node)

read = kv[req_to_token_b]
print(f"request b wrote slots {slots_b.tolist()}, now reads slots {req_to_token_b.tolist()}")
print(f"rows written {written.tolist()}\nrows read    {read.tolist()}")
assert torch.equal(read, written), (
    f"request b reads {int((read != written).sum())} of {len(tokens)} rows it did not write: "
    "RadixCache freed its pages and pointed it at the tree's twin"
)
print("ok: request b reads its own rows")
