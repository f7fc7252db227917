"""mlx-lm's KV caches under the kit (kvimpl/mlx.py), and what it found.

The adapters run under ``CacheTests`` with the properties they hold; each property an adapter
fails is switched off in its class with the finding it is, and one test per finding below
runs the kit's check on a small fixed input and asserts that it FAILS with the message the
kit printed, so that it passes while the defect is there. Found with mlx-lm 0.32.2 on mlx
0.32.4 (``mlx[cpu]``, Linux; torch 2.13.0); docs/found-in-the-wild.md has the details and
repros/mlx_*.py the standalone repros.
"""

from pathlib import Path

import pytest

pytest.importorskip("mlx_lm", reason="the adapters need mlx-lm: pip install 'kvcache-verify[mlx]'")

import torch

from kvcheck import CacheTests, failures
from kvcheck import badinput as kvbad
from kvcheck import strategies as kvst
from kvcheck import tensors as kvtensors
from kvcheck.properties import edits, rejection
from kvimpl.mlx import (
    MLX_LM_VERSION,
    TESTED_WITH,
    MLXBatchKVCache,
    MLXKVCache,
    MLXQuantizedKVCache,
    MLXRotatingKVCache,
)
from kvref import CacheSpec
from kvref.capabilities import may_refuse_truncate

CASES = {case.name: case for case in kvbad.BAD_APPENDS}
TRUNCATES = {case.name: case for case in kvbad.BAD_TRUNCATES}
SCALE = 0.25  # a quarter of the profile's examples: the class runs in about a minute


def plan(chunks, *, head_dim=2, dtype=torch.float64, window=None, max_length=8):
    spec = CacheSpec(1, 1, head_dim, max_length, dtype, torch.device("cpu"), window=window)
    return kvst.CachePlan(spec, tuple(chunks), 1)


class TestMLXKVCache(CacheTests):
    """``KVCache``: every property run holds, but bad input and bad truncates (below)."""

    factory = MLXKVCache
    examples_scale = SCALE
    # Findings (tests below): a refused update is counted; a warm cache broadcasts a rank-3
    # key and casts another dtype; trim takes a negative or float count.
    test_bad_append_is_refused_and_changes_nothing = None
    test_bad_model_call_is_refused_before_any_cache_changes = None
    test_bad_truncate_is_refused_and_changes_nothing = None
    # The state machine's bad model calls meet the first finding too (in some draws).
    test_any_sequence_of_prefill_decode_reset_and_bad_calls = None


class TestMLXRotatingKVCache(CacheTests):
    """``RotatingKVCache`` as a window with sinks: valid appends hold every property, sinks
    included; every property that truncates a window that has filled fails (below)."""

    factory = MLXRotatingKVCache
    examples_scale = SCALE
    # Findings: a refused update is half applied; trim refused once offset reaches max_size,
    # even to 0 (which fails truncate, stateful, sharded and interactions, whose plans
    # truncate; RotatingKVCacheWithoutTrim below runs them without truncate).
    test_bad_append_is_refused_and_changes_nothing = None
    test_bad_truncate_is_refused_and_changes_nothing = None
    test_rollbacks_and_rewinds_act_on_the_history_left = None
    test_any_sequence_of_prefill_decode_reset_and_bad_calls = None
    test_sharded_ranks_equal_the_unsharded_model = None
    test_a_window_with_sinks_equals_the_uncached_sink_model = None
    test_every_offered_pair_of_events = None


class RotatingKVCacheWithoutTrim(MLXRotatingKVCache):
    """The same adapter, offering no truncate: RotatingKVCache as generation uses it without
    rollback, so that the plans that truncate (stateful, sharded, attention sinks) run on."""

    truncate = None


class TestMLXRotatingKVCacheWithoutTrim(CacheTests):
    """Without truncates, every property run holds on valid input, sinks included."""

    factory = RotatingKVCacheWithoutTrim
    examples_scale = SCALE
    test_bad_append_is_refused_and_changes_nothing = None  # half applied (below)
    # Its bad model calls meet the same finding, and an empty cache takes any first batch.
    test_any_sequence_of_prefill_decode_reset_and_bad_calls = None


class TestMLXBatchKVCache(CacheTests):
    """``BatchKVCache``: rows of their own (mixed lengths: ragged right-padded chunks fed
    through prepare/finalize, filter, extend) hold, and every property run on valid input;
    bad input and bad truncates fail as on KVCache (below)."""

    factory = MLXBatchKVCache
    examples_scale = SCALE
    # Findings: a refused update is counted (which the stateful test's bad calls meet too);
    # trim takes a negative count.
    test_bad_append_is_refused_and_changes_nothing = None
    test_bad_model_call_is_refused_before_any_cache_changes = None
    test_any_sequence_of_prefill_decode_reset_and_bad_calls = None
    test_bad_truncate_is_refused_and_changes_nothing = None


# ---------------------------------------------------------------- KVCache (and the others)


@pytest.mark.parametrize("factory", [MLXKVCache, MLXBatchKVCache], ids=["KVCache", "BatchKVCache"])
def test_a_refused_update_is_counted(factory):
    """update_and_fetch adds to offset before it writes (cache.py:366-367): a value of another
    batch is refused by the write, and the cache then counts a token it never stored."""
    with pytest.raises(
        failures.RefusalChangedState, match=r"length is 2 after a refused call, was 1"
    ):
        rejection.check_bad_append(factory, plan((1,)), CASES["wrong batch"])


def test_a_refused_quantized_update_is_counted():
    """QuantizedKVCache does the same (cache.py:294, before the writes). Found by hand: the
    kit's read-back cannot run on it, whose rows already leave the declared bound (below)."""
    spec = plan((), head_dim=64, dtype=torch.float32).spec
    cache = MLXQuantizedKVCache(spec)
    row = kvtensors.random_rows(spec, 1, seed=0)
    cache.append(row, row)
    with pytest.raises(ValueError, match=r"Cannot broadcast"):
        cache.append(row, row.repeat(2, 1, 1, 1))
    assert cache.length == 2  # it holds 1


@pytest.mark.parametrize("case", ["key of rank 3", "wrong dtype"])
def test_a_warm_cache_broadcasts_or_casts_bad_rows(case):
    """A warm KVCache writes by slice assignment (cache.py:367-368), which broadcasts a key of
    rank 3 over as many token rows as its last axis and casts another dtype, silently."""
    with pytest.raises(failures.AcceptsBadInput, match=f"{case}: accepted without an error"):
        rejection.check_bad_append(MLXKVCache, plan((1,)), CASES[case])


def test_trim_takes_a_count_past_the_rows_held():
    """trim(n) is ``n = min(offset, n); offset -= n`` (cache.py:391-394): truncating past the
    length asks for a negative count, which grows the cache over rows it no longer holds
    (the kit: "keys: row 2 claimed, never written")."""
    with pytest.raises(failures.AcceptsBadInput, match=r"past the length held: accepted"):
        edits.check_bad_truncate(MLXKVCache, plan((2,)), TRUNCATES["past the length held"])


def test_trim_clamps_a_count_past_the_length():
    """A negative target asks to trim more than offset: trim clamps and empties the cache,
    reporting the smaller count, which the adapter turns into the refusal it is."""
    with pytest.raises(
        failures.RefusalChangedState, match=r"length is 0 after a refused call, was 2"
    ):
        edits.check_bad_truncate(MLXKVCache, plan((2,)), TRUNCATES["negative length"])


# ---------------------------------------------------------------- RotatingKVCache


def test_rotating_cache_half_applies_a_refused_update():
    """_update_concat replaces the keys (cache.py:476) before the values fail (477): the next
    one-token update returns one key more than values."""
    with pytest.raises(
        failures.RefusalChangedState, match=r"append returned values shaped \(1, 1, 2, 2\)"
    ):
        rejection.check_bad_append(
            MLXRotatingKVCache, plan((2,)), CASES["value of another width than its spec's"]
        )


def test_rotating_cache_refuses_a_truncate_to_zero():
    """is_trimmable() is offset < max_size (cache.py:544-545): a window of 1 that holds its
    one token refuses to drop it, which no window rule allows (kvref.may_refuse_truncate)."""
    spec = plan((), window=1).spec
    cache = MLXRotatingKVCache(spec)
    row = kvtensors.random_rows(spec, 1, seed=0)
    cache.append(row, row)
    assert not may_refuse_truncate([1], held=1, target=0)
    with pytest.raises(ValueError, match=r"mlx-lm trimmed 0 of the 1 tokens"):
        cache.truncate(0)


# ---------------------------------------------------------------- QuantizedKVCache


def test_quantized_cache_nbytes_fails_while_empty():
    """nbytes tree_reduces over (None, None) before the first update (cache.py:335-336)."""
    cache = MLXQuantizedKVCache(plan((), head_dim=64, dtype=torch.float32).spec)
    with pytest.raises(AttributeError, match=r"'NoneType' object has no attribute 'nbytes'"):
        cache.nbytes  # noqa: B018 - the property is the call under test


def test_quantized_rows_come_back_past_half_a_step():
    """mx.quantize's grid passes through 0 (the larger edge exact, the step rounded): rows
    come back up to ~1 step off, past the half step of an affine code of the same bits."""
    p = plan((), head_dim=64, dtype=torch.float32)
    cache = MLXQuantizedKVCache(p.spec)
    given = torch.randn(1, 1, 64, 64, generator=torch.Generator().manual_seed(0)) * 3 + 1
    keys, _ = cache.append(given, given)
    allowed = cache.kv_storage.allowed_error(given, torch.float32)
    assert ((keys.double() - given.double()).abs() > allowed).any()


@pytest.mark.skipif(MLX_LM_VERSION != TESTED_WITH, reason="the mutants are of mlx-lm 0.32.2")
def test_yardstick_mutants_apply_to_the_installed_mlx_lm(monkeypatch):
    """Every mlx-lm mutant of the yardstick (tools/yardstick_mlx_lm.py, docs/yardstick.md)
    finds its original line, once, where it says in the installed mlx-lm, and compiles."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "tools"))
    from mutation_yardstick import check_installed

    assert len(check_installed("mlx_lm").mutants) >= 20
