"""Stateful sessions: one model and independent sets of caches, driven by prefill, decode,
reset, fresh caches and bad calls, interleaved in any order Hypothesis finds. After every step,
each set's lengths and the last logits are checked against the uncached model run over that
set's whole history, and what append returned against every row it was given."""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from tests import badinput as kvbad
from tests import checks as kvchk
from tests import scenarios as kvst

MAX_LENGTH = 64


class CacheSet:
    def __init__(self, name: str, caches: list[kvchk.WatchedCache], batch: int) -> None:
        self.name = name
        self.caches = caches
        self.history = torch.empty(batch, 0, dtype=torch.long)  # every token fed since reset


# Calls the model must refuse; ``make(tokens, caches, vocab_size)`` builds the bad arguments.
BAD_CALLS = [
    kvbad.BadInput("too few caches", lambda t, c, v: (t, c[1:]), ValueError, r"number"),
    kvbad.BadInput("same cache twice", lambda t, c, v: (t, c[:1] * 2), ValueError, r"same|number"),
    kvbad.BadInput(
        "token out of vocabulary", lambda t, c, v: (t + v, c), ValueError, r"vocabulary"
    ),
    kvbad.BadInput("batch mismatch", lambda t, c, v: (kvbad.grow(t, 0), c), ValueError, r"batch"),
    kvbad.BadInput("float token ids", lambda t, c, v: (t.double(), c), ValueError, r"dtype"),
]


class CachedDecoding(RuleBasedStateMachine):
    cache_sets = Bundle("cache_sets")  # independent sets of caches, one per layer each

    def __init__(self, factory) -> None:
        super().__init__()
        self.factory = factory
        self.every_set: list[CacheSet] = []
        self.tokens = torch.Generator().manual_seed(0)

    @initialize(
        target=cache_sets,
        config=kvst.model_configs(max_layers=3),
        batch=st.integers(1, 3),
        dtype=st.sampled_from(kvst.DTYPES),
    )
    def build_model(self, config, batch, dtype):
        self.model, self.batch = kvst.build_model(config, dtype), batch
        return self.new_set()

    @rule(target=cache_sets)
    def fresh_caches(self):
        """Another set of caches from the factory, to interleave with the others."""
        return self.new_set()

    def new_set(self) -> CacheSet:
        built = self.model.new_caches(self.factory, batch=self.batch, max_length=MAX_LENGTH)
        name = f"cache set {len(self.every_set)}"
        cache_set = CacheSet(name, [kvchk.WatchedCache(cache) for cache in built], self.batch)
        self.every_set.append(cache_set)
        return cache_set

    def feed(self, cache_set: CacheSet, size: int) -> None:
        size = min(size, MAX_LENGTH - cache_set.history.shape[1])
        if size == 0:
            return  # full: only a reset or a prefill makes room
        vocab = self.model.config.vocab_size
        new = torch.randint(0, vocab, (self.batch, size), generator=self.tokens)
        cache_set.history = torch.cat((cache_set.history, new), dim=1)
        start, end = cache_set.history.shape[1] - size, cache_set.history.shape[1]
        at = f"{cache_set.name}, {size} new tokens at absolute positions {start}..{end - 1}"
        logits = self.model(new, caches=cache_set.caches)
        kvchk.assert_close_at(
            logits,
            self.model(cache_set.history)[:, start:],
            what="cached and uncached logits",
            where=at,
            position_axis=1,
            first_position=start,
        )
        for layer, cache in enumerate(cache_set.caches):
            kvchk.assert_returned_what_is_held(cache, layer=layer, at=f"\n  at {at}")

    def empty(self, cache_set: CacheSet) -> None:
        for cache in cache_set.caches:
            cache.reset()
        cache_set.history = cache_set.history[:, :0]

    @rule(cache_set=cache_sets, size=st.integers(1, 2 * kvst.DEFAULT_CHUNK_SIZE + 1))
    def prefill(self, cache_set, size):
        """A new prompt on this set: reset it, then feed the prompt."""
        self.empty(cache_set)
        self.feed(cache_set, size)

    @rule(cache_set=cache_sets)
    def decode_one_token(self, cache_set):
        self.feed(cache_set, 1)

    @rule(cache_set=cache_sets, size=st.integers(2, kvst.DEFAULT_CHUNK_SIZE + 1))
    def decode_a_chunk(self, cache_set, size):
        self.feed(cache_set, size)

    @rule(cache_set=cache_sets)
    def reset(self, cache_set):
        self.empty(cache_set)

    @rule(cache_set=cache_sets, case=st.sampled_from(BAD_CALLS))
    def bad_call(self, cache_set, case):
        tokens = torch.zeros(self.batch, 1, dtype=torch.long)
        vocab = self.model.config.vocab_size
        tokens, caches = case.make(tokens, cache_set.caches, vocab)
        at = f"\n  at {cache_set.name}, holding {cache_set.history.shape[1]} tokens"
        kvbad.assert_rejected(lambda: self.model(tokens, caches=caches), case, at)

    @invariant()
    def every_layer_holds_the_history(self):
        for cache_set in self.every_set:
            lengths = [cache.length for cache in cache_set.caches]
            expected = cache_set.history.shape[1]
            assert lengths == [expected] * len(lengths), (
                f"{cache_set.name}: layer lengths {lengths}, but {expected} tokens were fed "
                "since its reset"
            )


def test_any_sequence_of_prefill_decode_reset_and_bad_calls(cache_factory):
    run_state_machine_as_test(
        lambda: CachedDecoding(cache_factory), settings=settings(stateful_step_count=20)
    )
