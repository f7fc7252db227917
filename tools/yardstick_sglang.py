"""The SGLang part of the mutation yardstick (tools/mutation_yardstick.py): one-line mutants
of SGLang 0.5.23's radix prefix cache (``sglang/srt/mem_cache/radix_cache.py``: ``RadixKey``,
``RadixCache``) and of the paged allocator it frees into
(``sglang/srt/mem_cache/allocator/paged.py``: ``PagedTokenToKVPoolAllocator``), in the code
the adapter of ``kvimpl/sglang_radix.py`` runs, each written as the cited thread of SGLang's
tracker (or of a project built on its radix cache) shows such a bug or fixes one; the kit's
properties on that adapter; and SGLang's own tests, where they can be had.

    pip install --no-deps --target DIR sglang==0.5.23
    KVCHECK_SGLANG_PATH=DIR python tools/mutation_yardstick.py sglang

SGLang's wheel pins another torch, so only its files are installed (as .ci/run does) and the
adapter loads its bookkeeping from the folder ``KVCHECK_SGLANG_PATH`` names; the harness
mutates the files there (in its private overlay, which the test processes get through the same
variable).
"""

from __future__ import annotations

from mutation_yardstick import Engine, Mutant

RADIX = "srt/mem_cache/radix_cache.py"
PAGED = "srt/mem_cache/allocator/paged.py"
POOL = "SGLangRadixPool"
UNREACHED = (
    "the adapter does this step itself (`SGLangRadixCache._checkpoint` of "
    "kvimpl/sglang_radix.py): SGLang's `checkpoint`/`_insert_cache` take a scheduler `Req` "
    "and its `ReqToTokenPool`, which the adapter has not"
)

MUTANTS = (
    Mutant(
        "G01",
        RADIX,
        "RadixKey.match_at",
        "return (matched_tokens // page_size) * page_size",
        "return -(-matched_tokens // page_size) * page_size",
        "a match ending inside a page counts the whole page as matched",
        ("pull/10637", "pull/27364"),
        (POOL,),
    ),
    Mutant(
        "G02",
        RADIX,
        "RadixKey.match_at",
        "matched_tokens = lo",
        "matched_tokens = hi",
        "the galloping match counts the first diverging token as matched",
        ("pull/27364",),
        (POOL,),
    ),
    Mutant(
        "G03",
        RADIX,
        "RadixKey.page_aligned",
        "aligned_len = len(self) // page_size * page_size",
        "aligned_len = -(-len(self) // page_size) * page_size",
        "page alignment keeps a key's partial last page",
        ("pull/23107", "pull/10637"),
        (POOL,),
    ),
    Mutant(
        "G04",
        RADIX,
        "RadixCache.match_prefix",
        "if len(key) == 0:",
        "if False:",
        "a key shorter than a page, empty once aligned, is matched anyway",
        ("pull/10637",),
        (POOL,),
    ),
    Mutant(
        "G05",
        RADIX,
        "RadixKey.child_key_at",
        "return plain if self.extra_key is None else (self.extra_key, plain)",
        "return plain",
        "a child's key leaves out the extra_key namespace",
        ("pull/10317", "issues/24638"),
        (POOL,),
    ),
    Mutant(
        "G06",
        RADIX,
        "RadixKey.child_key_at",
        "return ((self.extra_key, self.cache_salt), plain)",
        "return (self.extra_key, plain)",
        "a salted child's key leaves out the cache_salt",
        ("pull/30827", "pull/25214"),
        (POOL,),
    ),
    Mutant(
        "G07",
        RADIX,
        "RadixCache._match_prefix_helper",
        "if prefix_len < len(child.key):",
        "if prefix_len <= len(child.key):",
        "a node matched whole is split too, at its end, leaving an empty node",
        ("pull/28692", "pull/36696"),
        (POOL,),
    ),
    Mutant(
        "G08",
        RADIX,
        "RadixCache._match_prefix_helper",
        "value.append(new_node.value)",
        "value.append(child.value)",
        "a match ending inside a node returns the split-off suffix's slots, not the prefix's",
        ("sgl-project/mini-sglang/pull/46", "bytedance-iaas/sglang/pull/508"),
        (POOL,),
    ),
    Mutant(
        "G09",
        RADIX,
        "RadixCache._split_node",
        "new_node.lock_ref = child.lock_ref",
        "new_node.lock_ref = 0",
        "splitting a locked node leaves its new prefix node unlocked",
        ("bytedance-iaas/sglang/pull/508", "UbiquitousLearning/mllm/pull/656"),
        (POOL,),
    ),
    Mutant(
        "G10",
        RADIX,
        "RadixCache._split_node",
        "child.value = child.value[split_len:].clone()",
        "child.value = child.value.clone()",
        "the suffix node keeps the whole segment's slots after a split",
        ("pull/17191",),
        (POOL,),
    ),
    Mutant(
        "G11",
        RADIX,
        "RadixCache._split_node",
        "new_node.parent.children[key.child_key(self.page_size)] = new_node",
        "new_node.parent.children[key[split_len:].child_key(self.page_size)] = new_node",
        "the split's prefix node is registered under the suffix's child key",
        ("pull/36696",),
        (POOL,),
    ),
    Mutant(
        "G12",
        RADIX,
        "RadixCache._insert_helper",
        "value = value[prefix_len:]",
        "value = value[len(node.key) :]",
        "an insert past a partial match drops the node's whole length of slots, not the match's",
        ("pull/23107", "sgl-project/mini-sglang/pull/142"),
        (POOL,),
    ),
    Mutant(
        "G13",
        RADIX,
        "RadixCache._insert_helper",
        "total_prefix_length += prefix_len",
        "total_prefix_length = prefix_len",
        "an insert of a prefix already present reports only the last node's part of it",
        ("pull/35204", "sgl-project/mini-sglang/pull/142"),
        (POOL,),
    ),
    Mutant(
        "G14",
        RADIX,
        "RadixCache._insert_helper",
        "self.evictable_size_ += len(key)",
        "self.evictable_size_ += len(value)",
        "a new leaf counts its values, not its key, as evictable",
        ("pull/10637", "pull/6907"),
        (POOL,),
    ),
    Mutant(
        "G15",
        RADIX,
        "RadixCache.evict",
        "num_evicted += len(x.value)",
        "num_evicted += 0",
        "eviction does not count what it evicted, and evicts every evictable leaf",
        ("issues/4987",),
        (POOL,),
    ),
    Mutant(
        "G16",
        RADIX,
        "RadixCache.evict",
        "if len(x.parent.children) == 0 and x.parent.lock_ref == 0:",
        "if len(x.parent.children) == 0:",
        "a parent left childless is pushed for eviction even when it is locked",
        ("sgl-project/mini-sglang/pull/52", "pull/14339"),
        (POOL,),
    ),
    Mutant(
        "G17",
        RADIX,
        "RadixCache.evict",
        "heapq.heappush(eviction_heap, (new_priority, x.parent))",
        "pass",
        "a parent left childless is never pushed: eviction stops short of the count asked",
        ("issues/5499",),
        (POOL,),
    ),
    Mutant(
        "G18",
        RADIX,
        "RadixCache.inc_lock_ref",
        "if node.lock_ref == 0:",
        "if node.lock_ref <= 1:",
        "a node locked by a second request moves its size to protected again",
        ("UbiquitousLearning/mllm/pull/656", "pull/10637"),
        (POOL,),
    ),
    Mutant(
        "G19",
        RADIX,
        "RadixCache.dec_lock_ref",
        "if node.lock_ref == 1:",
        "if node.lock_ref == 0:",
        "the last unlock does not give a node's size back to evictable",
        ("UbiquitousLearning/mllm/pull/656",),
        (POOL,),
    ),
    Mutant(
        "G20",
        RADIX,
        "RadixCache.dec_lock_ref",
        "self._update_leaf_status(node)",
        "pass",
        "an unlocked leaf is not added to the evictable leaves",
        ("pull/14339",),
        (POOL,),
    ),
    Mutant(
        "G21",
        RADIX,
        "RadixCache._update_leaf_status",
        "if node.evicted or node.lock_ref > 0:",
        "if node.evicted or node.lock_ref > 1:",
        "a leaf locked by one request is taken for evictable",
        ("pull/14339", "sgl-project/mini-sglang/pull/52"),
        (POOL,),
    ),
    Mutant(
        "G22",
        RADIX,
        "RadixCache._update_leaf_status",
        "if not child.evicted:",
        "if child.evicted:",
        "a node with live children is taken for an evictable leaf",
        ("pull/25068", "pull/14339"),
        (POOL,),
    ),
    Mutant(
        "G23",
        RADIX,
        "RadixCache._delete_leaf",
        "self.evictable_size_ -= len(node.key)",
        "pass",
        "deleting an evicted leaf leaves its size in the evictable count",
        ("pull/6907", "pull/10637"),
        (POOL,),
    ),
    Mutant(
        "G24",
        PAGED,
        "PagedTokenToKVPoolAllocator.alloc",
        "self.free_pages = self.free_pages[num_pages:]",
        "self.free_pages = self.free_pages[num_pages - 1 :]",
        "the last page handed out stays on the free list",
        ("pull/27731", "LMCache/LMCache/issues/5005"),
        (POOL,),
    ),
    Mutant(
        "G25",
        PAGED,
        "PagedTokenToKVPoolAllocator.free",
        "self._release_page_ids(torch.unique(free_index // self.page_size))",
        "self._release_page_ids(free_index // self.page_size)",
        "freeing a page's slots frees the page once per slot",
        ("pull/13023", "pull/27731"),
        (POOL,),
    ),
    Mutant(
        "G26",
        PAGED,
        "PagedTokenToKVPoolAllocator.free_segment",
        "self.free_page_ids(reps // ps)",
        "self.free_page_ids(reps)",
        "freeing an evicted segment frees its slot ids as page ids",
        ("pull/13023", "issues/7130"),
        (POOL,),
    ),
    Mutant(
        "G27",
        RADIX,
        "RadixCache._insert_cache",
        "kv_indices[req.kv.cache_protected_len : result.prefix_len],",
        "kv_indices[req.kv.cache_protected_len : key_len],",
        "caching a request frees its newly inserted slots with the duplicates",
        ("pull/35204", "sgl-project/mini-sglang/pull/142"),
        (),
        UNREACHED,
    ),
    Mutant(
        "G28",
        RADIX,
        "RadixCache.checkpoint",
        "self.unlock(req.lock)",
        "pass",
        "a checkpoint locks the request's new node without unlocking the old one",
        ("bytedance-iaas/sglang/pull/508",),
        (),
        UNREACHED,
    ),
)

NOTES = (
    "- **SGLang's own tests: none run.** Its wheel ships no test of the radix cache or the "
    "paged allocator (`sglang/test/` holds helpers and kits only), 0.5.23 has no sdist on "
    "PyPI, and the repository at the v0.5.23 tag could not be had on the machine that ran "
    "this (its snapshot is over the size the fetch tool takes, and github.com was out of "
    "reach). The only copy of `test/registered/unit/mem_cache/test_radix_cache_unit.py` "
    "found is of an older API (list keys, `MatchResult.device_indices`, "
    "`TreeNode.host_ref_counter`) and imports SGLang's server modules (`orjson`, "
    "`sglang.srt.disaggregation`, `sglang.test.ci`), which the `--no-deps` install lacks. "
    "Those tests are CPU tests (SGLang runs them on its small GPU runners, needing no GPU): "
    "to fill this column, unpack the v0.5.23 tag's `test/registered/unit/mem_cache/` radix "
    "and allocator tests, install SGLang with its dependencies in a venv of its own, give "
    "`engine_files`/`engine_tests` here and run again.",
    "- **The kit's selection is test_found_in_the_wild_serving.py's**: `TestSGLangRadix` "
    "(every property the pool offers, with `adopt_twins=False`) and the two twin-plan tests "
    "(with and without SGLang's own way of pointing a request at the tree's twin pages).",
    "- **Not reached by the adapter** (not run): G27 and G28, in SGLang's `_insert_cache` "
    "and `checkpoint`, which take a scheduler request; the adapter does those steps itself "
    "(insert, free the duplicates, point the row at the tree's slots, move the lock), so a "
    "bug there is one the kit cannot see.",
    "- **Missed because the adapter gives SGLang page-aligned keys only**: G03 and G04. "
    "The adapter cuts every key to whole pages itself before SGLang sees it (its lookup "
    "keys to `min(len, max_length) // page * page`, its checkpoint to the full declared "
    "pages, its truncate to the whole pages kept), so `page_aligned` is the identity on "
    "them and no key is empty only after alignment. SGLang's scheduler gives it raw token "
    "ids, which is where both bugs bite; the adapter does not reach that path.",
    "- **Missed because the kit's selection runs SGLang's own insert paths only where they "
    "cannot show**: G12 and G13. With `adopt_twins=False` (the selection's pool) the adapter "
    "inserts a row's pages only where the tree holds no more of its key than the row's "
    "locked prefix, which a lookup split at a node's edge: an insert never meets a match "
    "ending inside a node (G12's case), and it does not use the prefix length `insert` "
    "returns (G13's). The twin-plan test runs SGLang's way (`adopt_twins=True`), where G13 "
    "makes the adapter free none of the request's twin pages: the twin page leaks, but that "
    "test checks the rows it returns (still the tree's), not the books.",
    "- **The contract allows it**: G15. An eviction that takes every evictable leaf, not "
    "just the shortfall, loses cached prefixes but no row and no book: the contract (9.3) "
    "lets a pool evict evictable blocks by any policy and bounds no hit count.",
    "- **Not drawn**: G16 (a locked parent pushed for eviction once its last child goes). "
    "It bites only when one eviction must go past an unlocked leaf into its parent, which "
    "another row holds locked: a tight pool, a row locked on a prefix, another row's "
    "longer tail left unlocked, and an append short of more pages than the tail holds. The "
    "ci profile's draws did not bring that about.",
    "- **Equivalent**: G14 (`len(value)` for `len(key)` in the evictable count: the inserted "
    "key and value are the same length there, as #10637's fix made them) can change no "
    "result.",
)


def engine_note(counts: dict[str, int], seconds: float, source: str) -> str:
    return (
        "None run (see the notes below): SGLang's wheel ships no radix cache or allocator "
        "test, 0.5.23 has no sdist on PyPI, and its repository at the v0.5.23 tag could not "
        "be had here; the column says `not run` for every mutant."
    )


ENGINE = Engine(
    name="SGLang",
    package="sglang",
    version="0.5.23",
    files={
        RADIX: "eea7015fcf678167ac7296b08c8dc568ccbe42a4bb106da23b33a7c59debec01",
        PAGED: "c72f28d9c5b953a05fcc0a0451307ecdbfbfb756eca3f0073f7be3eb737d38f6",
    },
    tracker="https://github.com/sgl-project/sglang/",
    mutants=MUTANTS,
    # Not the file's yardstick check: a mutant's line is not the original, by design
    kit_suites={POOL: ("tests/test_found_in_the_wild_serving.py", "-knot yardstick")},
    kit_note=(
        "tests/test_found_in_the_wild_serving.py as CI runs it: every property of the kit "
        "the adapter of `kvimpl/sglang_radix.py` offers (`SGLangRadixPool`, SGLang's "
        "`RadixCache` and `PagedTokenToKVPoolAllocator` doing the bookkeeping), ci profile, "
        "and the file's two twin-plan checks (not its check that the mutants apply), "
        "stopping at the first failure."
    ),
    engine_files=(),
    engine_tests=(),
    engine_note=engine_note,
    notes=NOTES,
    path_env="KVCHECK_SGLANG_PATH",
    no_tests="no SGLang test of 0.5.23 could be had",
)
