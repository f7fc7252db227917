"""The built-in caches through the kit, as a third party runs it on theirs, and what only
the built-ins promise: exact byte counts and the chunked cache at other chunk sizes.

``TestSelectedCaches`` has no ``factory``, so it runs on the caches named with ``--kv-impl``
or ``KV_IMPL``, else on those this repository names in pyproject.toml (``kv_impl``: every
built-in, as ``pytest -n auto`` runs it)."""

import dataclasses
import functools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvimpl
from kvcheck import CacheTests, CoreTests, ForkTests, PoolTests, ServingTests, Sizes
from kvcheck import strategies as kvst
from kvcheck import tensors as kvtensors
from kvcheck.kit import KitTests
from kvcheck.properties import core
from kvimpl import ChunkedCache, quantized_paged, sdpa
from kvimpl.latent import LatentCache
from kvimpl.quantized import QuantizedCache
from kvref import ModelConfig, ReferenceTransformer, min_nbytes
from tests import depth

# Built on the kit's device (--kv-device): skipped where this machine lacks it.
pytestmark = pytest.mark.kv_device


class TestSelectedCaches(CacheTests):
    # One drawn example a property in the default run (beside its pinned and edge inputs),
    # half the profile's under --soak: the built-ins are also the controls of every mutant
    # hunt, held by dev seeds, and searched in full by a user's `pytest --pyargs kvcheck
    # --kv-impl NAME` (the kit's own class, at the profile's count).
    examples_scale = depth.pick(0.05, soak=0.5)


class TestQuantizedCache(CacheTests):
    """The int8 cache under its declared storage (contract, section 10.1); not yet one of
    kvimpl.CACHES, whose benchmark rows hold every cache to the full-precision formula."""

    factory = QuantizedCache
    examples_scale = depth.pick(0.05, soak=0.5)


class TestQuantizedPagedPool(*depth.written_for(KitTests)):
    """The paged pool with blocks in int8 codes (contract, section 10.1): offload of codes in
    the default run (its prefix sessions cost seconds), and under --soak every property:
    prefix caching, pools, rows of their own, trees, moves and shards on codes; out of
    kvimpl.CACHES for the same reason as the int8 cache."""

    factory = quantized_paged.pool
    cache_name = "quantized_paged"
    examples_scale = depth.pick(0.05, soak=0.5)
    if not depth.SOAK:
        test_offloaded_rows_come_back = ServingTests.test_offloaded_rows_come_back


class TestLatentCache(CacheTests):
    """The latent (MLA) cache (contract, section 10.2): latent and rope key in one buffer
    row, held to every property on MLA models and latent specs beside the ordinary ones."""

    factory = LatentCache
    examples_scale = depth.pick(0.05, soak=0.5)


@pytest.mark.soak  # the tight domains below hold the domain's draws in the default run
class TestSdpaWithItsCudaDomain(CacheTests):
    """``sdpa`` held to the domain it declares on CUDA (half precision, its fused kernels'
    head widths), here on whatever backend this device has: the draws a GPU run makes."""

    factory = kvimpl.SdpaCache
    cache_name = "sdpa_cuda_domain"
    sizes = Sizes.of(sdpa.supported(torch.device("cuda")))
    # The whole kit runs on sdpa above; this checks the domain's draws.
    examples_scale = depth.pick(0.05, soak=0.25)


# A domain that bounds every field a plan draws (one head width, two kv heads, two query
# heads per kv head, batch 2, max_length 256, no windows): a draw of any property that escaped
# it would fail as a kit error.
TIGHT = {
    "dtypes": ("float32", "bfloat16"),
    "head_dims": (64,),
    "kv_heads": (2,),
    "groups": (2,),
    "max_batch": 2,
    "max_length": 256,
    "windows": False,
}


@pytest.mark.soak  # the pool below runs the same domain in the default run
class TestSdpaInATightDomain(CacheTests):
    """``sdpa`` declaring the tight domain."""

    factory = kvimpl.SdpaCache
    cache_name = "sdpa_tight_domain"
    sizes = Sizes.of({"supports": TIGHT})
    examples_scale = depth.pick(0.05, soak=0.25)


class TestPagedInATightDomain(*depth.written_for(CoreTests, PoolTests, ForkTests)):
    """The tight domain for a pool (fork, copy-on-write, an exhausted pool), of its own page
    size: those areas in the default run, every property under --soak."""

    factory = kvimpl.CACHES["paged"]
    cache_name = "paged_tight_domain"
    sizes = Sizes.of({"supports": {**TIGHT, "pages": (16,)}})
    examples_scale = depth.pick(0.05, soak=0.25)


@pytest.mark.parametrize("chunk_size", [1, 3, 5])
@settings(max_examples=depth.pick(3, soak=20))
@given(scenario=kvst.scenarios(max_sessions=2))
def test_chunked_cache_at_any_chunk_size(chunk_size, scenario):
    factory = functools.partial(ChunkedCache, chunk_size=chunk_size)
    core.check_lengths(factory, scenario)
    core.check_logits_match_uncached(factory, scenario)


@pytest.mark.parametrize("chunk_size", [0, -1, 1.5, True])
def test_a_chunk_size_that_is_not_a_positive_int_is_refused(chunk_size):
    spec = kvst.PINNED[0].model().cache_spec(batch=1, max_length=4)
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        ChunkedCache(spec, chunk_size=chunk_size)


def reserved_rows(name: str, spec, length: int) -> int:
    """How many rows each built-in reserves for keys (and again for values)."""
    chunk = kvimpl.chunked.DEFAULT_CHUNK_SIZE
    block = kvimpl.paged.DEFAULT_BLOCK_SIZE
    return {
        "concat": length,  # exactly what it holds
        "preallocated": spec.max_length,  # its whole buffer, from the start
        "chunked": math.ceil(length / chunk) * chunk,  # whole chunks: under one of waste
        "paged": math.ceil(length / block) * block,  # whole blocks, none shared here
    }[name]


@pytest.mark.parametrize("name", ["chunked", "concat", "preallocated", "paged"])
@given(data=st.data())
def test_builtin_nbytes_is_exactly_what_it_reserves(name, data):
    spec = data.draw(kvst.cache_specs(), label="spec")
    plan = data.draw(kvst.chunk_plans(spec.max_length, min_chunks=1), label="plan")
    cache = kvimpl.CACHES[name](spec)
    for step, rows in enumerate(plan):
        new = kvtensors.random_rows(spec, rows, seed=step)
        cache.append(new, new)
        # The built-ins keep every row, window or not.
        rows = reserved_rows(name, spec, cache.length)
        expected = min_nbytes(dataclasses.replace(spec, window=None), rows)
        assert cache.nbytes == expected, (
            f"{name}: nbytes is {cache.nbytes} holding {cache.length} tokens; it reserves "
            f"{expected} (after step {step} of plan {plan}; spec {spec})"
        )


# The teaching text's example: 2 layers, batch 1, 4 heads, 100 tokens, head_dim 8, float32.
TEACHING_EXAMPLE_BYTES = 51_200
TEACHING_EXAMPLE = ModelConfig(vocab_size=50, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=8)


@pytest.mark.parametrize(
    ("name", "expected"),
    [("concat", 51_200), ("preallocated", 51_200), ("chunked", 57_344), ("paged", 57_344)],
)
def test_builtins_report_the_teaching_example_exactly(name, expected):
    """Concat and a 100-row buffer take 51,200 bytes; 16-row chunks or blocks round 100 rows
    up to 112."""
    model = ReferenceTransformer(TEACHING_EXAMPLE, dtype=torch.float32)
    spec = model.cache_spec(1, max_length=100)
    formula = TEACHING_EXAMPLE.num_layers * min_nbytes(spec, length=100)
    assert formula == TEACHING_EXAMPLE_BYTES, f"the formula gives {formula} bytes, not 51,200"
    caches = model.new_caches(kvimpl.CACHES[name], batch=1, max_length=100)
    model(torch.arange(100).remainder(TEACHING_EXAMPLE.vocab_size)[None], caches=caches)
    total = sum(cache.nbytes for cache in caches)
    assert total == expected, f"{name}: {total} bytes for the teaching example, expected {expected}"


@given(data=st.data())
def test_the_window_cache_holds_the_window_and_its_largest_append_at_most(data):
    spec = data.draw(kvst.cache_specs(), label="spec")
    window = data.draw(st.integers(1, 2 * kvst.EDGE + 1), label="window")
    spec = dataclasses.replace(spec, window=window, max_length=200)
    plan = data.draw(kvst.chunk_plans(200, min_chunks=1, max_chunks=20), label="plan")
    cache = kvimpl.CACHES["window"](spec)
    for step, rows in enumerate(plan):
        new = kvtensors.random_rows(spec, rows, seed=step)
        cache.append(new, new)
        bound = min_nbytes(
            dataclasses.replace(spec, window=None), window - 1 + max(plan[: step + 1])
        )
        assert cache.nbytes <= bound, (
            f"window: nbytes is {cache.nbytes} after {cache.length} tokens in appends of "
            f"{plan[: step + 1]}; a window of {window} needs at most {bound} (W - 1 + the "
            f"largest append rows); spec {spec}"
        )
