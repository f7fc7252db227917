"""``attend(query, key, value)`` against ``kvref.attention``: no model, one cache, many calls.

A plan warms a cache with appends and attend calls in any order, each of T rows, and every
attend must return what the reference attention computes over every row given since the
reset (the reference masks by absolute position, so a cache that keeps only a window gives
the same answer): causal and window masks, grouped-query heads (H a multiple of H_kv), a
chunk of several queries on a warm cache, and for a cache that declares attention sinks
(contract, 8.5) the sinks beside the window, at the positions they were given. Some plans
scale queries and keys up until the scores pass exp's overflow (709 in float64, 88 in
float32): a softmax that forgets to subtract its running maximum returns inf or nan there,
where the reference does not.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch
from hypothesis import strategies as st

from kvcheck import asserts as kvassert
from kvcheck import devices as kvdevices
from kvcheck import failures, grammar, reach
from kvcheck import scope as kvscope
from kvcheck import sizes as kvsizes
from kvcheck import strategies as kvst
from kvcheck import tensors as kvtensors
from kvcheck.harness import SPEC_EDGES, build, coarser, note_spec
from kvcheck.kit import KitTests, Property, property_test
from kvref import CacheFactory, CacheSpec, attention
from kvref.quantized import storage
from kvref.reprs import short_repr

# Queries and keys times this make scores of some hundreds, past exp's overflow in each
# dtype, while the dot products keep enough precision for the dtype's tolerance.
LARGE = {torch.float64: 30.0, torch.float32: 8.0}


@short_repr
@dataclass(frozen=True)
class AttendPlan:
    """A cache spec, the query heads, and calls: ("append" or "attend", T new rows)."""

    spec: CacheSpec
    heads: int  # a multiple of spec.kv_heads
    calls: tuple[tuple[str, int], ...]
    large: bool  # queries and keys scaled by LARGE[dtype]
    seed: int

    def describe(self) -> str:
        calls = ", ".join(f"{kind} {rows}" for kind, rows in self.calls)
        scale = f", queries and keys x{LARGE[self.spec.dtype]:g}" if self.large else ""
        return f"calls [{calls}] with {self.heads} query heads{scale}; built for {self.spec}"

    def summary(self) -> tuple[str, str, str]:
        return self.describe(), "1 cache", str(self.spec.batch)


@st.composite
def attend_plans(draw) -> AttendPlan:
    # float64 and float32 only. In half precision there is no one right answer to hold an
    # attend to: a correct kernel that rounds its scores to bfloat16 lands up to ~120
    # roundings from one that accumulates in float32 (head_dim 256, scores in the
    # hundreds). The logits and reset properties hold a half-precision attend to the
    # model's error budget on their attend path.
    spec = draw(
        kvst.cache_specs(dtypes=kvst.DTYPES, judged=kvst.DTYPES, min_length=2, latent=False),
        label="spec",
    )
    # At most LONG rows: a reference attention over a domain's largest max_length (4096
    # queries over 4096 keys) costs more than the edge is worth (the other properties hit it).
    spec = dataclasses.replace(spec, max_length=min(spec.max_length, kvsizes.LONG))
    spec = draw(with_sinks(spec), label="sinks")
    group = draw(kvsizes.groups(room=3), label="query heads per kv head")
    sizes = draw(kvst.chunk_plans(spec.max_length, min_chunks=1, max_chunks=5), label="calls")
    # The last call attends, so that every plan attends at least once on a warm cache.
    kinds = draw(
        st.lists(st.sampled_from(("attend", "append")), min_size=len(sizes), max_size=len(sizes)),
        label="kinds",
    )
    calls = tuple(zip([*kinds[:-1], "attend"], sizes, strict=True))
    return AttendPlan(
        spec=spec,
        heads=spec.kv_heads * group,
        calls=calls,
        large=draw(st.booleans(), label="large scores"),
        seed=draw(st.integers(0, 2**16), label="seed"),
    )


@st.composite
def with_sinks(draw, spec: CacheSpec) -> CacheSpec:
    """``spec``, or for a window spec of a cache that declares sink counts (contract, 8.5),
    half the time the same with one of them beside its window, at the positions given."""
    counts = [count for count in kvsizes.domain().sink_counts if count]
    if spec.window is None or not counts or not draw(st.booleans(), label="with sinks"):
        return spec
    return dataclasses.replace(spec, sinks=draw(st.sampled_from(counts), label="sink count"))


SINKS_BESIDE_THE_WINDOW = "sinks beside the window"
SINKS_LEFT_BY_THE_WINDOW = "an attend whose window has left the sinks"

ATTEND_EDGES = (
    *(
        reach.Edge(name, needs=("attend",))
        for name in (
            *SPEC_EDGES[:3],
            "grouped query heads",
            "an attend of several rows on a warm cache",
            "an attend after an append",
            "large scores",
        )
    ),
    reach.Edge(SINKS_BESIDE_THE_WINDOW, needs=("attend", "sinks")),
    reach.Edge(SINKS_LEFT_BY_THE_WINDOW, needs=("attend", "sinks")),
)


def note_attend(plan: AttendPlan) -> None:
    """Note which of ``ATTEND_EDGES`` the plan reaches."""
    note_spec(plan.spec)
    kinds = [kind for kind, _ in plan.calls]
    for name, reached in (
        ("grouped query heads", plan.heads > plan.spec.kv_heads),
        (
            "an attend of several rows on a warm cache",
            any(kind == "attend" and rows > 1 for kind, rows in plan.calls[1:]),
        ),
        ("an attend after an append", "append" in kinds[:-1]),  # the last call attends
        ("large scores", plan.large),
        (SINKS_BESIDE_THE_WINDOW, plan.spec.sinks > 0),
        (SINKS_LEFT_BY_THE_WINDOW, plan.spec.sinks > 0 and sinks_left_behind(plan)),
    ):
        if reached:
            reach.note(name)


def sinks_left_behind(plan: AttendPlan) -> bool:
    """Whether some attend's query sits past its window's reach of the last sink: where the
    sinks are seen only as sinks."""
    window, end = plan.spec.window, 0
    for kind, rows in plan.calls:
        end += rows
        if kind == "attend" and end - 1 - window + 1 > plan.spec.sinks:
            return True
    return False


class GivenRows(NamedTuple):
    """One call of a plan's and the rows it gives: new (keys, values) and every row's since
    the reset, these included; ``where`` says which call, at which positions, of which plan."""

    kind: str
    rows: int
    seed: int  # of the keys; the values' is seed + 1, the query's seed + 2
    start: int  # the absolute position of the first new row
    new: tuple[torch.Tensor, torch.Tensor]
    held: tuple[torch.Tensor, torch.Tensor]
    where: str


def given_rows(plan: AttendPlan | LatentAttendPlan, scale: float = 1.0) -> Iterator[GivenRows]:
    """The rows of each of ``plan.calls`` in turn: normal noise from the plan's seed, the keys
    (or rope keys) times ``scale``, the values (or latents) as drawn."""
    spec = plan.spec
    keys, values = (
        kvtensors.random_rows(spec, 0, seed=0),
        kvtensors.random_rows(spec, 0, 0, values=True),
    )
    for index, (kind, rows) in enumerate(plan.calls):
        seed = plan.seed + 10 * index
        key = kvtensors.random_rows(spec, rows, seed=seed)
        if scale != 1.0:  # x 1.0 is x: left out, for dtypes without a product
            key = key * scale
        value = kvtensors.random_rows(spec, rows, seed=seed + 1, values=True)
        start = keys.shape[2]
        keys, values = torch.cat((keys, key), dim=2), torch.cat((values, value), dim=2)
        where = (
            f"call #{index} ({kind} of {rows} rows at absolute positions {start}.."
            f"{start + rows - 1}) of {plan.describe()}"
        )
        yield GivenRows(kind, rows, seed, start, (key, value), (keys, values), where)


def check_attend(factory: CacheFactory, plan: AttendPlan) -> None:
    """Every attend returns the reference attention over the rows given since the reset."""
    spec = plan.spec
    cache = build(factory, spec)
    note_attend(plan)
    scale = LARGE[spec.dtype] if plan.large else 1.0
    for kind, rows, seed, start, (key, value), (keys, values), where in given_rows(plan, scale):
        if kind == "append":
            cache.append(key.clone(), value.clone())
        else:
            shape = (spec.batch, plan.heads, rows, spec.head_dim)
            generator = torch.Generator().manual_seed(seed + 2)
            query = torch.randn(shape, generator=generator, dtype=torch.float64)
            query = query.to(device=spec.device, dtype=spec.dtype)
            query = query * scale
            got = cache.attend(query.clone(), key.clone(), value.clone())
            positions = torch.arange(start + rows, device=spec.device)
            expected = attention(
                query, keys, values, positions[start:], positions, spec.window, sink_end=spec.sinks
            )
            if not isinstance(got, torch.Tensor):
                raise failures.WrongResults(
                    f"attend returned a {type(got).__name__}, not a tensor\n  at {where}"
                )
            if coarser(*storage(cache)) is None:
                kvassert.assert_close_at(
                    got,
                    expected,
                    what="attend's output and the reference attention",
                    where=where,
                    position_axis=2,
                    first_position=start,
                )
            else:  # rows in codes: what their bounds let through the softmax (contract, 10.1)
                assert_attend_within_codes(
                    got, expected, query, keys, values, cache, where=where, first=start
                )
        kvassert.assert_length(cache, start + rows, who="the cache", where=where)


def coded_attend_slack(query, keys, values, cache) -> tuple[torch.Tensor, torch.Tensor]:
    """How far a cache whose rows may be in codes may put each number of its attend output
    (B, H, T, D) from the reference attention over the rows as given, and the value each
    query's output may not leave by more than it (per channel, the values' range widened by
    their bound). A key off by at most delta moves a score by at most e = |q| . delta / sqrt(D),
    so each softmax weight by a factor within exp(+-2E), E the largest e of the query: the
    output moves by at most expm1(2E) x max |v|, plus the values' own bound."""
    keys_declared, values_declared = storage(cache)
    key_bound = kvassert.coded_bound(keys_declared, keys, keys.dtype)
    value_bound = kvassert.coded_bound(values_declared, values, values.dtype)
    group = query.shape[1] // keys.shape[1]

    def per_query_head(rows: torch.Tensor) -> torch.Tensor:
        return rows.repeat_interleave(group, dim=1)

    score_moves = query.double().abs() @ per_query_head(key_bound).transpose(-1, -2)
    largest = score_moves.amax(dim=-1, keepdim=True) / math.sqrt(query.shape[-1])
    most = per_query_head(values.double().abs().amax(dim=2, keepdim=True))
    widest = per_query_head(value_bound.amax(dim=2, keepdim=True))
    slack = torch.expm1(2 * largest) * most + widest
    low = per_query_head(values.double().amin(dim=2, keepdim=True)) - widest
    high = per_query_head(values.double().amax(dim=2, keepdim=True)) + widest
    return slack.nan_to_num(torch.inf), torch.stack((low, high))


def assert_attend_within_codes(
    got, expected, query, keys, values, cache, *, where: str, first: int
) -> None:
    """A coded cache's attend output within the dtype's tolerance plus what its rows' bounds
    let through the softmax (``coded_attend_slack``), and an average of the values it read
    (where large scores leave no finite slack, that is all the codes promise)."""
    slack, (low, high) = coded_attend_slack(query, keys, values, cache)
    tolerance = kvassert.TOLERANCES[expected.dtype]
    allowed = tolerance["atol"] + tolerance["rtol"] * expected.double().abs() + slack
    gap = (got.double() - expected.double()).abs()
    near = tolerance["atol"]
    averaged = (got.double() >= low - near) & (got.double() <= high + near)
    bad = ~((gap <= allowed) & averaged)  # a nan is bad
    if not bad.any():
        return
    b, h, t, d = (int(i) for i in bad.nonzero()[0])
    declared = coarser(*storage(cache))
    raise failures.WrongResults(
        f"attend's output differs from the reference attention beyond what the declared "
        f"{declared.describe()} storage lets through\n  at {where}\n  batch row {b}, head {h}, "
        f"absolute position {first + t}, channel {d}: got {got[b, h, t, d].item():.4g}, the "
        f"reference {expected[b, h, t, d].item():.4g}, |diff| {gap[b, h, t, d].item():.3g} "
        f"against {allowed[b, h, t, d].item():.3g} allowed (the dtype's tolerance + the coded "
        f"rows' bounds through the softmax), and an average of the values must lie within "
        f"[{low[b, h, 0, d].item():.4g}, {high[b, h, 0, d].item():.4g}] "
        f"({int(bad.sum())} numbers beyond)"
    )


# --- Every plan within a scope (kvcheck.scope), for the bounded-exhaustive mode ---
def every_calls(tokens: int, last: str) -> Iterator[tuple[tuple[str, int], ...]]:
    """Every sequence of calls giving ``tokens`` rows in all (``kvcheck.grammar``): calls of
    every size, each an append or an attend of ``last``'s kind, the last one ``last`` (every
    plan attends on a warm cache at least once): 3^(T - 1) of them (sum over the 2^(T-1)
    splits of 2^(calls - 1) kinds)."""

    def moves(ended_by_last: bool, left: int):
        for size in range(1, left + 1):
            for kind in (last, "append"):
                yield ((kind, size),), kind == last, size

    return grammar.sentences(tokens, False, moves, lambda ended_by_last: ended_by_last)


def scope_spec(layout: kvscope.Layout, scope: kvscope.Scope, tokens: int, **fields) -> CacheSpec:
    """The one cache of an attend plan on ``layout``: its batch, kv heads, head width and
    window, built for exactly ``tokens`` rows (2 at least, as the strategy's)."""
    return CacheSpec(
        batch=layout.batch,
        kv_heads=layout.kv_heads,
        head_dim=layout.head_dim,
        max_length=max(2, tokens),
        dtype=scope.dtype,
        device=kvdevices.current(),
        window=layout.window,
        **fields,
    )


def scope_sinks(layout: kvscope.Layout) -> tuple[int, ...]:
    """The sink counts a spec of ``layout`` takes: none, and for a window layout of a cache
    that declares sinks its smallest count beside the window (the larger counts are the
    search's: one sink already shows a sink kept or dropped)."""
    counts = [count for count in kvsizes.domain().sink_counts if count]
    return (0, min(counts)) if layout.window is not None and counts else (0,)


def every_attend_plan(scope: kvscope.Scope) -> Iterator[AttendPlan]:
    """Every plan of calls (``every_calls``) of 1 to ``scope.tokens`` rows in all, on each
    layout's cache (its query heads, kv heads, width, window), each with plain and with large
    scores (``LARGE``): 2 x 3^(T - 1) plans of T rows a layout (twice that for a window layout
    of a cache that declares sinks: with its smallest sink count too). Seed 0; a dtype the
    strategy does not draw (half precision) is left to the search: the scope's float64 here
    is judged by the dtype's tolerance, as every attend."""
    for tokens in range(1, scope.tokens + 1):
        for layout in scope.layouts:
            for sinks in scope_sinks(layout):
                spec = scope_spec(layout, scope, tokens, sinks=sinks)
                for calls in every_calls(tokens, "attend"):
                    for large in (False, True):
                        yield AttendPlan(spec, layout.heads, calls, large, seed=0)


ATTEND = Property(
    "attend",
    "attend returns the reference attention over the rows given: masks, grouped heads, "
    "chunks, large scores",
    check_attend,
    attend_plans(),
    failures.WRONG_RESULTS,
    reaches=ATTEND_EDGES,
    requires=("attend",),
    dtypes=kvst.DTYPES,
    every_plan=every_attend_plan,
    exhaustive_tokens=8,
    since="1.0",
    holds=(
        "every `attend` equals `kvref.attention` over the rows given since the reset, on one cache "
        "without a model: causal and window masks, H a multiple of H_kv, chunks of several queries "
        "on a warm cache, appends and attends mixed, half the plans with queries and keys scaled "
        "(x30 in float64, x8 in float32) until scores pass exp's overflow"
    ),
)


@short_repr
@dataclass(frozen=True)
class LatentAttendPlan:
    """A latent layer's cache spec (contract, section 10.2: rope keys ``head_dim`` wide,
    latents ``value_dim``), the query heads, the no-rope query width the scale is of, and
    calls: ("append" or "attend_latent", T new rows)."""

    spec: CacheSpec
    heads: int
    nope: int
    calls: tuple[tuple[str, int], ...]
    seed: int

    @property
    def scale(self) -> float:
        """The model's: 1/sqrt of the width its scores are defined on (nope + rope)."""
        return 1 / math.sqrt(self.nope + self.spec.head_dim)

    def describe(self) -> str:
        calls = ", ".join(f"{kind} {rows}" for kind, rows in self.calls)
        return (
            f"calls [{calls}] with {self.heads} query heads, scale 1/sqrt({self.nope} + "
            f"{self.spec.head_dim}); built for {self.spec}"
        )

    def summary(self) -> tuple[str, str, str]:
        return self.describe(), "1 cache", str(self.spec.batch)


# The most a latent plan's attention may cost (heads x rows^2 x row width): a 512-wide
# latent keeps to a few dozen rows, a narrow one goes long.
LATENT_ATTEND_BUDGET = 2_000_000


@st.composite
def latent_attend_plans(draw) -> LatentAttendPlan:
    """A latent spec (the declared widths, else narrow ones and DeepSeek's 512 now and
    then), windows and sinks as ``attend`` draws them, 1 to 8 heads, a no-rope width whose
    scale is not one of the widths the cache holds, and appends and attends in any order."""
    spec = draw(
        kvst.cache_specs(dtypes=kvst.DTYPES, judged=kvst.DTYPES, min_length=2, latent=False),
        label="spec",
    )
    value_dim, head_dim = draw(kvst.latent_widths(spec.max_length, spec.head_dim))
    groups = kvsizes.domain().groups or tuple(range(1, 9))
    heads = draw(st.sampled_from(groups), label="query heads")
    width = value_dim + head_dim
    longest = max(2, math.isqrt(LATENT_ATTEND_BUDGET // (heads * width)))
    spec = dataclasses.replace(
        spec,
        kv_heads=1,
        head_dim=head_dim,
        value_dim=value_dim,
        max_length=max(2, min(spec.max_length, kvsizes.LONG, longest)),
    )
    spec = draw(with_sinks(spec), label="sinks")
    # A scale of 1/sqrt(d_c) or 1/sqrt(d_c + d_r), what a cache could derive from what it
    # holds, must not pass by luck.
    nopes = [n for n in (2, 4, 8, 16, 128) if n + head_dim not in (value_dim, width)]
    sizes = draw(kvst.chunk_plans(spec.max_length, min_chunks=1, max_chunks=5), label="calls")
    kinds = draw(
        st.lists(
            st.sampled_from(("attend_latent", "append")), min_size=len(sizes), max_size=len(sizes)
        ),
        label="kinds",
    )
    return LatentAttendPlan(
        spec=spec,
        heads=heads,
        nope=draw(st.sampled_from(nopes), label="nope width"),
        calls=tuple(zip([*kinds[:-1], "attend_latent"], sizes, strict=True)),
        seed=draw(st.integers(0, 2**16), label="seed"),
    )


LATENT_ON_A_WARM_CACHE = "an attend_latent of several rows on a warm cache"
LATENT_AFTER_APPEND = "an attend_latent after an append"
LATENT_WINDOW = "a window latent layer"
LATENT_WIDE = "a 512-wide latent"
LATENT_ATTEND_EDGES = tuple(
    reach.Edge(name, needs=("attend_latent", "latent"))
    for name in (LATENT_ON_A_WARM_CACHE, LATENT_AFTER_APPEND, LATENT_WINDOW, LATENT_WIDE)
)


def note_latent_attend(plan: LatentAttendPlan) -> None:
    """Note which of ``LATENT_ATTEND_EDGES`` the plan reaches."""
    kinds = [kind for kind, _ in plan.calls]
    for name, reached in (
        (
            LATENT_ON_A_WARM_CACHE,
            any(kind == "attend_latent" and rows > 1 for kind, rows in plan.calls[1:]),
        ),
        (LATENT_AFTER_APPEND, "append" in kinds[:-1]),
        (LATENT_WINDOW, plan.spec.window is not None),
        (LATENT_WIDE, plan.spec.value_dim >= 512),
    ):
        if reached:
            reach.note(name)


def check_latent_attend(factory: CacheFactory, plan: LatentAttendPlan) -> None:
    """Every attend_latent returns the reference attention of its query over [latent ; rope
    key] of every row given since the reset, the latents as values, at the scale given."""
    plan = kvdevices.placed(plan)
    spec = plan.spec
    cache = build(factory, spec)
    note_latent_attend(plan)
    for kind, rows, seed, start, (rope, latent), (ropes, latents), where in given_rows(plan):
        if kind == "append":
            cache.append(rope.clone(), latent.clone())
        else:
            query = latent_query(plan, rows, seed + 2)
            got = cache.attend_latent(query.clone(), rope.clone(), latent.clone(), plan.scale)
            if not isinstance(got, torch.Tensor):
                raise failures.WrongResults(
                    f"attend_latent returned a {type(got).__name__}, not a tensor\n  at {where}"
                )
            positions = torch.arange(start + rows, device=spec.device)
            keys = torch.cat((latents, ropes), dim=-1)
            expected = attention(
                query,
                keys,
                latents,
                positions[start:],
                positions,
                spec.window,
                sink_end=spec.sinks,
                scale=plan.scale,
            )
            kvassert.assert_close_at(
                got,
                expected,
                what="attend_latent's weighted latents and the reference attention",
                where=where,
                position_axis=2,
                first_position=start,
            )
        kvassert.assert_length(cache, start + rows, who="the cache", where=where)


def latent_query(plan: LatentAttendPlan, rows: int, seed: int) -> torch.Tensor:
    """An absorbed query: (batch, heads, rows, d_c + d_r) of normal noise from ``seed``."""
    spec = plan.spec
    shape = (spec.batch, plan.heads, rows, spec.value_width + spec.head_dim)
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(shape, generator=generator, dtype=torch.float64)
    return query.to(device=spec.device, dtype=spec.dtype)


def latent_scope_widths() -> tuple[int, int]:
    """The latent layer's widths an enumeration takes (value_dim, rope key width): the
    smallest the cache declares, else a latent of 6 and a rope key of 2 (a latent wider than
    the key, and not a width a scale of 1/sqrt(d_c) could pass by luck with the nope width
    of 2: 1/sqrt(4) is not 1/sqrt(6) nor 1/sqrt(8))."""
    domain = kvsizes.domain()
    rope = min(domain.rope_dims) if domain.rope_dims else 2
    latent = min(domain.latent_dims) if domain.latent_dims else 6
    return latent, rope


def every_latent_attend_plan(scope: kvscope.Scope) -> Iterator[LatentAttendPlan]:
    """Where the cache declares latent layers (``kvst.latent_drawable``; else nothing):
    every plan of calls (``every_calls``, ``attend_latent`` for attend) of 1 to
    ``scope.tokens`` rows in all, on each layout's cache made latent (one kv head, the
    widths of ``latent_scope_widths``, its batch and window; the query heads its groups,
    the one latent head shared by all of them): 3^(T - 1) plans of T rows a layout (twice
    for a window layout of a cache that declares sinks). Fixed: a no-rope width whose
    scale is none the cache could derive from what it holds (the first of the strategy's
    that is not), seed 0."""
    if not kvst.latent_drawable():
        return
    value_dim, head_dim = latent_scope_widths()
    nope = next(
        n for n in (2, 4, 8, 16, 128) if n + head_dim not in (value_dim, value_dim + head_dim)
    )
    for tokens in range(1, scope.tokens + 1):
        for layout in scope.layouts:
            for sinks in scope_sinks(layout):
                spec = scope_spec(layout, scope, tokens, sinks=sinks)
                spec = dataclasses.replace(spec, kv_heads=1, head_dim=head_dim, value_dim=value_dim)
                heads = layout.heads // layout.kv_heads
                for calls in every_calls(tokens, "attend_latent"):
                    yield LatentAttendPlan(spec, heads, nope, calls, seed=0)


# DeepSeek's widths (a 512-wide latent, a 64-wide rope key), pinned: drawn only now and then,
# and a run under one --hypothesis-seed draws the same few plans in every test.
LATENT_WIDE_PINNED = LatentAttendPlan(
    CacheSpec(1, 1, 64, 4, torch.float64, torch.device("cpu"), value_dim=512),
    heads=2,
    nope=128,
    calls=(("append", 2), ("attend_latent", 2)),
    seed=0,
)


LATENT_ATTEND = Property(
    "latent attend",
    "attend_latent returns the reference attention over [latent ; rope key] of the rows "
    "given, the latents as values, at the scale given: masks, heads, chunks",
    check_latent_attend,
    latent_attend_plans(),
    failures.WRONG_RESULTS,
    pinned=(LATENT_WIDE_PINNED,),
    reaches=LATENT_ATTEND_EDGES,
    requires=("attend_latent", "latent"),
    dtypes=kvst.DTYPES,
    since="1.6",
    every_plan=every_latent_attend_plan,
    exhaustive_tokens=8,
    holds=(
        "every `attend_latent` on a latent cache, without a model, equals `kvref.attention` over "
        "[latent ; rope key] of the rows given since the reset, the latents as values, at the scale"
        " given: causal and window masks, heads, chunks of several rows on a warm cache, latents up"
        " to 512 wide (contract, section 10.2; where `attend_latent` is offered and `latent` "
        "declared)"
    ),
)


class AttendTests(KitTests):
    """``attend(query, key, value)``, for caches that compute attention, and
    ``attend_latent`` for latent (MLA) caches that do: each run when offered."""

    test_attend_equals_the_reference_attention = property_test(ATTEND)
    test_latent_attend_equals_the_reference_attention = property_test(LATENT_ATTEND)
