"""Stateful sessions: one model and up to two independent sets of caches, driven by prefill,
decode, reset, fresh caches and bad calls in any order Hypothesis finds. After every step,
each set's lengths and the last logits are checked against the uncached model run over that
set's whole history, and what append returned against every row it was given."""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from tests import checks as kvchk
from tests import scenarios as kvst

MAX_LENGTH = 64
SET_NAMES = st.sampled_from(["A", "B"])  # B exists once a rule has made it


class CacheSet:
    def __init__(self, caches: list[kvchk.WatchedCache], batch: int) -> None:
        self.caches = caches
        self.history = torch.empty(batch, 0, dtype=torch.long)  # every token fed since reset


def bad_calls(state: CachedDecoding, caches: list) -> dict:
    """Calls the model must refuse, each with what a clear message has to mention."""
    tokens = torch.zeros(state.batch, 1, dtype=torch.long)
    return {
        "too few caches": (lambda: state.model(tokens, caches=caches[1:]), "number"),
        "same cache twice": (lambda: state.model(tokens, caches=caches[:1] * 2), "same|number"),
        "token out of vocabulary": (
            lambda: state.model(tokens + state.model.config.vocab_size, caches=caches),
            "vocabulary",
        ),
        "batch mismatch": (
            lambda: state.model(torch.zeros(state.batch + 1, 1, dtype=torch.long), caches=caches),
            "batch",
        ),
        "float token ids": (lambda: state.model(tokens.double(), caches=caches), "dtype"),
    }


class CachedDecoding(RuleBasedStateMachine):
    def __init__(self, factory) -> None:
        super().__init__()
        self.factory = factory
        self.sets: dict[str, CacheSet] = {}
        self.tokens = torch.Generator().manual_seed(0)

    @initialize(
        config=kvst.model_configs(max_layers=3),
        batch=st.integers(1, 3),
        dtype=st.sampled_from(kvst.DTYPES),
    )
    def build_model(self, config, batch, dtype):
        self.model, self.batch = kvst.build_model(config, dtype), batch
        self.sets["A"] = self.fresh_set()

    def fresh_set(self) -> CacheSet:
        built = self.model.new_caches(self.factory, batch=self.batch, max_length=MAX_LENGTH)
        return CacheSet([kvchk.WatchedCache(cache) for cache in built], self.batch)

    def pick(self, name: str) -> tuple[str, CacheSet]:
        return (name, self.sets[name]) if name in self.sets else ("A", self.sets["A"])

    def feed(self, name: str, size: int) -> None:
        name, cache_set = self.pick(name)
        size = min(size, MAX_LENGTH - cache_set.history.shape[1])
        if size == 0:
            return  # full: only a reset or a prefill makes room
        vocab = self.model.config.vocab_size
        new = torch.randint(0, vocab, (self.batch, size), generator=self.tokens)
        cache_set.history = torch.cat((cache_set.history, new), dim=1)
        start, end = cache_set.history.shape[1] - size, cache_set.history.shape[1]
        at = f"cache set {name}, {size} new tokens at absolute positions {start}..{end - 1}"
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

    @rule(name=SET_NAMES, size=st.integers(1, 2 * kvst.DEFAULT_CHUNK_SIZE + 1))
    def prefill(self, name, size):
        """A new prompt on this set: reset if it holds anything, then feed the prompt."""
        self.reset(name)
        self.feed(name, size)

    @rule(name=SET_NAMES)
    def decode_one_token(self, name):
        self.feed(name, 1)

    @rule(name=SET_NAMES, size=st.integers(2, kvst.DEFAULT_CHUNK_SIZE + 1))
    def decode_a_chunk(self, name, size):
        self.feed(name, size)

    @rule(name=SET_NAMES)
    def reset(self, name):
        name, cache_set = self.pick(name)
        for cache in cache_set.caches:
            cache.reset()
        cache_set.history = cache_set.history[:, :0]

    @rule(name=SET_NAMES)
    def fresh_caches(self, name):
        """New caches from the factory, for set A or a second, interleaved set B."""
        self.sets[name] = self.fresh_set()

    @rule(name=SET_NAMES, data=st.data())
    def bad_call(self, name, data):
        name, cache_set = self.pick(name)
        calls = bad_calls(self, cache_set.caches)
        which = data.draw(st.sampled_from(sorted(calls)), label="bad call")
        call, mentions = calls[which]
        error = None
        try:
            call()
        except (ValueError, TypeError) as raised:
            error = raised
        assert error is not None, f"{which} on cache set {name}: accepted without an error"
        assert any(word in str(error) for word in mentions.split("|")), (
            f"{which} on cache set {name}: the message does not mention {mentions!r}: {error}"
        )

    @invariant()
    def every_layer_holds_the_history(self):
        for name, cache_set in self.sets.items():
            lengths = [cache.length for cache in cache_set.caches]
            expected = cache_set.history.shape[1]
            assert lengths == [expected] * len(lengths), (
                f"cache set {name}: layer lengths {lengths}, but {expected} tokens were fed "
                "since its reset"
            )


def test_any_sequence_of_prefill_decode_reset_and_bad_calls(cache_factory):
    run_state_machine_as_test(
        lambda: CachedDecoding(cache_factory), settings=settings(stateful_step_count=20)
    )
