"""The transformers part of the mutation yardstick (tools/mutation_yardstick.py): one-line
mutants of the cache layer classes of ``transformers/cache_utils.py`` (5.24.0) in methods the
adapters of ``kvimpl/hf.py`` reach, each written as the cited thread of transformers' tracker
shows such a bug or fixes one; the kit's properties on those adapters; and transformers' own
``tests/utils/test_cache_utils.py``.

    python tools/mutation_yardstick.py transformers --python /tmp/hfvenv/bin/python \\
        --engine-source /path/to/transformers/.git --engine-commit c7e57f79... --deps DIR

The engine's tests need ``parameterized``, which the kit's environment lacks: ``--deps DIR``
is a ``pip install --target DIR parameterized``.
"""

from __future__ import annotations

from mutation_yardstick import Engine, Mutant, conformance_suites, tally

FILE = "cache_utils.py"

MUTANTS = (
    Mutant(
        "M01",
        FILE,
        "DynamicLayer.crop",
        "self.keys = self.keys[..., : -abs(tokens_to_remove), :]",
        "self.keys = self.keys[..., : self.keys.shape[-2] - abs(tokens_to_remove) + 1, :]",
        "crop keeps one key too many",
        ("issues/47433", "pull/36616"),
        ("HFDynamicLayer",),
    ),
    Mutant(
        "M02",
        FILE,
        "DynamicLayer.crop",
        "self.values = self.values[..., : -abs(tokens_to_remove), :]",
        "self.values = self.values",
        "crop cuts the keys only",
        ("issues/47433",),
        ("HFDynamicLayer",),
    ),
    Mutant(
        "M03",
        FILE,
        "DynamicLayer.crop",
        "if tokens_to_remove == 0 or not self.is_initialized:",
        "if tokens_to_remove >= -1 or not self.is_initialized:",
        "a crop of one token is taken for crop(0) and does nothing",
        ("pull/47720", "pull/36616"),
        ("HFDynamicLayer",),
    ),
    Mutant(
        "M04",
        FILE,
        "DynamicLayer.update",
        "self.values = torch.cat([self.values, value_states], dim=-2)",
        "self.values = torch.cat([value_states, self.values], dim=-2)",
        "update puts the new values before the old ones",
        ("issues/37574",),
        ("HFDynamicLayer",),
    ),
    Mutant(
        "M05",
        FILE,
        "DynamicLayer.batch_repeat_interleave",
        "self.keys = self.keys.repeat_interleave(repeats, dim=0)",
        "self.keys = self.keys.repeat(repeats, 1, 1, 1)",
        "batch_repeat_interleave tiles the keys instead of interleaving them",
        ("pull/36083",),
        ("HFDynamicLayerExpand",),
    ),
    Mutant(
        "M06",
        FILE,
        "DynamicLayer.batch_select_indices",
        "self.values = self.values[indices, ...]",
        "self.values = self.values",
        "batch_select_indices selects the keys only",
        ("pull/20213",),
        ("HFDynamicLayerSelect", "HFDynamicLayerExpand"),
    ),
    Mutant(
        "M07",
        FILE,
        "CacheLayerMixin.reorder_cache",
        "self.values = self.values.index_select(0, beam_idx.to(self.values.device))",
        "self.values = self.values",
        "reorder_cache reorders the keys only",
        ("issues/46612", "pull/48700"),
        ("HFDynamicLayer", "HFStaticLayer"),
    ),
    Mutant(
        "M08",
        FILE,
        "CacheLayerMixin.reorder_cache",
        "if self.get_seq_length() > 0:",
        "if self.get_seq_length() > 1:",
        "reorder_cache skips a cache holding one token",
        ("issues/46612",),
        ("HFDynamicLayer", "HFStaticLayer"),
    ),
    Mutant(
        "M09",
        FILE,
        "StaticLayer.update",
        "cache_position = torch.arange(kv_length, device=self.device) + self.cumulative_length",
        "cache_position = torch.arange(1, kv_length + 1, device=self.device)"
        " + self.cumulative_length",
        "update writes one slot late (cache_position off by one)",
        ("issues/30400", "pull/44181"),
        ("HFStaticLayer",),
    ),
    Mutant(
        "M10",
        FILE,
        "StaticLayer.update",
        "self.cumulative_length.add_(kv_length)",
        "self.cumulative_length.add_(1)",
        "cumulative_length counts updates, not tokens",
        ("pull/46446", "pull/35299"),
        ("HFStaticLayer",),
    ),
    Mutant(
        "M11",
        FILE,
        "StaticLayer.update",
        "self.values.index_copy_(2, cache_position, value_states)",
        "self.values.index_copy_(2, cache_position, key_states)",
        "update writes the keys into the value buffer",
        ("pull/30476",),
        ("HFStaticLayer",),
    ),
    Mutant(
        "M12",
        FILE,
        "StaticLayer.lazy_initialization",
        "(self.batch_size, self.num_heads, self.max_cache_len, self.k_head_dim),",
        "(self.batch_size, self.num_heads, self.max_cache_len - 1, self.k_head_dim),",
        "the key buffer is one row short of max_cache_len",
        ("pull/32932",),
        ("HFStaticLayer",),
    ),
    Mutant(
        "M13",
        FILE,
        "StaticLayer.get_seq_length",
        "return self.cumulative_length if self.is_initialized else 0",
        "return self.keys[0, 0].any(dim=-1).sum() if self.is_initialized else 0",
        "get_seq_length counts the non-zero rows (the pre-4.42 way)",
        ("issues/30377",),
        ("HFStaticLayer",),
    ),
    Mutant(
        "M14",
        FILE,
        "StaticLayer.crop",
        "self.cumulative_length.sub_(abs(tokens_to_remove))",
        "self.cumulative_length.sub_(abs(tokens_to_remove) - 1)",
        "crop keeps one token too many",
        ("pull/45745",),
        ("HFStaticLayer", "HFStaticSlidingWindowLayerCroppable"),
    ),
    Mutant(
        "M15",
        FILE,
        "StaticLayer.crop",
        "if tokens_to_remove > 0:",
        "if tokens_to_remove >= 0:",
        "crop(0) is refused",
        ("pull/47720",),
        ("HFStaticLayer", "HFStaticSlidingWindowLayerCroppable"),
    ),
    Mutant(
        "M16",
        FILE,
        "DynamicSlidingWindowLayer.update",
        "self.keys = full_key_states[:, :, -self.sliding_window + 1 :, :]",
        "self.keys = full_key_states[:, :, -self.sliding_window + 2 :, :]",
        "the window trims a key one token early",
        ("issues/37574", "pull/38046"),
        ("HFDynamicSlidingWindowLayer", "HFDynamicSlidingWindowLayerRecording"),
    ),
    Mutant(
        "M17",
        FILE,
        "DynamicSlidingWindowLayer.update",
        "self.cumulative_length += key_states.shape[-2]",
        "self.cumulative_length += 1",
        "cumulative_length counts updates, not tokens",
        ("pull/35299",),
        ("HFDynamicSlidingWindowLayer", "HFDynamicSlidingWindowLayerRecording"),
    ),
    Mutant(
        "M18",
        FILE,
        "DynamicSlidingWindowLayer.get_seq_length",
        "return self.cumulative_length",
        "return self.keys.shape[-2] if self.is_initialized else 0",
        "get_seq_length returns the rows held, never more than the window",
        ("pull/38156", "pull/34352"),
        ("HFDynamicSlidingWindowLayer", "HFDynamicSlidingWindowLayerRecording"),
    ),
    Mutant(
        "M19",
        FILE,
        "DynamicSlidingWindowLayer.update",
        "num_visible = self.sliding_window - 1 + key_states.shape[-2]",
        "num_visible = self.sliding_window - 2 + key_states.shape[-2]",
        "while recording the past, update returns one row too few",
        ("pull/47447",),
        ("HFDynamicSlidingWindowLayerRecording",),
    ),
    Mutant(
        "M20",
        FILE,
        "DynamicSlidingWindowLayer.crop",
        "self.keys = self.keys[:, :, -self.sliding_window + 1 - tokens_to_remove"
        " : -tokens_to_remove, :]",
        "self.keys = self.keys[:, :, -self.sliding_window + 2 - tokens_to_remove"
        " : -tokens_to_remove, :]",
        "crop past the window keeps one key too few",
        ("pull/47447",),
        ("HFDynamicSlidingWindowLayerRecording",),
    ),
    Mutant(
        "M21",
        FILE,
        "DynamicSlidingWindowLayer.crop",
        "self.cumulative_length = self.keys.shape[-2]",
        "self.cumulative_length = self.cumulative_length",
        "crop within the window leaves the length as it was",
        ("issues/47433",),
        ("HFDynamicSlidingWindowLayerRecording",),
    ),
    Mutant(
        "M22",
        FILE,
        "StaticSlidingWindowLayer.update",
        "is_full = current_length >= self.max_cache_len",
        "is_full = current_length > self.max_cache_len",
        "the buffer counts as full one token late (strict inequality)",
        ("pull/38046", "issues/37574"),
        ("HFStaticSlidingWindowLayer",),
    ),
    Mutant(
        "M23",
        FILE,
        "StaticSlidingWindowLayer.update",
        "new_keys = self.keys.roll(-1, dims=-2)",
        "new_keys = self.keys.roll(1, dims=-2)",
        "a full buffer rolls its keys the wrong way",
        ("pull/30970",),
        ("HFStaticSlidingWindowLayer",),
    ),
    Mutant(
        "M24",
        FILE,
        "StaticSlidingWindowLayer.update",
        "full_key_states = torch.cat((self.keys[:, :, 1:, :], key_states), dim=-2)",
        "full_key_states = torch.cat((self.keys[:, :, 2:, :], key_states), dim=-2)",
        "several tokens onto a full buffer drop one key too many",
        ("pull/40893",),
        ("HFStaticSlidingWindowLayer",),
    ),
    Mutant(
        "M25",
        FILE,
        "StaticSlidingWindowLayer.reset",
        "self.cumulative_length_int = 0",
        "self.cumulative_length_int = self.cumulative_length_int",
        "reset leaves the python-int length as it was",
        ("pull/48809", "pull/48509"),
        ("HFStaticSlidingWindowLayer", "HFStaticSlidingWindowLayerCroppable"),
    ),
    Mutant(
        "M26",
        FILE,
        "StaticSlidingWindowLayer.crop",
        "self.cumulative_length_int -= abs(tokens_to_remove)",
        "self.cumulative_length_int -= abs(tokens_to_remove) - 1",
        "crop keeps one token too many in the python-int length",
        ("pull/45745",),
        ("HFStaticSlidingWindowLayerCroppable",),
    ),
    Mutant(
        "M27",
        FILE,
        "CacheLayerMixin.offload",
        'self.values = self.values.to("cpu", non_blocking=True)',
        'self.values = self.keys.to("cpu", non_blocking=True)',
        "offload moves the keys into the values",
        ("pull/46748",),
        ("HFDynamicLayerOffloaded",),
    ),
)


NOTES = (
    "- **Where the engine's tests come from.** transformers' sdist of 5.24.0 ships only the "
    "top-level test mixins, not `tests/utils`, and the repository's snapshot is too large to "
    "fetch here (1.3 GB), so v5.24.0's own tag could not be read. The file comes from a fork "
    "that carries upstream main up to 2026-08-10 (`rwkv-rs/transformers-rwkv`, commit "
    "`c7e57f79`, 5.16.0.dev0). Its model-level generation tests (`tests/models/*`, "
    "`tests/generation/test_utils.py`) do not import against 5.24.0's `testing_utils`, so "
    "they are not in the selection; they would reach the layers through `generate` (beam "
    "search, assisted decoding), and may catch some of the mutants the unit tests miss.",
    "- **The one mutant the kit misses, M22, by what the contract allows.** A buffer that "
    'is exactly full takes the "becoming full" branch once: that update returns the W '
    "rows held and the new one, all of them right and in order, one row more than the full "
    "branch's W; the buffer it keeps is right too. The contract lets a window cache return "
    "more than the last W - 1 rows (rule 7), so no property can fail. In transformers the "
    "bug is the mismatch with the layer's own `get_mask_sizes`, which still says W: the "
    "model's attention then fails on the mask's shape. The adapters hand the kit what "
    "`update` returns and never build that mask.",
    "- **Reached through an adapter of its own**: `StaticSlidingWindowLayer.crop` (M26) runs "
    "only where the layer's `is_croppable` is True, its window at least the cache's length; "
    "`HFStaticSlidingWindowLayerCroppable` is that layer (specs without a window), as "
    "`StaticCache` builds it for a sliding layer longer than the generation.",
)


def engine_note(counts: dict[str, int], seconds: float, source: str) -> str:
    commit = source.split()[-1]
    return (
        f"`tests/utils/test_cache_utils.py` of transformers at commit `{commit}` (upstream main "
        "of 2026-08-10, 5.16.0.dev0: the nearest to v5.24.0 that could be read here, see the "
        "notes), run against the installed 5.24.0 with the Hub offline (`HF_HUB_OFFLINE=1`). "
        + tally(counts, seconds)
        + " The failures need models and tokenizers from the Hub, `torch.export`, or the "
        "positive `crop` 5.18 removed; the skips an accelerator."
    )


ENGINE = Engine(
    name="transformers",
    package="transformers",
    version="5.24.0",
    # sha256 of transformers 5.24.0's src/transformers/cache_utils.py (the wheel's and the sdist's)
    files={FILE: "29651e0d89cc34d1af4b7d5d7f2c5dd81b584c8c5336f15652218640ea8465e5"},
    tracker="https://github.com/huggingface/transformers/",
    mutants=MUTANTS,
    kit_suites=conformance_suites("kvimpl.hf", MUTANTS),
    kit_note=(
        "On each adapter of `kvimpl/hf.py` whose layer runs the mutated line (the table names "
        "the first that failed), every property of the kit it offers on valid input that "
        "passes on the pristine install (the bad-input properties are left out: they judge "
        "refusals no mutant here changes), ci profile, stopping at the first failure."
    ),
    engine_files=(
        "tests/__init__.py",
        "tests/utils/__init__.py",
        "tests/utils/test_cache_utils.py",
    ),
    engine_tests=("tests/utils/test_cache_utils.py",),
    engine_note=engine_note,
    engine_env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "CI": "true"},
    notes=NOTES,
)
