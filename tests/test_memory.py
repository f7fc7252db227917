"""Property 6: nbytes says what a cache reserves, never less than the keys and values held:
2 x B x H_kv x L x D x itemsize per layer, times the layers for a model."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvimpl
from kvref import ModelConfig, ReferenceTransformer, min_nbytes
from tests import checks as kvchk
from tests import scenarios as kvst


@given(plan=kvst.cache_plans(room=0, min_chunks=1))
def test_nbytes_never_less_than_what_is_held(cache_factory, plan):
    kvchk.check_nbytes(cache_factory, plan)


def reserved_rows(name: str, spec, length: int) -> int:
    """How many rows each built-in says it reserves for keys (and again for values)."""
    if name == "concat":
        return length  # exactly what it holds
    if name == "preallocated":
        return spec.max_length  # its whole buffer, from the start
    chunk = kvimpl.chunked.DEFAULT_CHUNK_SIZE
    return math.ceil(length / chunk) * chunk  # whole chunks: under one chunk of waste


@pytest.mark.parametrize("name", sorted(kvimpl.CACHES))
@given(data=st.data())
def test_builtin_nbytes_is_exactly_what_it_reserves(name, data):
    spec = data.draw(kvst.cache_specs(), label="spec")
    plan = data.draw(kvst.chunk_plans(spec.max_length, min_chunks=1), label="plan")
    cache = kvimpl.CACHES[name](spec)
    for step, rows in enumerate(plan):
        new = kvst.random_rows(spec, rows, seed=step)
        cache.append(new, new)
        expected = min_nbytes(spec, reserved_rows(name, spec, cache.length))
        assert cache.nbytes == expected, (
            f"{name}: nbytes is {cache.nbytes} holding {cache.length} tokens; it reserves "
            f"{expected} (after step {step} of plan {plan}; spec {spec})"
        )


SEED_BYTES = 51_200  # the teaching text's example: 2 layers, batch 1, 4 heads, L=100, D=8, fp32
SEED_CONFIG = ModelConfig(vocab_size=50, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=8)


def seed_example_bytes(factory) -> int:
    """Total nbytes of a model's caches after 100 tokens, as in the teaching text."""
    model = ReferenceTransformer(SEED_CONFIG, dtype=torch.float32)
    caches = model.new_caches(factory, batch=1, max_length=100)
    model(torch.arange(100).remainder(SEED_CONFIG.vocab_size)[None], caches=caches)
    return sum(cache.nbytes for cache in caches)


def test_the_seed_example_takes_51200_bytes(cache_factory):
    spec = ReferenceTransformer(SEED_CONFIG, dtype=torch.float32).cache_spec(1, max_length=100)
    formula = SEED_CONFIG.num_layers * min_nbytes(spec, length=100)
    assert formula == SEED_BYTES, f"the formula gives {formula} bytes, the seed says {SEED_BYTES}"
    total = seed_example_bytes(cache_factory)
    assert total >= SEED_BYTES, f"the caches report {total} bytes for 51,200 bytes of keys/values"


@pytest.mark.parametrize(
    ("name", "expected"), [("concat", 51_200), ("preallocated", 51_200), ("chunked", 57_344)]
)
def test_builtins_report_the_seed_example_exactly(name, expected):
    """Concat and a 100-row buffer take 51,200 bytes; 16-row chunks round 100 rows up to 112."""
    total = seed_example_bytes(kvimpl.CACHES[name])
    assert total == expected, f"{name}: {total} bytes for the seed example, expected {expected}"
