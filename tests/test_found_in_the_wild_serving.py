"""SGLang's prefix cache (its ``RadixCache`` and paged allocator, kvimpl/sglang_radix.py)
under the kit's serving-pool properties: prefix caching, offload and the pool's books.

Skipped where SGLang's source is absent (``pip install --no-deps sglang==0.5.23``, or
``KVCHECK_SGLANG_PATH``). Found with SGLang 0.5.23; the
details in docs/found-in-the-wild.md.
"""

from importlib.metadata import distributions
from pathlib import Path

import pytest

from kvimpl import sglang_radix

if sglang_radix.sglang_root() is None:
    pytest.skip(
        "SGLang's source is not installed: pip install --no-deps --target DIR sglang==0.5.23 "
        "and set KVCHECK_SGLANG_PATH=DIR (its wheel pins another torch: no extra can say "
        "--no-deps)",
        allow_module_level=True,
    )

import torch

from kvcheck import CacheTests, failures
from kvcheck.properties import serving
from kvimpl.sglang_radix import SGLangRadixPool
from kvref import ModelConfig


class TestSGLangRadix(CacheTests):
    """Every property the pool offers, with SGLang doing the bookkeeping: prefix caching,
    offload, the pool's books and its refusal when exhausted, fork, truncate, reorder, the
    model's logits. SGLang keeps a request's twin pages here (``adopt_twins=False``): its
    own way, pointing a request at the tree's twin, is the first finding below.

    Bad input is not run: SGLang's RadixCache has no per-layer API to refuse it with (the
    scheduler validates requests long before), and the adapter adds no validation of its own,
    so a bad append, truncate or reorder reaches torch indexing as it is (an adapter limit:
    bad append crashes on meta tensors, truncate(-1) slices from the end, float indices
    fail later)."""

    factory = SGLangRadixPool(adopt_twins=False)
    cache_name = "SGLangRadixPool"
    test_bad_append_is_refused_and_changes_nothing = None
    test_bad_truncate_is_refused_and_changes_nothing = None
    test_bad_reorder_is_refused_and_changes_nothing = None


def _twin_plan(dtype=torch.float64) -> serving.ServingPlan:
    """r0 computes a 32-token prompt (31 rows in one chunk, the 32nd alone); r1, with the same
    32 tokens and one more, hits r0's first 7 pages and computes the rest in one chunk, so
    that its own copy of page 8 is a twin of r0's, computed in another chunk."""
    config = ModelConfig(
        vocab_size=5, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4, ffn_dim=64, seed=5
    )
    system = tuple([0, 1] * 16)
    return serving.ServingPlan(
        config=config,
        dtype=dtype,
        vocab=2,
        systems=(system,),
        events=(
            serving.Arrive(request=0, batch=1, salt=None, system=0, shared=32, own=0, seed=1),
            serving.Feed(request=0, size=31),
            serving.Arrive(request=1, batch=1, salt=None, system=0, shared=32, own=1, seed=2),
            serving.Feed(request=0, size=1),
            serving.Feed(request=1, size=33),
            serving.Leave(request=0, how="drop"),
            serving.Leave(request=1, how="drop"),
        ),
    )


def test_sglang_points_a_request_at_the_trees_twin_of_its_rows():
    """SGLang's RadixCache._insert_cache (radix_cache.py, the free_segment of
    kv_indices[cache_protected_len:prefix_len] after insert) frees a request's pages that
    the tree already holds for the same tokens and checkpoint() points the request at the
    tree's copy: rows another request computed (here in another chunk: other bits) replace
    the ones this request wrote, so its next read returns rows it was not given. By design
    (it saves the memory of twins; the values agree to rounding), not a defect; the kit's
    rule is bit for bit (SGLang 0.5.23)."""
    with pytest.raises(
        failures.DataLoss, match=r"keys row \d+ returned by append is not the row appended there"
    ):
        serving.check_serving(SGLangRadixPool(adopt_twins=True), _twin_plan())


def test_the_twin_plan_passes_when_the_request_keeps_its_own_copy():
    serving.check_serving(SGLangRadixPool(adopt_twins=False), _twin_plan())


def _sglang_version() -> str | None:
    """The version of the SGLang the adapter loads, from the dist-info beside its files."""
    found = [d.version for d in distributions(name="sglang", path=[sglang_radix.sglang_root()])]
    return found[0] if found else None


@pytest.mark.skipif(
    _sglang_version() != sglang_radix.SGLANG_VERSION,
    reason="the mutants are of SGLang 0.5.23 (its dist-info not found beside its files, or "
    "another version)",
)
def test_yardstick_mutants_apply_to_the_installed_sglang(monkeypatch):
    """Every SGLang mutant of the yardstick (tools/yardstick_sglang.py, docs/yardstick.md)
    finds its original line, once, where it says in the SGLang files the adapter loads, and
    compiles."""
    monkeypatch.setenv("KVCHECK_SGLANG_PATH", sglang_radix.sglang_root())
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "tools"))
    from mutation_yardstick import check_installed

    assert len(check_installed("sglang").mutants) >= 20
