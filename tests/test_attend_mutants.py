"""The attend mutants are wrong only where they say: each one's ``attend`` differs from
``kvref.attention`` in the condition its docstring names and agrees with it outside that
condition, while its ``append`` returns the rows given, bit for bit, everywhere."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from kvimpl import ChunkedCache
from kvimpl.paged import PagedPool
from kvref import CacheSpec, attention
from tests.mutants import attend as kvattend

CPU = torch.device("cpu")
HALF = (torch.bfloat16, torch.float16)
# How far a correct attend may land from the reference: rounding only (in half precision,
# the one rounding of the result, both accumulating in float32).
AGREES = {torch.float64: 1e-9, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}
WRONG = 0.05  # a mutant's attend in its condition is off by more than this


def spec_of(batch=2, kv_heads=2, head_dim=8, dtype=torch.float64, window=None) -> CacheSpec:
    return CacheSpec(batch, kv_heads, head_dim, 64, dtype, CPU, window)


def rows(spec: CacheSpec, count: int, seed: int, heads: int | None = None) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    shape = (spec.batch, heads or spec.kv_heads, count, spec.head_dim)
    return torch.randn(shape, generator=generator, dtype=torch.float64).to(spec.dtype)


class Driven:
    """A cache, and every row given to it since its last reset, for the reference."""

    def __init__(self, cache, heads: int = 4) -> None:
        self.cache, self.spec, self.heads = cache, cache.spec, heads
        self.reset()
        self.seed = 0

    def reset(self) -> None:
        self.cache.reset()
        self.keys = self.values = rows(self.cache.spec, 0, 0)

    def _new(self, count: int) -> tuple[Tensor, Tensor]:
        self.seed += 3
        key, value = rows(self.spec, count, self.seed), rows(self.spec, count, self.seed + 1)
        self.keys = torch.cat((self.keys, key), dim=2)
        self.values = torch.cat((self.values, value), dim=2)
        return key, value

    def append(self, count: int) -> None:
        keys, values = self.cache.append(*self._new(count))
        assert torch.equal(keys, self.keys), "append returned other keys than those given"
        assert torch.equal(values, self.values), "append returned other values than those given"

    def attend(self, count: int) -> Tensor:
        """|attend - kvref.attention| for the ``count`` new tokens, (B, H, count, D)."""
        start = self.keys.shape[2]
        key, value = self._new(count)
        query = rows(self.spec, count, self.seed + 2, heads=self.heads)
        got = self.cache.attend(query, key, value)
        positions = torch.arange(start + count)
        want = attention(
            query, self.keys, self.values, positions[start:], positions, self.spec.window
        )
        return (got.double() - want.double()).abs()


def per_row(gap: Tensor) -> list[float]:
    return gap.amax(dim=(1, 2, 3)).tolist()


def per_position(gap: Tensor) -> list[float]:
    return gap.amax(dim=(0, 1, 3)).tolist()


def agrees(gap: Tensor, dtype: torch.dtype) -> bool:
    return gap.max().item() <= AGREES[dtype]


def test_the_built_ins_agree_under_every_condition_below():
    # The harness itself: the correct caches the mutants come from pass every check here.
    for factory in (ChunkedCache, PagedPool()):
        for dtype in (torch.float64, *HALF):
            cache = Driven(factory(spec_of(batch=3, dtype=dtype)))
            cache.append(5)
            gaps = [cache.attend(14), cache.attend(1)]
            cache.reset()
            gaps += [cache.attend(4), cache.attend(1)]
            assert all(agrees(gap, dtype) for gap in gaps), (factory, dtype)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_top_left_mask_is_wrong_on_a_warm_half_precision_cache(dtype):
    cache = Driven(kvattend.HalfPrecisionCausalTopLeft(spec_of(dtype=dtype)))
    assert agrees(cache.attend(5), dtype), "a prompt on an empty cache is right"
    cache.append(3)
    decode = cache.attend(1)  # sees key 0 only
    assert decode.max() > WRONG
    chunk = cache.attend(3)
    assert min(per_position(chunk)) > WRONG


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("window", [None, 3])
def test_top_left_mask_is_right_in_float64_and_float32(dtype, window):
    cache = Driven(kvattend.HalfPrecisionCausalTopLeft(spec_of(dtype=dtype, window=window)))
    cache.append(7)
    assert agrees(cache.attend(1), dtype)
    assert agrees(cache.attend(4), dtype)


def test_positions_survive_a_reset_of_a_cache_that_held_tokens():
    pool = kvattend.AttendPositionsSurviveReset()
    cache = Driven(pool(spec_of()))
    assert agrees(cache.attend(5), torch.float64), "the first session is right"
    assert agrees(cache.attend(1), torch.float64)
    cache.reset()
    prompt = per_position(cache.attend(4))
    # Each query but the last sees the prompt's later tokens.
    assert min(prompt[:-1]) > WRONG
    assert prompt[-1] <= AGREES[torch.float64]
    assert agrees(cache.attend(1), torch.float64), "a late query without a window sees it all"
    fresh = Driven(pool(spec_of()))
    fresh.reset()  # nothing written yet: nothing to count
    assert agrees(fresh.attend(4), torch.float64)


def test_positions_survive_a_reset_and_move_the_window():
    cache = Driven(kvattend.AttendPositionsSurviveReset()(spec_of(window=3)))
    cache.append(6)
    assert agrees(cache.attend(1), torch.float64)
    cache.reset()
    cache.append(5)
    assert cache.attend(1).max() > WRONG  # its window lies past every key: zeros


def test_only_the_first_cache_of_a_pool_scales_by_the_square_root():
    pool = kvattend.LaterCachesScaleByHeadDim()
    first, second = Driven(pool(spec_of())), Driven(pool(spec_of()))
    for cache in (first, second):
        cache.append(4)
    assert agrees(first.attend(3), torch.float64)
    assert second.attend(3).max() > WRONG
    fork = Driven(first.cache.fork())
    fork.keys, fork.values = first.keys, first.values
    assert fork.attend(1).max() > WRONG, "a fork is a cache the pool did not build first"
    assert agrees(Driven(pool.with_blocks(64)(spec_of())).attend(5), torch.float64)


def test_first_block_only_is_wrong_past_the_first_block():
    pool = kvattend.AttendReadsFirstBlockOnly()
    cache, size = Driven(pool(spec_of())), pool.block_size
    prompt = per_position(cache.attend(size + 4))
    assert max(prompt[:size]) <= AGREES[torch.float64], "positions in block 0 are right"
    assert min(prompt[size:]) > WRONG
    cache.reset()
    cache.append(size - 1)
    assert agrees(cache.attend(1), torch.float64), "a full first block is right"
    assert cache.attend(1).max() > WRONG


def test_batch_row_zero_for_every_row_is_wrong_on_other_rows():
    alone = Driven(kvattend.AttendReadsBatchRowZero(spec_of(batch=1)))
    alone.append(6)
    assert agrees(alone.attend(3), torch.float64), "batch 1 is right"
    cache = Driven(kvattend.AttendReadsBatchRowZero(spec_of(batch=3)))
    cache.append(6)
    first, *others = per_row(cache.attend(3))
    assert first <= AGREES[torch.float64]
    assert min(others) > WRONG


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mutant", kvattend.ATTEND_MUTANTS, ids=lambda m: m.__name__)
def test_append_returns_the_rows_given_where_attend_is_wrong(mutant, dtype):
    # Half precision, a reset, a second cache, past a block, batch 3: Driven.append checks
    # every row returned against those given, bit for bit.
    factory = mutant if isinstance(mutant, type) else type(mutant)()
    spec = spec_of(batch=3, dtype=dtype)
    factory(spec)
    for cache in (Driven(factory(spec)), Driven(factory(spec))):
        cache.append(9)
        cache.attend(2)
        cache.reset()
        for count in (1, 20, 1):
            cache.append(count)
