"""Context shift (docs/contract.md, section 8.4): the float64 re-rotation the oracle uses,
the checks of a span, when a window may refuse, and the built-in ``preallocated``'s shift
against the oracle. The kit's property, ``context shift``, is in kvcheck/properties/shift.py."""

import dataclasses

import pytest
import torch

from kvcheck import failures
from kvcheck.harness import Recorder
from kvcheck.plan_events import Feed, Shift
from kvcheck.properties import shift as shift_property
from kvcheck.properties.shift import ShiftPlan, check_context_shift
from kvimpl import PreallocatedCache, UnrotatedCache
from kvref import (
    CacheContractError,
    ModelConfig,
    ReferenceTransformer,
    capabilities,
    check_shift,
    may_refuse_shift,
    rerotate,
)
from kvref.rope import apply_rope
from kvref.shift_oracle import HeldRows, shifted_rows
from tests import measure_shift


def test_rerotating_a_key_moves_it_to_another_position():
    keys = torch.randn(2, 3, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    at = torch.arange(100, 105)
    rotated = apply_rope(keys, at, 10_000.0)
    torch.testing.assert_close(
        rerotate(rotated, -37, 10_000.0), apply_rope(keys, at - 37, 10_000.0)
    )
    assert rerotate(rotated[:, :, :0], -3, 10_000.0).shape == (2, 3, 0, 8)
    half = rotated.to(torch.bfloat16)
    assert rerotate(half, 5, 10_000.0).dtype == torch.bfloat16  # rounded once into its dtype


@pytest.mark.parametrize(
    ("start", "count"), [(0, 0), (-1, 1), (3, 8), (True, 1), (0, 1.0), (10, 1)]
)
def test_a_bad_span_is_refused(start, count):
    with pytest.raises(ValueError, match="shift"):
        check_shift(10, start, count)


def test_a_window_may_refuse_only_where_the_next_query_needs_a_row_it_dropped():
    # 20 held, window 8: a cache must keep 13..19. shift(15, 3) leaves 17, whose next query
    # needs new 10..16, old 10..14 and 18, 19: 10 may be gone.
    assert may_refuse_shift([8], 20, 15, 3)
    # shift(0, 5): the next query needs new 8..14, old 13..19: all kept.
    assert not may_refuse_shift([8], 20, 0, 5)
    assert not may_refuse_shift([None, 1], 20, 15, 3)  # global layers and a window of one


def shifted_session(dtype: torch.dtype, first: int):
    """Logits of preallocated and of the oracle after two shifts, from position ``first``."""
    config = ModelConfig(num_layers=2, window=6, window_layers="alternate")
    model = ReferenceTransformer(config, dtype=dtype)
    tokens = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(1))
    caches = model.new_caches(PreallocatedCache, batch=2, max_length=24)
    for cache in caches:
        cache.reset_at(first)
    model(tokens[:, :20], caches=caches)
    _, rows = model.forward_with_kv(tokens[:, :20], start_position=first)
    base = config.rope_base
    got, want = [], []
    for span, new in (((4, 10), tokens[:, 20:26]), ((0, 15), tokens[:, 26:40])):
        model.shift(caches, *span)
        rows = [shifted_rows(keys, values, *span, base) for keys, values in rows]
        held = [HeldRows(keys, values, first) for keys, values in rows]
        got.append(model(new, caches=caches))
        want.append(model(new, caches=held))
        rows = [(cache.keys, cache.values) for cache in held]
    return caches, torch.cat(got, 1), torch.cat(want, 1)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_preallocated_shifts_exactly_as_the_oracle_and_runs_past_max_length(dtype):
    caches, got, want = shifted_session(dtype, first=255)
    assert torch.equal(got, want)  # it re-rotates as the oracle does: bit for bit
    assert caches[0].length == 20 - 10 + 6 - 15 + 14  # 40 tokens fed to a cache of 24


def test_a_shift_the_model_refuses_changes_nothing():
    model = ReferenceTransformer(ModelConfig(num_layers=2))
    caches = model.new_caches(PreallocatedCache, batch=1, max_length=8)
    model(torch.zeros(1, 5, dtype=torch.long), caches=caches)
    with pytest.raises(ValueError, match="shift"):
        model.shift(caches, 3, 3)
    assert [cache.length for cache in caches] == [5, 5]

    class Sideways(PreallocatedCache):
        keys_stored = "sideways"  # neither of the two ways the model knows

    with pytest.raises(CacheContractError, match="keys_stored"):
        model(
            torch.zeros(1, 1, dtype=torch.long),
            caches=model.new_caches(Sideways, batch=1, max_length=8),
        )


class RefusingWindow(PreallocatedCache):
    """Correct: refuses a shift exactly where ``kvref.may_refuse_shift`` allows it."""

    def shift(self, start: int, count: int) -> None:
        window = self.spec.window
        if window is not None and may_refuse_shift([window], self.length, start, count):
            raise ValueError("shift: a row the next query needs is gone")
        super().shift(start, count)


class FirstPositionMovedByShift(UnrotatedCache):
    """Broken: a shift moves its first position up by the span (the model rotates its keys
    and queries from that origin alike, so only the claim shows it)."""

    def shift(self, start: int, count: int) -> None:
        super().shift(start, count)
        self._firsts = [first + count for first in self._firsts]


WINDOWED = ModelConfig(vocab_size=23, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8)


def test_a_refused_shift_ends_the_plan_that_was_drawn_for_it():
    plan = ShiftPlan(
        config=dataclasses.replace(WINDOWED, window=8),
        dtype=torch.float64,
        batch=1,
        max_length=16,
        events=(Feed(0, 16), Shift(0, 4, 6), Feed(0, 1)),  # the feed would overflow
        token_seed=1,
    )
    check_context_shift(RefusingWindow, plan)


def test_a_first_position_a_shift_moves_is_caught_where_the_logits_cannot_show_it():
    plan = dataclasses.replace(shift_property.PINNED[0], dtype=torch.float64)
    with pytest.raises(failures.DataLoss, match="first_position"):
        check_context_shift(FirstPositionMovedByShift, plan)


def test_layers_that_keep_keys_differently_are_refused():
    model = ReferenceTransformer(ModelConfig(num_layers=2))
    spec = model.cache_spec(1, 8)
    with pytest.raises(CacheContractError, match="keys_stored by layer"):
        model(
            torch.zeros(1, 1, dtype=torch.long),
            caches=[PreallocatedCache(spec), UnrotatedCache(spec)],
        )


def test_the_rounding_budget_reaches_only_the_keys_a_shift_moved():
    spec = ReferenceTransformer(ModelConfig(num_layers=1)).cache_spec(1, 32)
    recorder = Recorder(PreallocatedCache(spec))
    rows = torch.randn(1, spec.kv_heads, 15, spec.head_dim, dtype=spec.dtype)
    recorder.append(rows, rows)
    recorder.shift(5, 2)  # 13 left: indices 5..12 moved once
    assert recorder.rerotated == {i: (2,) for i in range(5, 13)}
    recorder.truncate(10)  # then appended again: exact from 10 on
    recorder.append(rows[:, :, :3], rows[:, :, :3])
    recorder.shift(11, 1)  # moves 12 down to 11; 10 stays exact, 5..9 stay moved once
    assert recorder.rerotated == {**{i: (2,) for i in range(5, 10)}, 11: (1,)}


def test_the_budget_tells_a_half_precision_angle_from_a_float32_one_on_far_shifts_only():
    # The figures of contract 8.4 (tests/measure_shift.py): bfloat16 keys 64 wide.
    near = measure_shift.measure(torch.bfloat16, 64, 10_000.0, 16, seeds=1, keys=64)
    far = measure_shift.measure(torch.bfloat16, 64, 500_000.0, 128, seeds=1, keys=64)
    assert max(near["float32 angles"], near["angles in the storage dtype"]) < 1
    assert far["float32 angles"] < 1 < far["angles in the storage dtype"]


# --- Shifts per row (section 8.4): shift(starts, counts) with a tuple each ---------------
def rows_of(model: ReferenceTransformer, factory, lengths: list[int]) -> list:
    """Every layer's cache from ``factory``, its rows fed ``lengths`` tokens each."""
    caches = model.new_caches(factory, batch=len(lengths), max_length=16)
    tokens = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    model.forward_rows(tokens, lengths, caches)
    return caches


@pytest.mark.parametrize(
    ("starts", "counts", "says"),
    [
        ((0,), (1,), "one entry per row"),
        ((0, 4), (1, 0), "row 1 holds 3"),  # within the longest row, past row 1's own
        ((0, 0), (1, -1), "row 1"),
        ((0, 0), (0, 4), "row 1 holds 3"),
        (0, (1, 0), "an int beside a tuple"),
        ((0, 0), (0, 0), "every count is 0"),
        ((0, 0), (1.0, 0), "must be an int"),
    ],
)
def test_a_shift_per_row_the_model_refuses_changes_no_row(starts, counts, says):
    model = ReferenceTransformer(ModelConfig(num_layers=2))
    caches = rows_of(model, PreallocatedCache, [6, 3])
    with pytest.raises(ValueError, match=says):
        model.shift(caches, starts, counts)
    assert [cache.row_lengths for cache in caches] == [(6, 3), (6, 3)]


def test_each_row_shifts_by_its_own_count_and_the_others_stay():
    model = ReferenceTransformer(ModelConfig(num_layers=1), dtype=torch.float64)
    cache = rows_of(model, PreallocatedCache, [6, 3])[0]
    keys, values = cache.key.clone(), cache.value.clone()  # its buffers: row b's first rows
    model.shift([cache], (1, 0), (2, 0))
    assert cache.row_lengths == (4, 3)
    want = shifted_rows(keys[:1, :, :6], values[:1, :, :6], 1, 2, model.config.rope_base)
    torch.testing.assert_close(cache.key[:1, :, :4], want[0])
    assert torch.equal(cache.value[:1, :, :4], want[1])
    assert torch.equal(cache.key[1:, :, :3], keys[1:, :, :3])  # the untouched row, bit for bit


def test_a_shift_per_row_needs_the_declaration():
    class IntsOnly(PreallocatedCache):
        shift_per_row = False

    model = ReferenceTransformer(ModelConfig(num_layers=1))
    caches = rows_of(model, IntsOnly, [6, 3])
    with pytest.raises(CacheContractError, match="shift_per_row"):
        model.shift(caches, (1, 0), (2, 0))
    assert caches[0].row_lengths == (6, 3)
    assert "shift per row" not in capabilities(caches[0])
    assert "shift per row" in capabilities(PreallocatedCache(caches[0].spec))
