"""Declared sizes (``kvcheck.Sizes``) and the reach of the draws: the sizes a cache declares
are hit on purpose, every draw stays within its cost budget, and the model that runs wide
heads keeps a narrow residual."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from hypothesis import Phase, find, given, settings
from hypothesis import strategies as st

from kvcheck import Sizes
from kvcheck import sizes as kvsizes
from kvcheck import strategies as kvst
from kvimpl import ChunkedCache, ConcatCache
from kvref import ModelConfig, ReferenceTransformer
from tests import depth

# Generation only: ``find`` returns the first example that reaches, without shrinking it.
SEARCH = settings(max_examples=1_000, database=None, deadline=None, phases=[Phase.generate])


@pytest.mark.parametrize(
    ("declared", "problem"),
    [
        ({"page": 0}, "page must be a positive int"),
        ({"max_batch": True}, "max_batch must be a positive int"),
        ({"head_dims": (64, 65)}, r"head_dims must be even .*\[65\]"),
        ({"kv_heads": (8, -1)}, "kv_heads must be a positive int"),
        ({"pages": 128}, "unknown size pages"),
    ],
)
def test_a_bad_declaration_is_refused_naming_the_size(declared, problem):
    with pytest.raises(ValueError, match=problem):
        Sizes.of(declared)


def test_the_command_line_wins_over_the_class_which_wins_over_the_factory():
    class Paged(ConcatCache):
        kv_sizes = Sizes(page=128, head_dims=(64,), max_batch=4)

    class Tests:
        sizes = Sizes(max_batch=8, kv_heads=(8,))

    assert kvsizes.declared_by(Paged) == Sizes(page=128, head_dims=(64,), max_batch=4)
    assert kvsizes.declared_by(functools.partial(Paged)) == kvsizes.declared_by(Paged)
    by_class = Sizes(page=128, head_dims=(64,), kv_heads=(8,), max_batch=8)
    assert kvsizes.declared_by(Paged, Tests) == by_class
    kvsizes.choose_options(Sizes(page=256))
    try:
        assert kvsizes.declared_by(Paged, Tests) == Sizes(256, (64,), (8,), 8)
    finally:
        kvsizes.choose_options(kvsizes.NONE)


def test_the_builtin_chunked_cache_declares_its_chunk_size():
    assert kvsizes.declared_by(ChunkedCache) == Sizes(page=16)


def ends(session: kvst.Session) -> list[int]:
    return list(itertools.accumulate(session.chunks))


@pytest.mark.parametrize("page", [pytest.param(96, marks=pytest.mark.soak), 200])
def test_a_declared_page_is_hit_at_its_boundaries_and_straddled(page):
    """Lengths k x page - 1, k x page and k x page + 1, and a warm chunk across a page end,
    for a page that no power of two divides."""
    with kvsizes.aiming_at(Sizes(page=page)):
        for length in (2 * page - 1, 2 * page, 2 * page + 1):
            find(kvst.long_sessions("fresh"), lambda s, n=length: n in ends(s), settings=SEARCH)

        def straddles(session: kvst.Session) -> bool:
            return any(
                0 < start < k * page < start + size
                for start, size in zip([0, *ends(session)], session.chunks[1:], strict=False)
                for k in range(1, 5)
            )

        find(kvst.long_sessions("fresh"), straddles, settings=SEARCH)
        # And a cache warmed to exactly a page, with no model (cache-level properties).
        find(
            kvst.cache_plans(),
            lambda plan: page in itertools.accumulate(plan.chunks),
            settings=SEARCH,
        )


AIMED = Sizes(head_dims=(72,), kv_heads=(12,), max_batch=16)


def test_declared_head_dims_kv_heads_and_batch_are_drawn():
    with kvsizes.aiming_at(AIMED):
        # The model and the batch a scenario draws, without its sessions (a tenth the cost of
        # whole scenarios, which the soak tier searches below).
        find(kvst.model_configs(), lambda c: c.head_dim == 72, settings=SEARCH)
        find(kvst.model_configs(), lambda c: c.num_kv_heads == 12, settings=SEARCH)
        find(kvsizes.batches(), lambda batch: batch == 16, settings=SEARCH)
        find(kvst.cache_specs(), lambda spec: spec.head_dim == 72, settings=SEARCH)
        find(kvst.cache_specs(), lambda spec: spec.batch > 8, settings=SEARCH)


@pytest.mark.soak  # hundreds of whole scenarios drawn
def test_a_whole_scenario_reaches_a_declared_head_dim():
    with kvsizes.aiming_at(AIMED):
        find(kvst.scenarios(), lambda s: s.config.head_dim == 72, settings=SEARCH)


def attention_cost(scenario: kvst.Scenario) -> int:
    c = scenario.config
    return scenario.batch * c.num_heads * (c.head_dim + kvsizes.SCORE_COST) * scenario.max_length**2


@settings(max_examples=depth.pick(30, soak=100), database=None)
@given(scenario=kvst.scenarios())
def test_a_scenario_goes_large_only_within_its_attention_budget(scenario):
    c = scenario.config
    smallest = c.head_dim <= 8 and c.num_kv_heads <= 3 and c.num_heads <= 9 and scenario.batch <= 4
    assert smallest or attention_cost(scenario) <= kvsizes.ATTENTION_BUDGET, scenario.describe()


def test_a_wide_model_keeps_a_narrow_residual_and_matches_its_cached_self():
    config = ModelConfig(
        vocab_size=11, num_layers=1, num_heads=16, num_kv_heads=8, head_dim=256, hidden=16
    )
    model = ReferenceTransformer(config)
    assert model.embedding.weight.shape == (11, 16)
    assert model.blocks[0].attention.query.weight.shape == (16 * 256, 16)
    tokens = torch.arange(6).remainder(11)[None]
    caches = model.new_caches(ConcatCache, batch=1, max_length=6)
    cached = torch.cat(
        [model(tokens[:, :4], caches=caches), model(tokens[:, 4:], caches=caches)], 1
    )
    torch.testing.assert_close(cached, model(tokens), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("hidden", [0, -3, True])
def test_a_hidden_width_that_is_not_a_positive_int_is_refused(hidden):
    with pytest.raises(ValueError, match="hidden must be None or an int >= 1"):
        ModelConfig(hidden=hidden)


@given(st.data())
def test_long_sessions_reach_past_1024_tokens(data):
    # Not every one: but the strategy can, and its chunks stay whole tokens.
    session = data.draw(kvst.long_sessions("fresh"))
    assert all(size >= 1 for size in session.chunks)
    assert session.length <= kvsizes.LONG + 12


def test_some_long_session_is_past_1024_tokens():
    find(kvst.long_sessions("fresh"), lambda s: s.length > 1024, settings=SEARCH)
