"""What the kit says when a cache takes bad input, or a refusal leaves it unusable.

Small deliberately broken caches meet the bad-input checks on fixed plans. The tests assert
on the severity (the class raised) and on the facts our own messages must give a person:
what was sent (shapes, dtypes, devices, values), and what the cache then did (lengths, row
numbers, dtypes). The kit never checks a cache's wording; these are the kit's own messages.
"""

import pytest
import torch
from torch import Tensor

from examples.doubling_cache import DoublingCache
from kvcheck import asserts as kvassert
from kvcheck import badinput as kvbad
from kvcheck import failures
from kvcheck import properties as kvprop
from kvcheck import strategies as kvst
from kvcheck.harness import warm
from kvref import CacheSpec, check_append

APPENDS = {case.name: case for case in kvbad.BAD_APPENDS}
TRUNCATES = {case.name: case for case in kvbad.BAD_TRUNCATES}
REORDERS = {case.name: case for case in kvbad.BAD_REORDERS}


def plan(chunks=(3,), dtype=torch.float64, batch=1, new_tokens=1) -> kvst.CachePlan:
    spec = CacheSpec(batch, 1, 2, max_length=8, dtype=dtype, device=torch.device("cpu"))
    return kvst.CachePlan(spec, chunks, new_tokens)


class BreaksAfterARefusal(DoublingCache):
    """Refuses bad input as the contract says, but every append after a refusal fails."""

    broken = False

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        if self.broken:
            raise RuntimeError("scratch buffer freed by the refused call")
        try:
            check_append(self.spec, self.length, key, value)
        except ValueError:
            self.broken = True
            raise
        return super().append(key, value)


def test_a_read_back_that_raises_after_a_refusal_is_a_refusal_that_changed_state():
    with pytest.raises(failures.RefusalChangedState) as caught:
        kvprop.check_bad_append(BreaksAfterARefusal, plan(), APPENDS["wrong dtype"])
    message = str(caught.value)
    assert message.startswith("the cache: after a refused call, reading")
    assert (
        "reading the cache back (an append of one valid row) raised RuntimeError: scratch "
        "buffer freed by the refused call"
    ) in message
    assert isinstance(caught.value.__cause__, RuntimeError)


def test_the_refusal_is_named_when_the_caller_gives_it():
    drawn = plan()
    cache = warm(BreaksAfterARefusal, drawn)
    cache.cache.broken = True
    with pytest.raises(failures.RefusalChangedState, match=r'after refusing "wrong dtype", read'):
        kvassert.assert_unchanged(
            cache, drawn.spec, who="the cache", where="here", case=APPENDS["wrong dtype"]
        )


def test_a_read_back_that_raises_after_a_no_op_says_the_call_was_taken():
    drawn = plan()
    cache = warm(BreaksAfterARefusal, drawn)
    cache.cache.broken = True
    with pytest.raises(failures.RefusalChangedState, match=r'after taking "zero new tokens" as a'):
        kvassert.assert_unchanged(
            cache,
            drawn.spec,
            who="the cache",
            where="here",
            case=APPENDS["zero new tokens"],
            refused=False,
        )
