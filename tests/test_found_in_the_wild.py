"""Defects the suite found in Hugging Face transformers' cache layers (kvimpl/hf.py).

Each test runs a check of the suite on an adapter with a small fixed input and asserts that
the check FAILS with the message the suite printed: it passes while the defect is there.
Found with transformers 5.24.0; docs/found-in-the-wild.md has the details. Two tests are
defects found by hand that the suite cannot draw; they call transformers directly. The last test
checks that the mutants of the yardstick (tools/yardstick_transformers.py, docs/yardstick.md)
still apply to the installed transformers.
"""

from pathlib import Path

import pytest

pytest.importorskip(
    "transformers", reason="the adapters need transformers: pip install 'kvcache-verify[hf]'"
)

import torch
from transformers.cache_utils import (
    DynamicSlidingWindowLayer,
    StaticLayer,
    StaticSlidingWindowLayer,
)

from kvcheck import asserts as kvassert
from kvcheck import badinput as kvbad
from kvcheck import failures
from kvcheck import strategies as kvst
from kvcheck import tensors as kvtensors
from kvcheck.harness import warm
from kvcheck.plan_events import Feed, Truncate
from kvcheck.properties import edits, rejection
from kvimpl.hf import (
    TESTED_WITH,
    TRANSFORMERS_VERSION,
    HFDynamicLayer,
    HFDynamicSlidingWindowLayerRecording,
    HFStaticLayer,
)
from kvref import CacheContractError, CacheSpec, ModelConfig

CASES = {case.name: case for case in kvbad.BAD_APPENDS}


def plan(chunks: tuple[int, ...], max_length: int = 8, dtype=torch.float64) -> kvst.CachePlan:
    return kvst.CachePlan(CacheSpec(1, 1, 2, max_length, dtype, torch.device("cpu")), chunks, 1)


def test_static_layer_counts_the_tokens_of_a_refused_update():
    """StaticLayer.update adds the new tokens to cumulative_length before it writes them, so
    an update that fails (here: a value that is not a tensor) leaves get_seq_length() counting
    tokens it never stored (transformers 5.24.0)."""
    with pytest.raises(
        failures.RefusalChangedState, match=r"length is 2 after a refused call, was 1"
    ):
        rejection.check_bad_append(HFStaticLayer, plan((1,)), CASES["value not a tensor"])


def test_static_layer_counts_the_tokens_of_a_refused_overflow():
    """Past max_cache_len, StaticLayer.update raises IndexError, but only after counting the
    tokens (and writing the keys that fit): the layer holding 3 of 4 reports 5, and every
    later update fails until reset() (transformers 5.24.0)."""
    spec_plan = plan((3,), max_length=4)
    cache = warm(HFStaticLayer, spec_plan)
    rows = kvtensors.random_rows(spec_plan.spec, 2, seed=0)
    assert kvassert.raised_by(lambda: cache.append(rows, rows)) is not None
    with pytest.raises(
        failures.RefusalChangedState, match=r"length is 5 after a refused call, was 3"
    ):
        kvassert.assert_unchanged(cache, spec_plan.spec, who="the cache", where="an overflow")


def test_static_layer_gives_wrong_logits_after_a_refused_call():
    """After a refused call (a batch the cache was not built for), the next valid call on a
    StaticLayer runs at the wrong position next to an unwritten all-zero row: cached logits
    differ from uncached ones, with no error. transformers' own StaticCache does the same
    with a real model (docs/found-in-the-wild.md). One layer, so our model's guard
    against layers of different lengths cannot stop it (transformers 5.24.0)."""
    config = ModelConfig(vocab_size=11, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4)
    model = kvtensors.build_model(config, torch.float64)
    tokens = kvtensors.random_tokens(config, 1, 5, seed=1)
    caches = model.new_caches(HFStaticLayer, batch=1, max_length=8)
    model(tokens[:, :4], caches=caches)
    assert kvassert.raised_by(lambda: model(tokens[:, 4:].repeat(2, 1), caches=caches)) is not None
    with pytest.raises(failures.WrongResults, match=r"cached and uncached logits differ"):
        kvassert.assert_close_at(
            model(tokens[:, 4:], caches=caches),
            model(tokens)[:, 4:],
            what="cached and uncached logits",
            where="the call after a refused one",
            position_axis=1,
            first_position=4,
        )


def test_dynamic_layer_half_applies_an_update_whose_value_fails():
    """DynamicLayer.update concatenates the keys before the values: when the value fails (here:
    not a tensor; equally a value on another device or of another shape) the keys have grown
    and the values have not, and get_seq_length() counts the refused tokens
    (transformers 5.24.0)."""
    with pytest.raises(
        failures.RefusalChangedState, match=r"length is 2 after a refused call, was 1"
    ):
        rejection.check_bad_append(HFDynamicLayer, plan((1,)), CASES["value not a tensor"])


def test_dynamic_layer_silently_promotes_a_wrong_dtype():
    """DynamicLayer grows by torch.cat, which promotes: float64 rows appended to a float32
    layer are accepted and turn the whole cache into float64 (twice the memory), where
    StaticLayer refuses them (transformers 5.24.0)."""
    float32_plan = plan((1,), dtype=torch.float32)
    with pytest.raises(failures.AcceptsBadInput, match=r"wrong dtype: accepted without an error"):
        rejection.check_bad_append(HFDynamicLayer, float32_plan, CASES["wrong dtype"])


def test_dynamic_layer_accepts_keys_and_values_of_different_lengths():
    """DynamicLayer.update accepts a value with more tokens than the key: from then on its keys
    and values have different lengths, and get_seq_length() reports the keys'
    (transformers 5.24.0)."""
    case = CASES["value with one token more than key"]
    with pytest.raises(failures.AcceptsBadInput, match=r"accepted without an error"):
        rejection.check_bad_append(HFDynamicLayer, plan((1,)), case)


def test_static_layer_seq_length_is_a_live_tensor():
    """Found by hand (the adapter must turn the length into an int, so the suite cannot see it):
    StaticLayer.get_seq_length(), annotated -> int, returns its own cumulative_length tensor,
    which later updates change in place: a length read before an update equals the one read
    after it (transformers 5.24.0; StaticCache.get_seq_length() returns the same tensor)."""
    layer = StaticLayer(max_cache_len=8)
    rows = torch.zeros(1, 1, 2, 4)
    layer.update(rows, rows)
    before = layer.get_seq_length()
    layer.update(rows, rows)
    assert int(before) == int(layer.get_seq_length()) == 4  # `before` said 2 when it was read


@pytest.mark.parametrize(
    "make",
    [
        lambda: DynamicSlidingWindowLayer(sliding_window=8),
        lambda: StaticSlidingWindowLayer(max_cache_len=8, sliding_window=8),
    ],
    ids=["DynamicSlidingWindowLayer", "StaticSlidingWindowLayer"],
)
def test_sliding_window_layers_count_the_tokens_of_a_refused_update(make):
    """Found by hand (our CacheSpec has no window yet): the sliding-window layers add to their
    length before writing too, so a refused update (a value of another batch) is counted
    (transformers 5.24.0)."""
    layer = make()
    layer.update(torch.randn(1, 1, 3, 2), torch.randn(1, 1, 3, 2))
    assert kvassert.raised_by(
        lambda: layer.update(torch.randn(1, 1, 2, 2), torch.randn(2, 1, 2, 2))
    )
    assert layer.get_seq_length() == 5  # it holds 3


def test_recording_sliding_layer_loses_a_row_on_a_second_crop():
    """DynamicSlidingWindowLayer after activate_past_recording (as generate sets it before it may
    roll back): a crop trims the layer back to its last W - 1 rows, so a second crop with no
    update between (two rejections back to back, or crop(0) then crop(-1)) slices W - 1 rows
    out of W - 1 and keeps one row fewer than the next query needs, with no error; the next
    update returns too few rows (through a model, the next forward fails on the mask's shape).
    Here W = 4: prompt 7, draft 1, forget 1 then 1 more (transformers 5.24.0)."""
    config = ModelConfig(
        vocab_size=11, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4, window=4
    )
    plan = edits.EditPlan(
        config=config,
        batch=1,
        dtype=torch.float64,
        prompt=7,
        steps=(Feed(0, 1), Truncate(0, 1), Truncate(0, 1), Feed(0, 1)),
        token_seed=0,
    )
    message = r"must return 4 to 7 rows.*returned keys \(1, 1, 3,"
    with pytest.raises(CacheContractError, match=message):
        edits.check_edits(HFDynamicSlidingWindowLayerRecording, plan)


def test_sliding_layer_crop_of_an_empty_cache_raises_attribute_error():
    """Found by the kit in a bad-truncate case (a negative length on an empty cache, refused
    with AttributeError), and by hand for a valid one: DynamicSlidingWindowLayer.crop on a layer
    with no states (new, or after reset()) calls DynamicLayer.crop, which returns early for an
    uninitialized layer, then reads ``self.keys.shape`` of None. So ``DynamicCache(config=...)
    .crop(0)`` raises for a sliding-window model before its first forward or after ``reset()``,
    where a full-attention model's cache takes it as the no-op it is (transformers 5.24.0)."""
    spec = CacheSpec(1, 1, 2, 8, torch.float64, torch.device("cpu"), window=4)
    with pytest.raises(AttributeError, match="'NoneType' object has no attribute 'shape'"):
        HFDynamicSlidingWindowLayerRecording(spec).truncate(0)  # crop(0) of a layer holding nothing
    full = HFDynamicLayer(spec)
    full.truncate(0)  # the full-attention layer: a no-op
    assert full.length == 0


@pytest.mark.skipif(TRANSFORMERS_VERSION != TESTED_WITH, reason="the mutants are of 5.24.0")
def test_yardstick_mutants_apply_to_the_installed_transformers(monkeypatch):
    """Every transformers mutant of the yardstick (tools/yardstick_transformers.py,
    docs/yardstick.md) finds its original line, once, where it says in the installed
    transformers, and compiles."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "tools"))
    from mutation_yardstick import check_installed

    assert len(check_installed("transformers").mutants) >= 20
