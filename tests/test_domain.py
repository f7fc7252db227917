"""A declared domain (``supports``, docs/contract.md section 7): read from a plain dict,
drawn inside and at its edges, never outside; properties without a draw inside it are "not
offered"; refusals inside it are crashes, one of them blamed on the declaration."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
import torch
from hypothesis import Phase, find, given, settings
from hypothesis import strategies as st

from kvcheck import Sizes, failures, verdict
from kvcheck import sizes as kvsizes
from kvcheck import strategies as kvst
from kvcheck.harness import build
from kvcheck.kit import search
from kvcheck.plugin import read_supports
from kvcheck.properties import ALL, BY_NAME
from kvcheck.sizes import Domain
from kvimpl import sdpa
from kvref import CacheSpec, ModelConfig
from tests import depth
from tests.independent.half_kernel_cache import HalfKernelCache
from tests.mutants.domain import DeclaresHeadDim256, RefusesLongChunks
from tests.pytest_run import run_in_process

SEARCH = settings(max_examples=1_000, database=None, deadline=None, phases=[Phase.generate])
HALF = {"dtypes": ("float16", "bfloat16"), "head_dims": (64, 128)}
EDGES = Sizes.of({"supports": {**HALF, "max_batch": 4, "max_length": 512, "windows": False}})


def test_a_plain_dict_declares_a_domain_and_says_what_it_leaves_out():
    domain = Sizes.of({"supports": HALF, "page": 16}).supports
    assert domain.dtypes == (torch.float16, torch.bfloat16)
    assert domain.describe() == (
        "dtypes: bfloat16, float16; head_dim: 64, 128; not tested: float32, float64, other "
        "head widths"
    )
    assert Sizes.of({"supports": HALF}) == Sizes(supports=Domain(**HALF))
    assert not Sizes().supports.declared  # nothing declared: everything the kit draws


@pytest.mark.parametrize(
    ("declared", "problem"),
    [
        ({"supports": {"dtype": ("float16",)}}, "unknown supports field dtype"),
        ({"supports": {"dtypes": ("int8",)}}, "'int8' is not a floating torch dtype"),
        ({"supports": {"head_dims": ()}}, "head_dims is empty"),
        ({"supports": {"head_dims": (63,)}}, "must be even"),
        ({"supports": {"max_length": 100}}, "at least 256"),
        ({"supports": {"windows": "no"}}, "True or False"),
        ({"head_dims": (256,), "supports": {"head_dims": (64, 128)}}, "aim outside"),
        ({"max_batch": 16, "supports": {"max_batch": 8}}, "aim outside"),
        ({"supports": [64]}, "must be a kvcheck.Domain or a dict"),
    ],
)
def test_a_bad_domain_is_refused_naming_the_field(declared, problem):
    with pytest.raises((ValueError, TypeError), match=problem):
        Sizes.of(declared)


def test_the_command_line_domain_wins_field_by_field():
    class Kernel:
        kv_sizes = {"supports": {**HALF, "max_batch": 8}}  # noqa: RUF012

    kvsizes.choose_options(Sizes(supports={"head_dims": (128,)}))
    try:
        domain = kvsizes.declared_by(Kernel).supports
    finally:
        kvsizes.choose_options(kvsizes.NONE)
    assert (domain.head_dims, domain.max_batch) == ((128,), 8)
    assert domain.dtypes == (torch.float16, torch.bfloat16)


def test_kv_supports_options_read_as_a_domain():
    given = ["dtypes=float16,bfloat16", "head_dims=64,128", "max_batch=8", "windows=false"]
    fields = read_supports(given)
    assert fields == {
        "dtypes": ("float16", "bfloat16"),
        "head_dims": (64, 128),
        "max_batch": 8,
        "windows": False,
    }
    assert Domain(**fields).max_batch == 8
    for bad in (["dtype=float16"], ["max_batch=4,8"], ["head_dims=sixty"], ["windows=maybe"]):
        with pytest.raises(ValueError, match="--kv-supports"):
            read_supports(bad)


@pytest.mark.parametrize(
    ("declared", "problem"),
    [
        ({"latent_dims": (512,)}, "latent_dims .* without latent: True"),
        ({"rope_dims": (64,), "latent": False}, "rope_dims .* without latent: True"),
        ({"latent": True, "latent_dims": ()}, "latent_dims is empty"),
        ({"latent": True, "rope_dims": (63,)}, "rope_dims must be even"),
        ({"latent": True, "latent_dims": ("512",)}, "latent_dims"),
        ({"latent": True, "latent_dims": (0,)}, "latent_dims"),
    ],
)
def test_a_bad_declaration_of_latent_widths_is_refused_naming_the_field(declared, problem):
    with pytest.raises((ValueError, TypeError), match=problem):
        Domain(**declared)


def test_declared_latent_widths_bound_latent_specs_alone():
    domain = Domain(**read_supports(["latent=true", "latent_dims=512", "rope_dims=64"]))
    assert (domain.latent_dims, domain.rope_dims) == ((512,), (64,))
    assert "not tested: other latent widths, other rope widths" in domain.describe()

    def spec(head_dim: int, value_dim: int | None) -> CacheSpec:
        return CacheSpec(1, 1, head_dim, 8, torch.float32, "cpu", value_dim=value_dim)

    assert domain.refuses(spec(64, 512)) is None
    assert domain.refuses(spec(8, None)) is None  # ordinary layers: any head width
    assert "latent width (value_dim) 16" in domain.refuses(spec(64, 16))
    assert "rope width (head_dim) 32" in domain.refuses(spec(32, 512))


def test_a_domain_that_depends_on_the_device_is_read_for_the_kits_device():
    assert not kvsizes.declared_by(sdpa.SdpaCache).supports.declared  # cpu: the math backend
    on_cuda = Sizes.of(sdpa.supported(torch.device("cuda"))).supports
    assert on_cuda.dtypes == (torch.float16, torch.bfloat16)
    assert 96 in on_cuda.head_dims
    assert 100 not in on_cuda.head_dims


@settings(max_examples=depth.pick(30, soak=300), database=None, deadline=None)
@given(data=st.data())
def test_every_draw_stays_inside_the_domain(data):
    with kvsizes.aiming_at(EDGES):
        spec = data.draw(kvst.cache_specs())
        scenario = data.draw(kvst.scenarios())
    assert EDGES.supports.refuses(spec) is None, spec
    config = scenario.config
    assert scenario.dtype in EDGES.supports.dtypes
    assert config.head_dim in (64, 128)
    assert scenario.batch <= 4
    assert scenario.max_length <= 512
    assert config.window is None


def test_the_edges_of_the_domain_are_hit():
    with kvsizes.aiming_at(EDGES):
        for head_dim in (64, 128):
            find(kvst.cache_specs(), lambda s, d=head_dim: s.head_dim == d, settings=SEARCH)
        for dtype in (torch.float16, torch.bfloat16):
            find(kvst.cache_specs(), lambda s, t=dtype: s.dtype == t, settings=SEARCH)
        find(kvst.cache_specs(), lambda spec: spec.batch == 4, settings=SEARCH)
        # Lengths at the boundaries of a supported page (no page aimed at).
    with kvsizes.aiming_at(Sizes.of({"supports": {"pages": (100,)}})):
        for near in (-1, 0, 1):  # k x 100 - 1, k x 100, k x 100 + 1, as no usual page has
            find(
                kvst.cache_plans(),
                lambda p, d=near: any(
                    (end - d) % 100 == 0 and (end - d) % 16
                    for end in itertools.accumulate(p.chunks)
                ),
                settings=SEARCH,
            )
    with kvsizes.aiming_at(EDGES):
        # Filled to its end at the largest max_length, with no model.
        find(
            kvst.cache_plans(room=1),
            lambda plan: plan.spec.max_length == 512 and plan.warm_length == 511,
            settings=SEARCH,
        )


@pytest.mark.soak  # hundreds of whole scenarios drawn
def test_whole_scenarios_reach_the_edges_of_the_domain():
    with kvsizes.aiming_at(EDGES):
        for dtype in (torch.float16, torch.bfloat16):
            find(kvst.scenarios(), lambda s, t=dtype: s.dtype == t, settings=SEARCH)
        find(kvst.scenarios(), lambda s: s.batch == 4, settings=SEARCH)
        find(kvst.scenarios(), lambda s: s.max_length == 512, settings=SEARCH)


def test_a_property_with_no_draw_inside_the_domain_is_not_offered():
    with kvsizes.aiming_at(Sizes.of({"supports": HALF})):
        # attend holds an attend element by element: float64 and float32 only.
        reason = BY_NAME["attend"].not_offered(sdpa.SdpaCache)
        assert "outside the declared domain" in reason
        assert "float64, float32" in reason
        # A cache without attend is told so, whatever its domain.
        assert "no attend() method" in BY_NAME["attend"].not_offered(HalfKernelCache)
        assert BY_NAME["logits"].not_offered(HalfKernelCache) is None
        assert "attend path" in BY_NAME["stale rows"].not_offered(sdpa.SdpaCache, "attend")
    with kvsizes.aiming_at(Sizes.of({"supports": {"max_batch": 1}})):
        assert "batch of 2" in BY_NAME["reorder"].not_offered(sdpa.SdpaCache)
    with kvsizes.aiming_at(Sizes.of({"supports": {"devices": ("cuda",)}})):
        for prop in ALL:  # nothing is built on a device the cache does not support
            assert "this run is on cpu" in prop.not_offered(sdpa.SdpaCache)


def test_a_cache_with_nothing_run_is_never_said_to_hold():
    entries = [
        {
            "cache": "k",
            "name": "m:K",
            "property": prop.name,
            "test": f"t{index}",
            "outcome": verdict.NOT_OFFERED,
            "reason": "not offered: outside the declared domain: the cache supports devices cuda",
        }
        for index, prop in enumerate(ALL)
    ]
    lines = verdict.render(verdict.tabulate(entries))
    assert lines[0].startswith("k (m:K): no property run")


def test_pinned_inputs_outside_the_domain_are_left_out():
    # LOGITS pins float64 scenarios of head_dim 4: outside, so never built; the search runs.
    logits = BY_NAME["logits"]
    built = []

    def factory(spec):
        built.append(spec)
        return HalfKernelCache(spec)

    factory.kv_sizes = HalfKernelCache.kv_sizes
    sizes = kvsizes.declared_by(factory)
    search(logits, lambda drawn: logits.run(factory, drawn, path="append"), {}, sizes, 0.1)
    assert built
    assert all(sizes.supports.refuses(spec) is None for spec in built)


def test_a_refusal_of_valid_input_inside_the_domain_is_a_crash():
    # A prompt of 100 tokens, inside the domain: refused, it fails as a crash.
    config = ModelConfig(vocab_size=11, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=64)
    session = kvst.Session((100,), token_seed=1, start="fresh")
    scenario = kvst.Scenario(config, 1, torch.float16, (session,))
    lengths = BY_NAME["lengths"]
    with kvsizes.aiming_at(kvsizes.declared_by(RefusesLongChunks)):
        assert lengths.not_offered(RefusesLongChunks) is None
        with pytest.raises(ValueError, match="at most 64 rows") as raised:
            lengths.run(RefusesLongChunks, scenario)
    assert failures.worst(raised.value, failures.DATA_LOSS)[0] == failures.CRASH


def test_a_domain_wider_than_the_cache_is_blamed_on_the_declaration():
    spec = CacheSpec(1, 1, 256, max_length=256, dtype=torch.bfloat16, device="cpu")
    with kvsizes.aiming_at(kvsizes.declared_by(DeclaresHeadDim256)):
        with pytest.raises(failures.RefusesValidInput) as raised:
            build(DeclaresHeadDim256, spec)
        # Outside it the kit builds nothing, and says it was the kit's draw.
        with pytest.raises(kvsizes.OutsideDomain, match="head_dim 96"):
            build(DeclaresHeadDim256, dataclasses.replace(spec, head_dim=96))
    assert failures.worst(raised.value, failures.DATA_LOSS)[0] == failures.CRASH
    assert "inside the domain the cache declares" in str(raised.value)
    assert "the declaration is wider than what the cache supports" in str(raised.value)


def test_the_header_the_verdict_and_the_json_name_the_domain(pytester):
    report = pytester.path / "verdict.json"
    result = run_in_process(
        pytester,
        *["--pyargs", "kvcheck", "-k", "nbytes_never or attend_equals"],
        *["--kv-impl", "tests.independent.half_kernel_cache:HalfKernelCache"],
        *["--kv-supports", "max_batch=4", "--kv-report", str(report)],
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    domain = "dtypes: bfloat16, float16; head_dim: 64, 128; batch: up to 4"
    left_out = "float32, float64, other head widths, batches past 4"
    assert f"kv domain of HalfKernelCache: {domain}; not tested: {left_out}" in output, output
    assert f"  domain       {domain}" in output, output
    assert f"  not tested   {left_out}" in output, output
    cache = json.loads(report.read_text())["caches"]["HalfKernelCache"]
    assert cache["domain"]["supports"]["max_batch"] == 4
    assert cache["domain"]["not tested"] == left_out.split(", ")
    attend = cache["properties"]["attend"]
    assert attend["result"] == "not offered", attend


def test_comparing_two_reports_says_when_the_domain_changed():
    row = {"result": "pass", "tests": 1, "failed": 0}
    wide = {"caches": {"k": {"properties": {"logits": row}}}}
    half = Domain(**HALF).as_json()
    narrow = {"caches": {"k": {"domain": half, "properties": {"logits": row}}}}
    lines, regressed = verdict.compare(wide, narrow)
    assert lines == [
        "k: domain: everything the kit draws -> dtypes: bfloat16, float16; head_dim: 64, 128; "
        "not tested: float32, float64, other head widths"
    ]
    assert not regressed
