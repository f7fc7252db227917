"""Stateful: one model and independent sets of caches, driven by prefill, decode, reset,
fresh caches, forks, drops, truncates, reorders and bad calls, interleaved in any order
Hypothesis finds (a ``RuleBasedStateMachine`` on the session engine).

After every step each set's lengths are checked, a feed's logits against the uncached model
over that set's whole history, what append returned against every row it was given, and
the views every other set returned earlier. A failure prints the shortest sequence of
steps, such as ``decode_a_chunk(cache_set=cache_sets_0, size=17)``.
"""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvcheck import asserts as kvassert
from kvcheck import badinput as kvbad
from kvcheck import failures
from kvcheck import profiles as kvprofiles
from kvcheck import sizes as kvsizes
from kvcheck import strategies as kvst
from kvcheck import tensors as kvtensors
from kvcheck.harness import recorded
from kvcheck.kit import KitTests, Property, offered, property_test
from kvcheck.session import Engine, Request
from kvref import CacheFactory

MAX_TOKENS = 64  # per set of caches: its max_length
STEPS = 20


class CachedDecoding(RuleBasedStateMachine):
    cache_sets = Bundle("cache_sets")

    def __init__(self, factory: CacheFactory, path: str) -> None:
        super().__init__()
        self.factory = factory
        self.path = path
        self.offered = offered(factory)
        self.feeds = 0  # the seed of each feed's tokens
        self.made = 0

    @initialize(
        target=cache_sets,
        # Every step runs the uncached model over the whole history: wide models only as
        # wide as a fraction of the attention budget allows.
        config=kvst.model_configs(max_layers=3, tokens=4 * MAX_TOKENS),
        batch=kvsizes.batches(small_max=3, room=3),
        dtype=kvst.dtypes_on_device(kvst.DTYPES),
    )
    def first_cache_set(self, config, batch, dtype):
        """The model every set runs on, and the first set of caches."""
        model = kvtensors.build_model(config, dtype)
        self.engine = Engine(self.factory, model, max_length=MAX_TOKENS, path=self.path)
        self.batch = batch
        return self.new_set()

    def teardown(self):
        # Books were audited after every step; checking the blocks came back here would
        # raise inside Hypothesis's cleanup and hide the failure that ended the run.
        if hasattr(self, "engine"):
            self.engine.finish(blocks_back=False)

    @rule(target=cache_sets)
    def fresh_caches(self):
        """Another set of caches from the factory, to interleave with the others."""
        return self.new_set()

    def new_set(self) -> Request:
        self.made += 1
        return self.engine.start(f"cache set {self.made - 1}", self.batch)

    def feed(self, cache_set: Request, size: int) -> None:
        size = min(size, MAX_TOKENS - cache_set.held)
        if size == 0 or cache_set.caches is None:
            return  # full: only a reset or a prefill makes room
        self.feeds += 1
        new = kvtensors.random_tokens(self.engine.model.config, self.batch, size, seed=self.feeds)
        self.engine.feed(cache_set, new)

    @rule(cache_set=cache_sets, size=st.integers(1, 2 * kvst.EDGE + 1))
    def prefill(self, cache_set, size):
        """A new prompt on this set: reset it, then feed the prompt."""
        self.engine.reset(cache_set)
        self.feed(cache_set, size)

    @rule(cache_set=cache_sets)
    def decode_one_token(self, cache_set):
        self.feed(cache_set, 1)

    @rule(cache_set=cache_sets, size=st.integers(2, kvst.EDGE + 1))
    def decode_a_chunk(self, cache_set, size):
        self.feed(cache_set, size)

    @rule(cache_set=cache_sets)
    def reset(self, cache_set):
        self.engine.reset(cache_set)

    @rule(cache_set=consumes(cache_sets))
    def drop(self, cache_set):
        """The set's caches go (a pool gets their blocks back); the others carry on."""
        self.engine.drop(cache_set)

    @precondition(lambda self: "fork" in self.offered)
    @rule(target=cache_sets, cache_set=cache_sets)
    def fork(self, cache_set):
        """A fork of the set: from then on two independent histories."""
        self.made += 1
        return self.engine.fork(cache_set, f"cache set {self.made - 1} (a fork)")

    @rule(cache_set=cache_sets, case=st.sampled_from(kvbad.BAD_CALLS), layer=st.integers(0, 2))
    def bad_call(self, cache_set, case, layer):
        """A bad call of the model on this set is refused, and changes none of its caches."""
        if cache_set.held + 2 > MAX_TOKENS:
            return  # a case may lengthen a layer, and reading back takes one more row
        model = self.engine.model
        spec = model.cache_spec(self.batch, max_length=MAX_TOKENS)
        state = kvbad.ModelState(
            model=model,
            caches=cache_set.caches,
            spare=recorded(self.engine.factory, spec),
            spec=spec,
            tokens=torch.zeros(self.batch, 1, dtype=torch.long, device=model.device),
            layer=layer % len(cache_set.caches),
        )
        if not case.applies(state):
            return
        tokens, caches = case.make(state)
        where = f"{cache_set.name}, holding {cache_set.held} tokens"
        error = kvassert.raised_by(lambda: model(tokens, caches=caches))
        kvassert.assert_refused(error, case, where=where, sent=(tokens, caches), method="model")
        for index, cache in enumerate(cache_set.caches):
            kvassert.assert_unchanged(cache, spec, who=f"layer {index}", where=where, case=case)
        # The wording is the bad-model-call property's to judge: here a cache's terse
        # message must not stop the machine from exploring decoding.
        # Reading back added one row to every layer: drop them all, as after a reset.
        self.engine.reset(cache_set)

    @precondition(lambda self: "truncate" in self.offered)
    @rule(cache_set=cache_sets, back=st.integers(0, 2 * kvst.EDGE + 1))
    def truncate(self, cache_set, back):
        """Forget the last ``back`` tokens (all when fewer are held) in every layer."""
        self.engine.truncate(cache_set, max(cache_set.held - back, 0))

    @precondition(lambda self: "reorder" in self.offered)
    @rule(cache_set=cache_sets, data=st.data())
    def reorder(self, cache_set, data):
        """Batch row b becomes the old row indices[b] in every layer (repeats allowed)."""
        rows = st.integers(0, self.batch - 1)
        drawn = data.draw(st.lists(rows, min_size=self.batch, max_size=self.batch), "indices")
        self.engine.reorder(cache_set, torch.tensor(drawn))

    @invariant()
    def every_layer_holds_the_history(self):
        """After every step: lengths, the views each set returned, the pool's books."""
        if hasattr(self, "engine"):
            self.engine.check("the last step")


def check_stateful(
    factory: CacheFactory, _drawn: None = None, *, path: str = "append", examples_scale=1.0
) -> None:
    """Any interleaving of prefill, decode, reset, fresh caches, forks, drops, truncates,
    reorders and bad calls on sets of caches from one factory keeps lengths and logits
    right."""
    kit = kvprofiles.current()
    examples = max(1, round(kit.max_examples * examples_scale))
    run_state_machine_as_test(
        lambda: CachedDecoding(factory, path),
        settings=settings(kit, max_examples=examples, stateful_step_count=STEPS),
    )


STATEFUL = Property(
    "stateful",
    "any interleaving of prefill, decode, reset, fresh caches, forks, drops, truncates, "
    "reorders and bad calls stays right",
    check_stateful,
    None,
    failures.WRONG_RESULTS,
    paths=True,
    since="1.0",
    holds=(
        "any interleaving of prefill, one-token and chunk decode, reset, fresh caches, bad calls, "
        "and truncate and reorder when offered keeps lengths and logits right (a Hypothesis state "
        "machine)"
    ),
)


class StatefulTests(KitTests):
    """Any interleaving of the calls an engine makes keeps every set of caches right."""

    test_any_sequence_of_prefill_decode_reset_and_bad_calls = property_test(STATEFUL)
