"""The half-precision budget of a cache's own attend (``kvcheck.asserts.ATTEND_BUDGETS``):
a correct attend that sums in float32, where the uncached pass sums in float64, is within
it where one of its sums rounds the other way."""

from __future__ import annotations

import torch

import kvimpl
from kvcheck import asserts as kvassert
from kvcheck.session import Engine
from kvcheck.tensors import build_model
from kvref import ModelConfig


def test_a_correct_attend_whose_sum_rounds_once_the_other_way_is_within_its_budget():
    # Found by the soak tier (2026-12-07) on three correct caches through the sharded plans:
    # torch's scaled_dot_product_attention in float16, summing in float32, equal to the
    # uncached run bit for bit at 23 of a prefill's 24 positions and 1.8 roundings of the
    # position's largest logit (4.9) beyond 2 x the uncached error at the last, which the
    # plain budget (kvcheck.asserts.BUDGETS) called wrong.
    config = ModelConfig(
        vocab_size=7, num_heads=16, num_kv_heads=8, head_dim=4, ffn_dim=32, seed=214
    )
    engine = Engine(
        kvimpl.CACHES["sdpa"], build_model(config, torch.float16), max_length=42, path="attend"
    )
    request = engine.start("r0", 1)
    generator = torch.Generator().manual_seed(493)
    for size in (1, 1, 3, 13):  # the session before the reset draws the tokens before
        torch.randint(0, config.vocab_size, (1, size), generator=generator)
    engine.feed(request, torch.randint(0, config.vocab_size, (1, 24), generator=generator))
    assert request.caches[0].attended is not None, "the model did not take the attend path"
    assert kvassert.budgets_for(request.caches) is kvassert.ATTEND_BUDGETS
    engine.check("the prefill")
    engine.finish()


def test_the_attend_budget_still_holds_an_attend_far_off():
    # The uncached run exact: 3 roundings of the largest value (2) off is within the attend
    # budget's 2 x 0 + 4 roundings, 8 roundings off is past it.
    reference = torch.full((1, 3, 5), 2.0, dtype=torch.float64)
    expected = reference.to(torch.float16)
    rounding = torch.finfo(torch.float16).eps / 2 * 2.0
    actual = expected.clone()
    actual[0, 1, 0] += 8 * rounding
    actual[0, 2, 0] += 3 * rounding
    bad, _, _ = kvassert.over_budget(
        actual, expected, reference, 1, budgets=kvassert.ATTEND_BUDGETS
    )
    assert bad.tolist() == [False, True, False]
