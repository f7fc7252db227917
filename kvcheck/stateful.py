"""Stateful sessions: one model and independent sets of caches, driven by prefill, decode,
reset, fresh caches and bad calls, interleaved in any order Hypothesis finds.

After every step, each set's lengths and the last logits are checked against the uncached
model run over that set's whole history, and what append returned against every row it was
given. A failure prints the shortest sequence of steps, such as
``decode_a_chunk(cache_set=cache_sets_0, size=17)``.
"""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvcheck import asserts as kvassert
from kvcheck import badinput as kvbad
from kvcheck import devices as kvdevices
from kvcheck import profiles as kvprofiles
from kvcheck import strategies as kvst
from kvcheck.failures import DataLoss, RefusesValidInput
from kvcheck.harness import Recorder, build, may_refuse, record
from kvref import CacheFactory, CacheSpec, capabilities


def probe_spec() -> CacheSpec:
    """The spec a factory is asked for once, to see which optional capabilities its caches
    offer: on the kit's device, in its first dtype there."""
    dtype = kvdevices.usable(kvst.DTYPES)[0]
    return CacheSpec(1, 1, 2, max_length=8, dtype=dtype, device=kvdevices.current())


MAX_LENGTH = 64
STEPS = 20


class CacheSet:
    """One cache per layer, and every token fed to them since their last reset."""

    def __init__(self, name: str, caches: list[Recorder], batch: int) -> None:
        self.name = name
        self.caches = caches
        self.history = torch.empty(batch, 0, dtype=torch.long, device=kvdevices.current())


class CachedDecoding(RuleBasedStateMachine):
    cache_sets = Bundle("cache_sets")

    def __init__(self, factory: CacheFactory) -> None:
        super().__init__()
        self.factory = factory
        self.offered = capabilities(factory(probe_spec()))
        self.every_set: list[CacheSet] = []
        self.token_generator = torch.Generator().manual_seed(0)

    @initialize(
        target=cache_sets,
        # Every step runs the uncached model over the whole history: wide models only as
        # wide as a fraction of the attention budget allows.
        config=kvst.model_configs(max_layers=3, tokens=4 * MAX_LENGTH),
        batch=st.integers(1, 3),
        dtype=kvst.dtypes_on_device(kvst.DTYPES),
    )
    def first_cache_set(self, config, batch, dtype):
        """The model every set runs on, and the first set of caches."""
        self.model, self.batch = kvst.build_model(config, dtype), batch
        return self.new_set()

    @rule(target=cache_sets)
    def fresh_caches(self):
        """Another set of caches from the factory, to interleave with the others."""
        return self.new_set()

    def new_set(self) -> CacheSet:
        built = self.model.new_caches(self.factory, batch=self.batch, max_length=MAX_LENGTH)
        cache_set = CacheSet(
            f"cache set {len(self.every_set)}", record(built, self.model.config), self.batch
        )
        self.every_set.append(cache_set)
        return cache_set

    def feed(self, cache_set: CacheSet, size: int) -> None:
        size = min(size, MAX_LENGTH - cache_set.history.shape[1])
        if size == 0:
            return  # full: only a reset or a prefill makes room
        vocab = self.model.config.vocab_size
        new = torch.randint(0, vocab, (self.batch, size), generator=self.token_generator)
        new = new.to(self.model.device)
        cache_set.history = torch.cat((cache_set.history, new), dim=1)
        start, end = cache_set.history.shape[1] - size, cache_set.history.shape[1]
        where = f"{cache_set.name}, {size} new tokens at absolute positions {start}..{end - 1}"
        logits = self.model(new, caches=cache_set.caches)
        kvassert.assert_close_at(
            logits,
            self.model(cache_set.history)[:, start:],
            what="cached and uncached logits",
            where=where,
            position_axis=1,
            first_position=start,
        )
        for layer, cache in enumerate(cache_set.caches):
            kvassert.assert_returned_rows(cache, who=f"layer {layer}", where=where)

    def empty(self, cache_set: CacheSet) -> None:
        for cache in cache_set.caches:
            cache.reset()
        cache_set.history = cache_set.history[:, :0]

    @rule(cache_set=cache_sets, size=st.integers(1, 2 * kvst.EDGE + 1))
    def prefill(self, cache_set, size):
        """A new prompt on this set: reset it, then feed the prompt."""
        self.empty(cache_set)
        self.feed(cache_set, size)

    @rule(cache_set=cache_sets)
    def decode_one_token(self, cache_set):
        self.feed(cache_set, 1)

    @rule(cache_set=cache_sets, size=st.integers(2, kvst.EDGE + 1))
    def decode_a_chunk(self, cache_set, size):
        self.feed(cache_set, size)

    @rule(cache_set=cache_sets)
    def reset(self, cache_set):
        self.empty(cache_set)

    @rule(cache_set=cache_sets, case=st.sampled_from(kvbad.BAD_CALLS), layer=st.integers(0, 2))
    def bad_call(self, cache_set, case, layer):
        """A bad call of the model on this set is refused, and changes none of its caches."""
        if cache_set.history.shape[1] + 2 > MAX_LENGTH:
            return  # a case may lengthen a layer, and reading back takes one more row
        spec = self.model.cache_spec(self.batch, max_length=MAX_LENGTH)
        state = kvbad.ModelState(
            model=self.model,
            caches=cache_set.caches,
            spare=build(self.factory, spec),
            spec=spec,
            tokens=torch.zeros(self.batch, 1, dtype=torch.long, device=self.model.device),
            layer=layer % len(cache_set.caches),
        )
        if not case.applies(state):
            return
        tokens, caches = case.make(state)
        where = f"{cache_set.name}, holding {cache_set.history.shape[1]} tokens"
        error = kvassert.raised_by(lambda: self.model(tokens, caches=caches))
        kvassert.assert_refused(error, case, where=where)
        for index, cache in enumerate(cache_set.caches):
            kvassert.assert_unchanged(cache, spec, who=f"layer {index}", where=where)
        # The wording is the bad-model-call property's to judge: here a cache's terse
        # message must not stop the machine from exploring decoding.
        # Reading back added one row to every layer: drop them all, as after a reset.
        self.empty(cache_set)

    @precondition(lambda self: "truncate" in self.offered)
    @rule(cache_set=cache_sets, back=st.integers(0, 2 * kvst.EDGE + 1))
    def truncate(self, cache_set, back):
        """Forget the last ``back`` tokens (all when fewer are held) in every layer."""
        held = cache_set.history.shape[1]
        target = max(held - back, 0)
        error = kvassert.raised_by(lambda: self.model.truncate(cache_set.caches, target))
        if error is None:
            cache_set.history = cache_set.history[:, :target]
        elif not (isinstance(error, ValueError) and may_refuse(self.model.config, held, target)):
            raise RefusesValidInput(
                f"{cache_set.name}: truncate from {held} tokens to {target} refused with "
                f"{type(error).__name__}: {error}; no layer may refuse it"
            ) from error

    @precondition(lambda self: "reorder" in self.offered)
    @rule(cache_set=cache_sets, data=st.data())
    def reorder(self, cache_set, data):
        """Batch row b becomes the old row indices[b] in every layer (repeats allowed)."""
        rows = st.integers(0, self.batch - 1)
        drawn = data.draw(st.lists(rows, min_size=self.batch, max_size=self.batch), "indices")
        indices = torch.tensor(drawn, device=self.model.device)
        self.model.reorder(cache_set.caches, indices)
        cache_set.history = cache_set.history[indices]

    @invariant()
    def every_layer_holds_the_history(self):
        for cache_set in self.every_set:
            lengths = [cache.length for cache in cache_set.caches]
            expected = cache_set.history.shape[1]
            if lengths != [expected] * len(lengths):
                raise DataLoss(
                    f"{cache_set.name}: layer lengths {lengths}, but {expected} tokens were fed "
                    "since its reset"
                )


def run_machine(factory: CacheFactory) -> None:
    run_state_machine_as_test(
        lambda: CachedDecoding(factory),
        settings=settings(kvprofiles.current(), stateful_step_count=STEPS),
    )
