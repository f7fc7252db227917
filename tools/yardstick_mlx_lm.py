"""The mlx-lm part of the mutation yardstick (tools/mutation_yardstick.py): one-line mutants
of mlx-lm's KV caches (``mlx_lm/models/cache.py`` of mlx-lm 0.32.2: ``KVCache``,
``QuantizedKVCache``, ``RotatingKVCache``, ``BatchKVCache``) in methods the adapters of
``kvimpl/mlx.py`` reach, each written as the cited thread of mlx-lm's tracker (or of a project
built on its caches) shows such a bug or fixes one; the kit's properties on those adapters;
and mlx-lm's own cache tests.

    python tools/mutation_yardstick.py mlx_lm --python /tmp/hfvenv/bin/python \\
        --engine-source /path/to/unpacked/mlx_lm-0.32.2

mlx-lm's wheel ships no tests; its sdist on PyPI (``pip download --no-deps --no-binary :all:
mlx-lm==0.32.2``) does, and its ``mlx_lm/models/cache.py`` is byte for byte the installed one.
"""

from __future__ import annotations

from mutation_yardstick import Engine, Mutant, conformance_suites, tally

FILE = "models/cache.py"
PLAIN, QUANTIZED, ROTATING, BATCH = (
    "MLXKVCache",
    "MLXQuantizedKVCache",
    "MLXRotatingKVCache",
    "MLXBatchKVCache",
)

MUTANTS = (
    Mutant(
        "X01",
        FILE,
        "KVCache.update_and_fetch",
        "self.values = self.values[..., :prev, :]",
        "self.values = self.values",
        "growing after a trim cuts the stale rows off the keys only",
        ("waybarrios/vllm-mlx/pull/385", "nicedreamzapp/claude-code-local/pull/47"),
        (PLAIN,),
    ),
    Mutant(
        "X02",
        FILE,
        "KVCache.update_and_fetch",
        "n_steps = (self.step + keys.shape[2] - 1) // self.step",
        "n_steps = keys.shape[2] // self.step",
        "the buffer grows by whole steps rounded down: a short chunk gets no room",
        ("issues/1914",),
        (PLAIN,),
    ),
    Mutant(
        "X03",
        FILE,
        "KVCache.trim",
        "n = min(self.offset, n)",
        "n = n",
        "trim takes more tokens than the cache holds",
        ("issues/1776",),
        (PLAIN,),
    ),
    Mutant(
        "X04",
        FILE,
        "KVCache.keys_and_values",
        "if self.offset < self.keys.shape[2]:",
        "if self.offset < self.keys.shape[2] - 1:",
        "a buffer one row short of full is returned whole, its unused row included",
        ("waybarrios/vllm-mlx/pull/385",),
        (PLAIN,),
    ),
    Mutant(
        "X05",
        FILE,
        "QuantizedKVCache.update_and_fetch",
        "self.values[i][..., prev : self.offset, :] = values[i]",
        "self.values[i][..., prev : self.offset, :] = keys[i]",
        "the quantized keys are written into the value buffer",
        ("Blaizzy/mlx-vlm/issues/1310",),
        (QUANTIZED,),
    ),
    Mutant(
        "X06",
        FILE,
        "QuantizedKVCache.trim",
        "self.offset -= n",
        "self.offset -= n - 1",
        "trim keeps one token too many",
        ("waybarrios/vllm-mlx/pull/69",),
        (QUANTIZED,),
    ),
    Mutant(
        "X07",
        FILE,
        "QuantizedKVCache.update_and_fetch",
        "if prev % self.step != 0:",
        "if prev % self.step == 0:",
        "growing after a trim keeps the stale rows and cuts an aligned buffer",
        ("waybarrios/vllm-mlx/pull/69", "waybarrios/vllm-mlx/pull/385"),
        (QUANTIZED,),
    ),
    Mutant(
        "X08",
        FILE,
        "RotatingKVCache._update_concat",
        "trim_size = self._idx - self.max_size + 1",
        "trim_size = self._idx - self.max_size + 2",
        "a chunk onto a full window trims one row too many",
        ("issues/1914",),
        (ROTATING,),
    ),
    Mutant(
        "X09",
        FILE,
        "RotatingKVCache._trim",
        "to_cat = [v[..., : self.keep, :], v[..., trim_size + self.keep :, :]]",
        "to_cat = [v[..., trim_size:, :]]",
        "trimming the window drops the kept first tokens with the oldest",
        ("lmstudio-ai/mlx-engine/pull/192",),
        (ROTATING,),
    ),
    Mutant(
        "X10",
        FILE,
        "RotatingKVCache._temporal_order",
        "v[..., : self.keep, :],",
        "v[..., :0, :],",
        "putting a wrapped ring in order leaves out the kept first tokens",
        ("pull/1100",),
        (ROTATING,),
    ),
    Mutant(
        "X11",
        FILE,
        "RotatingKVCache._update_in_place",
        "if self._idx == self.max_size:",
        "if self._idx > self.max_size:",
        "the ring wraps one token late",
        ("issues/1776",),
        (ROTATING,),
    ),
    Mutant(
        "X12",
        FILE,
        "RotatingKVCache._update_in_place",
        "self._idx = self.keep",
        "self._idx = 0",
        "the ring wraps onto the kept first tokens",
        ("lmstudio-ai/mlx-engine/pull/192",),
        (ROTATING,),
    ),
    Mutant(
        "X13",
        FILE,
        "RotatingKVCache.trim",
        "self._idx -= n",
        "pass",
        "trim moves the offset but not the write position",
        ("pull/999", "ml-explore/mlx-swift-lm/pull/584"),
        (ROTATING,),
    ),
    Mutant(
        "X14",
        FILE,
        "RotatingKVCache.is_trimmable",
        "return self.offset < self.max_size",
        "return self.offset <= self.max_size",
        "a ring that has just wrapped still says it can be trimmed",
        ("waybarrios/vllm-mlx/issues/678", "pull/999"),
        (ROTATING,),
    ),
    Mutant(
        "X15",
        FILE,
        "BatchKVCache.update_and_fetch",
        "self.offset = self.offset + keys.shape[2]",
        "self.offset = self.offset + 1",
        "the rows' offsets count updates, not tokens",
        ("pull/1100", "issues/1699"),
        (BATCH,),
    ),
    Mutant(
        "X16",
        FILE,
        "BatchKVCache.finalize",
        "self.left_padding += padding",
        "pass",
        "rolling the right pads to the left does not count them as left padding",
        ("pull/1746", "Blaizzy/mlx-vlm/issues/1889"),
        (BATCH,),
    ),
    Mutant(
        "X17",
        FILE,
        "BatchKVCache.finalize",
        "self.values = dynamic_roll(self.values, padding[:, None], axis=2)",
        "self.values = self.values",
        "the right pads are rolled out of the keys only",
        ("pull/1746",),
        (BATCH,),
    ),
    Mutant(
        "X18",
        FILE,
        "BatchKVCache.filter",
        "self.left_padding = self.left_padding[batch_indices]",
        "self.left_padding = self.left_padding[: len(batch_indices)]",
        "filtering keeps the left padding of the first rows, not of the rows kept",
        ("Blaizzy/mlx-vlm/issues/1889", "pull/1736"),
        (BATCH,),
    ),
    Mutant(
        "X19",
        FILE,
        "BatchKVCache.filter",
        "min_left_pad = min(self.left_padding.tolist())",
        "min_left_pad = max(self.left_padding.tolist())",
        "filtering shifts by the largest left pad, cutting the longer rows",
        ("pull/1824", "pull/1736"),
        (BATCH,),
    ),
    Mutant(
        "X20",
        FILE,
        "BatchKVCache.extend",
        "left = max_idx - c._idx",
        "left = 0",
        "joining batches does not right-justify the shorter one",
        ("pull/1141",),
        (BATCH,),
    ),
    Mutant(
        "X21",
        FILE,
        "BatchKVCache.trim",
        "self.offset = self.offset - n",
        "pass",
        "trim leaves the rows' offsets as they were",
        ("issues/1776", "pull/1736"),
        (BATCH,),
    ),
    Mutant(
        "X22",
        FILE,
        "BatchKVCache.prepare",
        "if right_padding is not None and max(right_padding) > 0:",
        "if right_padding is not None and max(right_padding) > 1:",
        "a right pad of one token is never rolled away",
        ("pull/1746",),
        (BATCH,),
    ),
)

TESTS = ("tests/test_prompt_cache.py", "tests/test_models.py")


NOTES = (
    "- **The kit's draws aim at `KVCache`'s steps** (`--kv-page=256`, the rows it grows its "
    "buffer by): a trim followed by a growth across a step is where X01 sits, and without "
    "that aim the ci draws stay under 256 rows.",
    "- **Missed because the adapter's selection fails on the pristine install** (findings "
    "of docs/found-in-the-wild.md): X06 and X07. `QuantizedKVCache`'s row checks fail "
    "without a mutant by M7 (`mx.quantize` errs by up to a whole step, which "
    "`kvref.Quantized` cannot declare: its grid passes through 0), so only `logits`, "
    "`contents` and `reset` run on it; `truncate` and `lengths`, which a trim keeping one "
    "token too many or a growth after a trim would fail, are left out.",
    "- **Reached by bad input only**: X03 (a trim of more tokens than the cache holds). A "
    "valid truncate never asks for more than is held; the bad-truncate property is left out "
    "of every selection, and on `KVCache` it fails on the pristine install anyway (M3: "
    "`trim` takes any count).",
    "- **Equivalent in results**: X14 lets a ring be trimmed when `offset == max_size`, when "
    "no row has been overwritten yet: the trim loses nothing (it relaxes finding M5 by one "
    "token), so no correct check can fail.",
)


def engine_note(counts: dict[str, int], seconds: float, source: str) -> str:
    return (
        "From mlx-lm's sdist of 0.32.2 (`mlx_lm-0.32.2.tar.gz` from PyPI, whose "
        "`mlx_lm/models/cache.py` is byte for byte the installed one): "
        + ", ".join(f"`{path}`" for path in TESTS)
        + ", run on mlx's CPU backend, Hub offline. "
        + tally(counts, seconds)
        + " The failures need models from the Hub."
    )


ENGINE = Engine(
    name="mlx-lm",
    package="mlx_lm",
    version="0.32.2",
    files={FILE: "c96cb169fd5e0ec4584a162dd61dc62ab08ccdca03a9850f8a491ce6809145e6"},
    tracker="https://github.com/ml-explore/mlx-lm/",
    mutants=MUTANTS,
    # KVCache grows its buffer in steps of 256 rows (KVCache.step): the draws aim at those
    # edges as at a page's, where a trim and the next growth meet.
    kit_suites=conformance_suites("kvimpl.mlx", MUTANTS, {PLAIN: ("--kv-page=256",)}),
    kit_note=(
        "On the adapter of `kvimpl/mlx.py` whose cache runs the mutated line, every property "
        "of the kit it offers on valid input that passes on the pristine install (the "
        "bad-input properties are left out, as for transformers), ci profile, stopping at "
        "the first failure."
    ),
    engine_files=TESTS,
    engine_tests=TESTS,
    engine_note=engine_note,
    engine_env={"HF_HUB_OFFLINE": "1"},
    notes=NOTES,
)
