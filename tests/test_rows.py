"""Rows of their own (docs/contract.md, section 8), as far as they are built: the reference
model's path through ``append_rows`` and a first position other than 0, on the built-in
``preallocated`` and on an independent left-padded batch cache. The oracle is the one of every
property: each row of a mixed batch against the uncached model on that row alone, at batch 1,
at its own positions. The kit's property, ``mixed lengths``, is in kvcheck/properties/rows.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from kvcheck import session
from kvcheck.plan_events import FeedRows
from kvcheck.properties import rows as rows_property
from kvimpl import PreallocatedCache
from kvref import CacheContractError, ModelConfig, ReferenceTransformer
from kvref.rows import row_slots, rows_laid_out
from tests import depth

CONFIG = ModelConfig(vocab_size=19, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4, seed=3)
MODEL = ReferenceTransformer(CONFIG)
BATCH, MAX_LENGTH = 3, 40


def factories():
    from tests.independent.left_padded_batch_cache import LeftPaddedBatchCache

    return [PreallocatedCache, LeftPaddedBatchCache]


def laid_out(rows: list[torch.Tensor], padding: str) -> torch.Tensor:
    return rows_laid_out(rows, padding)[0]


def real_slots(logits: torch.Tensor, counts: list[int], padding: str) -> list[torch.Tensor]:
    width = logits.shape[1]
    return [logits[b, row_slots(padding, width, n)] for b, n in enumerate(counts)]


def check_rows_against_alone(histories, firsts, new_logits, counts, padding, step):
    """Row b's new logits equal the uncached model on its history alone, at its positions."""
    for b, got in enumerate(real_slots(new_logits, counts, padding)):
        if not counts[b]:
            continue
        alone = MODEL(histories[b][None], start_position=firsts[b])[0, -counts[b] :]
        assert_close(
            got,
            alone,
            msg=lambda m, b=b: (
                f"step {step}, row {b} (history {len(histories[b])} tokens from position "
                f"{firsts[b]}; its neighbours' lengths {[len(h) for h in histories]}): {m}"
            ),
        )


@pytest.mark.parametrize("factory", factories(), ids=lambda f: f.__name__)
@settings(max_examples=depth.pick(8, soak=40), deadline=None)
@given(data=st.data())
def test_a_row_of_a_mixed_batch_equals_the_row_alone(factory, data):
    padding = getattr(factory, "padding", "right")
    caches = MODEL.new_caches(factory, batch=BATCH, max_length=MAX_LENGTH)
    firsts = data.draw(st.lists(st.integers(0, 70), min_size=BATCH, max_size=BATCH), "firsts")
    if any(firsts):
        for cache in caches:
            cache.reset_at(tuple(firsts))
    histories = [torch.empty(0, dtype=torch.long) for _ in range(BATCH)]
    steps = data.draw(st.integers(1, 5), "steps")
    for step in range(steps):
        room = [MAX_LENGTH - len(h) for h in histories]
        counts = [data.draw(st.integers(0, min(6, r)), f"count {b}") for b, r in enumerate(room)]
        if not any(counts):
            continue
        new = [torch.randint(0, CONFIG.vocab_size, (n,)) for n in counts]
        logits = MODEL.forward_rows(laid_out(new, padding), counts, caches)
        histories = [torch.cat((h, n)) for h, n in zip(histories, new, strict=True)]
        check_rows_against_alone(histories, firsts, logits, counts, padding, step)
        assert all(cache.row_lengths == tuple(map(len, histories)) for cache in caches)
        if data.draw(st.booleans(), "truncate rows"):
            keep = [data.draw(st.integers(0, len(h)), f"keep {b}") for b, h in enumerate(histories)]
            for cache in caches:
                cache.truncate_rows(tuple(keep))
            histories = [h[:k] for h, k in zip(histories, keep, strict=True)]


@pytest.mark.parametrize("factory", factories(), ids=lambda f: f.__name__)
def test_rows_leave_and_join_with_their_histories(factory):
    padding = getattr(factory, "padding", "right")
    caches = MODEL.new_caches(factory, batch=BATCH, max_length=MAX_LENGTH)
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, CONFIG.vocab_size, (n,), generator=generator) for n in (5, 1, 9)]
    MODEL.forward_rows(laid_out(prompts, padding), [5, 1, 9], caches)
    for cache in caches:  # the second row finished
        cache.select_rows(torch.tensor([0, 2]))
    joining = MODEL.new_caches(factory, batch=1, max_length=MAX_LENGTH)
    late = torch.randint(0, CONFIG.vocab_size, (3,), generator=generator)
    MODEL.forward_rows(laid_out([late], padding), [3], joining)
    for cache, other in zip(caches, joining, strict=True):
        cache.join(other)
    histories = [prompts[0], prompts[2], late]
    new = [torch.randint(0, CONFIG.vocab_size, (1,), generator=generator) for _ in range(3)]
    logits = MODEL.forward_rows(laid_out(new, padding), [1, 1, 1], caches)
    histories = [torch.cat((h, n)) for h, n in zip(histories, new, strict=True)]
    check_rows_against_alone(histories, [0, 0, 0], logits, [1, 1, 1], padding, 1)


def test_a_session_from_another_first_position_rotates_there():
    caches = MODEL.new_caches(PreallocatedCache, batch=2, max_length=MAX_LENGTH)
    for cache in caches:
        cache.reset_at(1000)
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    MODEL(tokens[:, :4], caches=caches)
    logits = MODEL(tokens[:, 4:], caches=caches)
    assert_close(logits, MODEL(tokens, start_position=1000)[:, 4:])
    _, uncached = MODEL.forward_with_kv(tokens, start_position=1000)
    assert_close(caches[0].key[:, :, :7], uncached[0][0])  # keys rotated at 1000..1006


class MarksAPadValid(PreallocatedCache):
    """Every row's valid mask one slot too long: a pad of nan read as a row."""

    def append_rows(self, key, value, counts):
        keys, values, valid = super().append_rows(key, value, counts)
        return keys, values, torch.ones_like(valid)


def test_a_pad_marked_valid_is_refused_by_the_model():
    caches = MODEL.new_caches(MarksAPadValid, batch=2, max_length=MAX_LENGTH)
    with pytest.raises(CacheContractError, match="row 1 held 0 tokens and got 2 more"):
        MODEL.forward_rows(torch.zeros(2, 5, dtype=torch.long), [5, 2], caches)


@pytest.mark.parametrize(
    ("counts", "problem"),
    [
        ((1, 2), "one entry per batch row"),
        ((1, 2, 9), "from 0 to the 5 slots"),
        ((1, True, 2), "from 0 to the 5 slots"),
    ],
)
def test_bad_counts_are_refused_before_any_cache_changes(counts, problem):
    caches = MODEL.new_caches(PreallocatedCache, batch=3, max_length=MAX_LENGTH)
    with pytest.raises(ValueError, match=problem):
        MODEL.forward_rows(torch.zeros(3, 5, dtype=torch.long), counts, caches)
    assert all(cache.row_lengths == (0, 0, 0) for cache in caches)


class OnlyAppendRows(PreallocatedCache):
    """Rows of their own without one optional member of section 8 beside append_rows."""

    truncate_rows = select_rows = join = reset_at = None


def test_a_cache_without_the_optional_members_is_held_to_the_rest():
    from kvcheck.properties.rows import MIXED_LENGTHS, PINNED

    for plan in PINNED:  # truncate, select, join and first positions: each left out
        MIXED_LENGTHS.check(OnlyAppendRows, plan)


class ReturnsAListWithAStaleRow(PreallocatedCache):
    """append_rows returns a list, and its first valid key of row 0 is not the row given."""

    def append_rows(self, key, value, counts):
        keys, values, valid = super().append_rows(key, value, counts)
        keys = keys.clone()
        keys[0, :, 0] += 1
        return [keys, values, valid]


def test_rows_returned_as_a_list_are_checked_too():
    from kvcheck import failures
    from kvcheck.properties.rows import MIXED_LENGTHS, PINNED

    with pytest.raises(failures.DataLoss, match="that append_rows marked valid is not the row"):
        MIXED_LENGTHS.check(ReturnsAListWithAStaleRow, PINNED[0])


class Delegating:
    """A correct cache by composition: every member passed on to a PreallocatedCache through
    __getattr__ (as an adapter around an engine's cache is written); ``join`` unwraps."""

    def __init__(self, spec) -> None:
        self.__dict__["inner"] = PreallocatedCache(spec)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def join(self, other: Delegating) -> None:
        self.inner.join(other.inner)


def test_a_cache_that_offers_members_through_getattr_runs_the_whole_plan(monkeypatch):
    # Its capabilities are on the object, not its class: every event of the plan must run.
    called = []
    for name in ("feed_rows", "truncate_rows", "select_rows", "join", "reset_at"):
        original = getattr(session.Engine, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            called.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(session.Engine, name, counted)
    rows_property.check_mixed_lengths(Delegating, rows_property.PINNED[0])
    methods = {FeedRows: "feed_rows", **rows_property.NEEDS}
    wanted = {methods[type(event)] for event in rows_property.PINNED[0].events}
    assert {*wanted, "reset_at"} <= set(called), called


@pytest.mark.parametrize("pad", ["nan", "-inf"])
def test_a_pad_query_that_sees_no_key_reaches_no_real_row_in_bfloat16(pad):
    # A row that brings no token and holds none: its pad queries see no key (nan). oneDNN's
    # bfloat16 GEMM on the CPU carried that nan into row 1's logits through the output
    # projection, and the model's own batch failed a correct cache; the model now zeroes a
    # pad slot's attention. Found by a random seed of the soak tier on five built-ins.
    plan = rows_property.RowsPlan(
        config=ModelConfig(vocab_size=5, num_layers=1, num_heads=9, num_kv_heads=3, head_dim=6),
        dtype=torch.bfloat16,
        batch=3,
        events=(FeedRows((1, 0, 0)), FeedRows((0, 6, 0))),
        token_seed=0,
        pad=pad,
    )
    rows_property.check_mixed_lengths(PreallocatedCache, plan)
