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
from kvcheck import strategies as kvst
from kvcheck import tensors as kvtensors
from kvcheck.harness import Recorder, warm
from kvcheck.properties import rejection as kvprop
from kvimpl.concat import ConcatCache
from kvref import CacheSpec, ModelConfig, check_append

APPENDS = {case.name: case for case in kvbad.BAD_APPENDS}
TRUNCATES = {case.name: case for case in kvbad.BAD_TRUNCATES}
REORDERS = {case.name: case for case in kvbad.BAD_REORDERS}


def plan(chunks=(3,), dtype=torch.float64, batch=1, new_tokens=1) -> kvst.CachePlan:
    spec = CacheSpec(batch, 1, 2, max_length=8, dtype=dtype, device=torch.device("cpu"))
    return kvst.CachePlan(spec, chunks, new_tokens)


class Unchecked(ConcatCache):
    """The built-in concat cache without its checks: ``torch.cat`` promotes a dtype,
    ``truncate`` slices (so -1 drops the last row), ``reorder`` indexes (int32 and -1 work)."""

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        self.key, self.value = torch.cat((self.key, key), 2), torch.cat((self.value, value), 2)
        return self.key, self.value

    def truncate(self, length: int) -> None:
        self.key, self.value = self.key[:, :, :length], self.value[:, :, :length]

    def reorder(self, indices: Tensor) -> None:
        self.key, self.value = self.key[indices], self.value[indices]


class TakesTheLatestDtype(Unchecked):
    """Turns everything it holds into the dtype of the latest append: a float32 append to a
    float64 cache rounds every row held before."""

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        self.key, self.value = self.key.to(key.dtype), self.value.to(value.dtype)
        return super().append(key, value)


class WritesOneRowMore(Unchecked):
    """Takes an append of another dtype by casting it, padded with a row of zeros."""

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        if key.dtype != self.spec.dtype:
            pad = torch.zeros_like(key[:, :, :1])
            key, value = (torch.cat((t, pad), dim=2).to(self.spec.dtype) for t in (key, value))
        return super().append(key, value)


class TrimsTheValue(Unchecked):
    """Takes a value with more tokens than its key, cut to the key's length."""

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        return super().append(key, value[:, :, : key.shape[2]])


class TrimsTheValueWidth(Unchecked):
    """Takes a value wider than its spec's, cut to the width it was built for."""

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        return super().append(key, value[..., : self.spec.value_width])


class GrowsOnNothing(Unchecked):
    """Takes an append of no tokens by adding a row of zeros."""

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        if key.shape[2] == 0:
            key = value = torch.zeros_like(self.key[:, :, :1])
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


def made(case, drawn: kvst.CachePlan) -> tuple[str, tuple]:
    """The method ``case`` is sent to, and its bad arguments made as its property makes them."""
    if case in kvbad.BAD_TRUNCATES:
        return "truncate", case.make(drawn.warm_length)
    if case in kvbad.BAD_REORDERS:
        return "reorder", case.make(drawn.spec)
    good = kvtensors.random_rows(drawn.spec, drawn.new_tokens, seed=7)
    return "append", case.make(good, good.clone())


def accepted(factory, drawn: kvst.CachePlan, case) -> failures.AcceptsBadInput:
    """The AcceptsBadInput raised when ``case`` is taken by a cache from ``factory`` warmed by
    ``drawn``, given what was sent and the cache, as the properties' call sites give them."""
    cache = warm(factory, drawn)
    method, bad = made(case, drawn)
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


def taken(name: str, factory, drawn: kvst.CachePlan, case, *facts: str, absent=()):
    """A row of ACCEPTED: the facts the message must give, and words it must not have."""
    return pytest.param(factory, drawn, case, facts, absent, id=name)


HELD_CHANGED = "held rows changed"
ACCEPTED = [
    taken(
        "a wrong dtype promoted",
        Unchecked,
        plan(dtype=torch.float32),
        APPENDS["wrong dtype"],
        "wrong dtype: accepted without an error\n  at a cache warmed",
        "key=a tensor shaped (1, 1, 1, 2), float64 on cpu",
        "value=a tensor shaped (1, 1, 1, 2), float64 on cpu",
        "built for (B, H_kv, D) = (1, 1, 2), float32 on cpu",
        "length changed from 3 to 4",
        "keys: returned as float64, were float32",
        "keys: row 3 as sent",
        absent=[HELD_CHANGED],  # float32 rows promote to float64 exactly
    ),
    taken(
        "held rows rounded to a wrong dtype",
        TakesTheLatestDtype,
        plan(chunks=(2, 1)),
        APPENDS["wrong dtype"],
        "length changed from 3 to 4",
        "keys: held rows changed: 3 of 3, rows [0, 1, 2], max |diff|",
        "values: held rows changed: 3 of 3, rows [0, 1, 2], max |diff|",
        "held rows must come back bit for bit",
        # The float64 row that reads it back made it float64 again: the rows it took were
        # rounded to float32 on the way.
        "keys: row 3 as sent, float32 stored as float64",
    ),
    taken(
        "more rows than were sent",
        WritesOneRowMore,
        plan(),
        APPENDS["wrong dtype"],
        "length changed from 3 to 5",
        "keys: rows 3..4 claimed: 2 rows, 1 sent, so 1 never written",
    ),
    taken(
        "fewer rows than were sent",
        TrimsTheValue,
        plan(),
        APPENDS["value with one token more than key"],
        "value=a tensor shaped (1, 1, 2, 2), float64 on cpu",
        "keys: row 3 as sent\n",
        "values: row 3 as sent: the first 1 of the 2 rows sent, the rest not held",
    ),
    taken(
        "a value of another width cut to the spec's",
        TrimsTheValueWidth,
        plan(),
        APPENDS["value of another width than its spec's"],
        "value of another width than its spec's: accepted without an error",
        "value=a tensor shaped (1, 1, 1, 3), float64 on cpu",
        "length changed from 3 to 4",
        absent=[HELD_CHANGED],
    ),
    taken(
        "truncate(-1) dropping a row",
        Unchecked,
        plan(chunks=(2, 2)),
        TRUNCATES["negative length"],
        "negative length: accepted without an error",
        "truncate(length=an int -1): asked for length -1, the cache holding 4 tokens",
        "length changed from 4 to 3 (position 3 gone)",
        absent=[HELD_CHANGED],  # the rows kept are as held
    ),
    taken(
        "truncate(-1) taken as a length",
        CountsWhatItIsTold,
        plan(),
        TRUNCATES["negative length"],
        "length changed from 3 to -1\n",
        "keys: returned no rows, not even the one appended",
    ),
    taken(
        "truncate past the length claiming a row",
        CountsWhatItIsTold,
        plan(),
        TRUNCATES["past the length held"],
        "asked for length 4, the cache holding 3 tokens",
        "length changed from 3 to 4",
        "keys: row 3 claimed, never written",
        "values: row 3 claimed, never written",
    ),
    taken(
        "a float length breaking the read-back",
        CountsWhatItIsTold,
        plan(),
        TRUNCATES["not an int"],
        "truncate(length=a float 2.0): asked for length 2.0, the cache holding 3 tokens",
        "length changed from 3 to 2.0",
        "reading it back (an append of one valid row) raised TypeError",
    ),
    taken(
        "truncate past the length as a no-op",
        Unchecked,  # slicing past the end
        plan(),
        TRUNCATES["past the length held"],
        "length is still 3",
        "the call was taken as a no-op",
    ),
    *(
        taken(
            name,
            Unchecked,
            plan(batch=2),
            REORDERS[name],
            f"indices=a tensor shaped (2,), {dtype} on cpu, values {values}",
            "valid indices are int64, shaped (2,), on cpu, with values in [0, 2)",
            "length is still 3",
            "keys: held rows changed: 3 of 3, rows [0, 1, 2], max |diff|",
        )
        for name, dtype, values in [
            ("int32 indices", "int32", "[0, 0]"),
            ("negative index", "int64", "[-1, -1]"),
        ]
    ),
]


@pytest.mark.parametrize(("factory", "drawn", "case", "facts", "absent"), ACCEPTED)
def test_an_accepted_bad_input_says_what_was_sent_and_what_the_cache_then_did(
    factory, drawn, case, facts, absent
):
    message = str(accepted(factory, drawn, case))
    assert [fact for fact in facts if fact not in message] == [], message
    assert [words for words in absent if words in message] == [], message


def test_a_read_back_that_fails_after_an_acceptance_is_its_cause():
    error = accepted(CountsWhatItIsTold, plan(), TRUNCATES["not an int"])
    assert isinstance(error.__cause__, TypeError)


def test_a_bad_append_taken_through_the_property_still_accepts_bad_input():
    with pytest.raises(failures.AcceptsBadInput, match=r"^wrong dtype: accepted without an error"):
        kvprop.check_bad_append(TakesTheLatestDtype, plan(), APPENDS["wrong dtype"])


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
    assert message.startswith('the cache: after refusing "wrong dtype", reading')
    assert (
        "reading the cache back (an append of one valid row) raised RuntimeError: scratch "
        "buffer freed by the refused call"
    ) in message
    assert isinstance(caught.value.__cause__, RuntimeError)


@pytest.mark.parametrize(
    ("factory", "case", "words"),
    [
        (
            BreaksAfterARefusal,
            "wrong dtype",
            r'after refusing "wrong dtype", reading the cache back \(an append of one valid '
            r"row\) raised RuntimeError",
        ),
        (
            GrowsOnNothing,
            "zero new tokens",
            r'length is 4 after taking "zero new tokens" as a no-op',
        ),
    ],
)
def test_what_the_call_left_is_told_in_the_words_of_the_call(factory, case, words):
    drawn = plan()
    cache = warm(factory, drawn)
    method, bad = made(APPENDS[case], drawn)
    refused = kvassert.raised_by(lambda: getattr(cache.cache, method)(*bad))
    with pytest.raises(failures.RefusalChangedState, match=words):
        kvassert.assert_unchanged(
            cache,
            drawn.spec,
            who="the cache",
            where="here",
            case=APPENDS[case],
            refused=refused is not None,
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


class TakesAnyBatch:
    """A cache without a ``spec`` that joins whatever rows it is given (``torch.cat`` over
    the length axis only fails on a batch mismatch when the batch is the joined axis: here
    it stacks a longer batch at the front instead)."""

    def __init__(self, spec: CacheSpec) -> None:
        self.key = self.value = None

    @property
    def length(self) -> int:
        return 0 if self.key is None else self.key.shape[2]

    @property
    def nbytes(self) -> int:
        return 0 if self.key is None else 2 * self.key.numel() * self.key.element_size()

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        if self.key is not None and key.shape[0] != self.key.shape[0]:
            pad = key.shape[0] - self.key.shape[0]
            self.key = torch.cat((self.key, self.key[:pad]), 0)
            self.value = torch.cat((self.value, self.value[:pad]), 0)
        self.key = key.clone() if self.key is None else torch.cat((self.key, key), 2)
        self.value = value.clone() if self.value is None else torch.cat((self.value, value), 2)
        return self.key, self.value

    def reset(self) -> None:
        self.key = self.value = None


def test_a_cache_that_takes_another_batch_in_a_model_call_accepts_bad_input():
    # The model cannot refuse it (no spec to compare with); the cache takes it, and that is
    # "accepts bad input", not a refusal that changed the cache.
    config = ModelConfig(vocab_size=11, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=2)
    model_plan = kvst.ModelPlan(config, torch.float64, 2, (3,), 0, token_seed=1)
    case = {case.name: case for case in kvbad.BAD_CALLS}["caches built for another batch size"]
    with pytest.raises(failures.AcceptsBadInput, match="took rows shaped"):
        kvprop.check_bad_model_call(TakesAnyBatch, model_plan, case)
