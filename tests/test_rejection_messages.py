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
from kvcheck.harness import Recorder, warm
from kvref import CacheSpec, ModelConfig, check_append

APPENDS = {case.name: case for case in kvbad.BAD_APPENDS}
TRUNCATES = {case.name: case for case in kvbad.BAD_TRUNCATES}
REORDERS = {case.name: case for case in kvbad.BAD_REORDERS}


def plan(chunks=(3,), dtype=torch.float64, batch=1, new_tokens=1) -> kvst.CachePlan:
    spec = CacheSpec(batch, 1, 2, max_length=8, dtype=dtype, device=torch.device("cpu"))
    return kvst.CachePlan(spec, chunks, new_tokens)


class Unchecked:
    """Checks nothing: appends join with ``torch.cat`` (which promotes a dtype), ``truncate``
    slices (so -1 drops the last row), ``reorder`` indexes (int32 and -1 work)."""

    def __init__(self, spec: CacheSpec) -> None:
        self.spec = spec
        self.reset()

    @property
    def length(self) -> int:
        return self.keys.shape[2]

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def reset(self) -> None:
        s = self.spec
        self.keys = torch.empty(s.batch, s.kv_heads, 0, s.head_dim, dtype=s.dtype)
        self.values = self.keys.clone()

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        self.keys = torch.cat((self.keys, key), dim=2)
        self.values = torch.cat((self.values, value), dim=2)
        return self.keys, self.values

    def truncate(self, length: int) -> None:
        self.keys, self.values = self.keys[:, :, :length], self.values[:, :, :length]

    def reorder(self, indices: Tensor) -> None:
        self.keys, self.values = self.keys[indices], self.values[indices]


class TakesTheLatestDtype(Unchecked):
    """Turns everything it holds into the dtype of the latest append: a float32 append to a
    float64 cache rounds every row held before."""

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        self.keys, self.values = self.keys.to(key.dtype), self.values.to(value.dtype)
        return super().append(key, value)


class WritesOneRowMore(Unchecked):
    """Takes an append of another dtype by casting it, padded with a row of zeros."""

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        if key.dtype != self.spec.dtype:
            pad = torch.zeros_like(key[:, :, :1])
            key, value = (torch.cat((t, pad), dim=2).to(self.spec.dtype) for t in (key, value))
        return super().append(key, value)


class GrowsOnNothing(Unchecked):
    """Takes an append of no tokens by adding a row of zeros."""

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        if key.shape[2] == 0:
            key = value = torch.zeros_like(self.keys[:, :, :1])
        return super().append(key, value)


class CountsWhatItIsTold(DoublingCache):
    """A preallocated cache whose ``truncate`` sets its count unchecked: past the length held
    it claims rows never written; below 0 its next append fails."""

    def truncate(self, length: int) -> None:
        self._length = length


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


def accepted(
    factory, drawn: kvst.CachePlan, case, method: str, bad: tuple
) -> failures.AcceptsBadInput:
    """The AcceptsBadInput raised for ``method(*bad)`` on a warm cache, given what was sent
    and the cache, as a property gives them."""
    cache = warm(factory, drawn)
    error = kvassert.raised_by(lambda: getattr(cache.cache, method)(*bad))
    with pytest.raises(failures.AcceptsBadInput) as caught:
        kvassert.assert_refused(
            error,
            case,
            where=drawn.describe(),
            sent=bad,
            method=method,
            cache=cache,
            spec=drawn.spec,
        )
    return caught.value


def bad_append(drawn: kvst.CachePlan, case) -> tuple:
    good = kvst.random_rows(drawn.spec, drawn.new_tokens, seed=7)
    return case.make(good, good.clone())


def test_an_accepted_wrong_dtype_says_what_was_sent_and_what_the_cache_returns_since():
    drawn = plan(dtype=torch.float32)
    case = APPENDS["wrong dtype"]
    message = str(accepted(Unchecked, drawn, case, "append", bad_append(drawn, case)))
    assert message.startswith("wrong dtype: accepted without an error\n  at a cache warmed")
    assert "key=a tensor shaped (1, 1, 1, 2), float64 on cpu" in message
    assert "value=a tensor shaped (1, 1, 1, 2), float64 on cpu" in message
    assert "built for (B, H_kv, D) = (1, 1, 2), float32 on cpu" in message
    assert "length changed from 3 to 4" in message
    assert "keys: returned as float64, were float32" in message
    assert "keys: row 3 as sent" in message
    assert "held rows changed" not in message  # float32 rows promote to float64 exactly


def test_an_acceptance_that_corrupts_the_held_rows_says_which_and_by_how_much():
    drawn = plan(chunks=(2, 1))
    case = APPENDS["wrong dtype"]
    message = str(accepted(TakesTheLatestDtype, drawn, case, "append", bad_append(drawn, case)))
    assert "length changed from 3 to 4" in message
    assert "keys: held rows changed: 3 of 3, rows [0, 1, 2], max |diff|" in message
    assert "values: held rows changed: 3 of 3, rows [0, 1, 2], max |diff|" in message
    assert "held rows must come back bit for bit" in message
    # The float64 row that reads it back turned it into float64 again: the rows it took
    # were rounded to float32 on the way.
    assert "keys: row 3 as sent, float32 stored as float64" in message


def test_an_append_that_grows_by_more_than_was_sent_says_how_many_were_never_written():
    drawn = plan()
    case = APPENDS["wrong dtype"]
    message = str(accepted(WritesOneRowMore, drawn, case, "append", bad_append(drawn, case)))
    assert "length changed from 3 to 5" in message
    assert "keys: rows 3..4 claimed: 2 rows, 1 sent, so 1 never written" in message


def test_a_no_op_that_grows_is_a_refusal_that_changed_state_in_its_own_words():
    drawn = plan()
    cache = warm(GrowsOnNothing, drawn)
    cache.cache.append(*bad_append(drawn, APPENDS["zero new tokens"]))  # taken, no error
    with pytest.raises(
        failures.RefusalChangedState,
        match=r'length is 4 after taking "zero new tokens" as a no-op, was 3',
    ):
        kvassert.assert_unchanged(
            cache,
            drawn.spec,
            who="the cache",
            where="here",
            case=APPENDS["zero new tokens"],
            refused=False,
        )


def test_a_bad_append_taken_through_the_property_still_accepts_bad_input():
    with pytest.raises(failures.AcceptsBadInput, match=r"^wrong dtype: accepted without an error"):
        kvprop.check_bad_append(TakesTheLatestDtype, plan(), APPENDS["wrong dtype"])


def test_an_accepted_negative_truncate_says_the_length_asked_and_the_rows_gone():
    drawn = plan(chunks=(2, 2))
    message = str(accepted(Unchecked, drawn, TRUNCATES["negative length"], "truncate", (-1,)))
    assert message.startswith("negative length: accepted without an error")
    assert "truncate(length=an int -1): asked for length -1, the cache holding 4 tokens" in message
    assert "length changed from 4 to 3 (position 3 gone)" in message
    assert "held rows changed" not in message  # the rows kept are as held


def test_an_accepted_truncate_past_the_length_held_says_which_rows_were_never_written():
    drawn = plan()
    case = TRUNCATES["past the length held"]
    message = str(accepted(CountsWhatItIsTold, drawn, case, "truncate", (4,)))
    assert "asked for length 4, the cache holding 3 tokens" in message
    assert "length changed from 3 to 4" in message
    assert "keys: row 3 claimed, never written" in message
    assert "values: row 3 claimed, never written" in message


def test_a_read_back_that_fails_after_an_acceptance_is_described_and_chained():
    drawn = plan()
    error = accepted(CountsWhatItIsTold, drawn, TRUNCATES["not an int"], "truncate", (2.5,))
    message = str(error)
    assert "truncate(length=a float 2.5): asked for length 2.5, the cache holding 3" in message
    assert "length changed from 3 to 2.5" in message
    assert "reading it back (an append of one valid row) raised TypeError" in message
    assert isinstance(error.__cause__, TypeError)


def test_an_accepted_negative_length_is_shown_as_it_is_claimed():
    drawn = plan()
    message = str(
        accepted(CountsWhatItIsTold, drawn, TRUNCATES["negative length"], "truncate", (-1,))
    )
    assert "length changed from 3 to -1\n" in message
    assert "keys: returned no rows, not even the one appended to read it back" in message


def test_a_truncate_taken_as_a_no_op_says_nothing_changed():
    drawn = plan()
    case = TRUNCATES["past the length held"]
    message = str(accepted(Unchecked, drawn, case, "truncate", (4,)))  # slicing past the end
    assert "length is still 3" in message
    assert "the call was taken as a no-op" in message


@pytest.mark.parametrize("name", ["int32 indices", "negative index"])
def test_an_accepted_bad_reorder_shows_the_indices_and_the_rows_it_moved(name):
    drawn = plan(chunks=(3,), batch=2)
    case = REORDERS[name]
    indices = case.make(drawn.spec)
    message = str(accepted(Unchecked, drawn, case, "reorder", indices))
    dtype = "int32" if name == "int32 indices" else "int64"
    values = "[0, 0]" if name == "int32 indices" else "[-1, -1]"
    assert f"indices=a tensor shaped (2,), {dtype} on cpu, values {values}" in message
    assert "valid indices are int64, shaped (2,), on cpu, with values in [0, 2)" in message
    assert "length is still 3" in message
    assert "keys: held rows changed: 3 of 3, rows [0, 1, 2], max |diff|" in message


def test_a_model_call_is_described_by_its_token_ids_and_caches():
    spec = plan(batch=2).spec
    layer = Recorder(DoublingCache(spec))
    tokens = torch.zeros(2, 1, dtype=torch.long)
    text = kvassert.describe_call("model", (tokens, [layer, layer, Recorder(DoublingCache(spec))]))
    assert text == (
        "model(token ids=a tensor shaped (2, 1), int64 on cpu, "
        "caches=a list of 3 Recorder (2 distinct))"
    )


def test_a_non_tensor_is_described_by_its_type_and_value():
    assert kvassert.describe_argument([0, 1]) == "a list [0, 1]"
    assert kvassert.describe_argument(2.5) == "a float 2.5"


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


def test_a_zero_token_no_op_may_still_be_accepted():
    assert kvassert.assert_refused(None, APPENDS["zero new tokens"], where="here") is False


def test_a_model_state_shows_each_layer_once_a_case_made_them_differ():
    config = ModelConfig(vocab_size=11, num_layers=3, num_heads=2, num_kv_heads=1, head_dim=4)
    model_plan = kvst.ModelPlan(config, torch.float64, 1, (3, 1), layer=1, token_seed=0)
    state = kvbad.build_model_state(DoublingCache, model_plan)
    assert state.describe().startswith("3 layers holding 4 tokens each (caches built for")
    kvbad.lengthen(state)
    assert state.describe().startswith("3 layers holding [4, 5, 4] tokens (layer by layer)")
    assert state.describe().endswith("the layer a case may lengthen or empty: 1")
