"""The request plans the kit draws (kvcheck.properties.requests): well formed, and the tight
pool sized from them never too small for a correct pool."""

import pytest
import torch
from hypothesis import given, settings

from kvcheck.properties import requests as kvreq
from kvref import ModelConfig

ONE_LAYER = ModelConfig(vocab_size=7, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=2)


def test_blocks_needed_is_the_busiest_moment_without_sharing():
    plan = kvreq.RequestPlan(
        ONE_LAYER,
        torch.float64,
        (
            kvreq.Start(0, 2),
            kvreq.Feed(0, 17),  # 2 rows x 2 blocks
            kvreq.Fork(0, 1),  # counted again: 8
            kvreq.Finish(0, "drop"),  # 4
            kvreq.Start(2, 1),
            kvreq.Feed(2, 5),  # 5
            kvreq.Poison(1, "nan", 16),  # 2 rows x 3 blocks + 1: 7
            kvreq.Finish(1, "reset"),
            kvreq.Finish(2, "drop"),
        ),
        token_seed=0,
    )
    assert plan.blocks_needed(16) == 8
    assert plan.blocks_needed(4) == 2 * 5 + 2 * 5  # two requests of 2 rows x 5 blocks


@pytest.mark.long  # 30 plans, each run
@settings(max_examples=30)
@given(plan=kvreq.request_plans(forks=3, truncates=True))
def test_every_drawn_plan_finishes_every_request_it_starts(plan):
    live: dict[int, int] = {}
    for event in plan.events:
        if isinstance(event, kvreq.Start):
            assert event.request not in live, f"r{event.request} started twice: {plan.describe()}"
            live[event.request] = 0
        elif isinstance(event, kvreq.Fork):
            assert event.parent in live, (
                f"r{event.parent} forked while not alive: {plan.describe()}"
            )
            assert event.child not in live, f"r{event.child} is alive already: {plan.describe()}"
            live[event.child] = live[event.parent]
        elif isinstance(event, kvreq.Feed):
            live[event.request] += event.size
            assert live[event.request] <= kvreq.MAX_LENGTH, plan.describe()
        elif isinstance(event, kvreq.Finish):
            live.pop(event.request)
    assert not live, f"requests {sorted(live)} never finish: {plan.describe()}"
