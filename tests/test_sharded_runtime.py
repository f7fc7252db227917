"""The sharded runtime itself (``kvcheck.rank_processes``): a hung rank fails the plan with a
message naming it and the event it reached, a rank that dies is named, a failure on one
rank comes back with its severity, and the group restarts for the next plan."""

import dataclasses
import os
import time

import pytest

from kvcheck import failures, rank_processes
from kvcheck.properties.sharded import REPLICATED, check_sharded_runtime, run_sharded
from kvimpl import ConcatCache
from tests.mutants.shards import SHARD_MUTANTS

pytestmark = pytest.mark.skipif(
    rank_processes.unavailable() is not None, reason=f"{rank_processes.unavailable()}"
)


class HangsOnRankOne(ConcatCache):
    """Rank 1's caches never return from their first append: its peers wait in the gather."""

    def append(self, key, value):
        if self.spec.shard is not None and self.spec.shard.rank == 1:
            time.sleep(3600)
        return super().append(key, value)


class DiesOnRankTwo(ConcatCache):
    """Rank 2's process exits at its first append, as one killed by the OOM killer."""

    def append(self, key, value):
        if self.spec.shard is not None and self.spec.shard.rank == 2:
            os._exit(3)
        return super().append(key, value)


def test_a_hung_rank_fails_the_plan_naming_it_and_its_event():
    with rank_processes.Runtime(run_sharded, HangsOnRankOne, deadline=1.5) as runtime:
        with pytest.raises(TimeoutError) as raised:
            runtime.run(REPLICATED)
        assert not runtime.ranks  # every rank killed
    message = str(raised.value)
    assert "did not answer within 1.5 s" in message
    assert "rank 1 at event #0: r0 is fed 5 tokens" in message


def test_a_rank_that_dies_is_named():
    with (
        rank_processes.Runtime(run_sharded, DiesOnRankTwo, deadline=10) as runtime,
        pytest.raises((RuntimeError, TimeoutError)) as raised,
    ):
        runtime.run(REPLICATED)
    assert "rank 2" in str(raised.value)


def test_a_failure_comes_back_with_its_severity_and_the_group_restarts_for_any_factory():
    with rank_processes.Runtime(run_sharded) as runtime:  # factories sent with the plans
        with pytest.raises(failures.DataLoss, match=r"on rank 3 .* length is 6, expected 0"):
            runtime.run(REPLICATED, SHARD_MUTANTS[-1])
        no_reset = dataclasses.replace(REPLICATED, events=REPLICATED.events[:-1])
        runtime.run(no_reset, SHARD_MUTANTS[-1])  # a fresh group, a plan the mutant survives
        runtime.run(REPLICATED, ConcatCache)  # the same group, another factory
        config = dataclasses.replace(REPLICATED.config, num_heads=4)
        runtime.run(dataclasses.replace(REPLICATED, world=2, config=config), ConcatCache)
        assert len(runtime.ranks) == 4  # a plan of two ranks on the first two of four


@pytest.mark.soak  # a group started for each (a failure ends the group); sharded catches them
@pytest.mark.parametrize("mutant", SHARD_MUTANTS, ids=lambda mutant: mutant.__name__)
def test_the_runtime_catches_each_shard_mutant(mutant):
    with pytest.raises(failures.PropertyFailure):
        check_sharded_runtime(mutant, REPLICATED)
