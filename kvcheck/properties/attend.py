"""``attend(query, key, value)`` against ``kvref.attention``: no model, one cache, many calls.

A plan warms a cache with appends and attend calls in any order, each of T rows, and every
attend must return what the reference attention computes over every row given since the
reset (the reference masks by absolute position, so a cache that keeps only a window gives
the same answer): causal and window masks, grouped-query heads (H a multiple of H_kv), a
chunk of several queries on a warm cache. Some plans scale queries and keys up until the
scores pass exp's overflow (709 in float64, 88 in float32): a softmax that forgets to
subtract its running maximum returns inf or nan there, where the reference does not.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from kvcheck import asserts as kvassert
from kvcheck import failures, reach
from kvcheck import sizes as kvsizes
from kvcheck import strategies as kvst
from kvcheck.harness import SPEC_EDGES, build, note_spec
from kvcheck.kit import KitTests, Property, property_test
from kvref import CacheFactory, CacheSpec, attention

# Queries and keys times this make scores of some hundreds, past exp's overflow in each
# dtype, while the dot products keep enough precision for the dtype's tolerance.
LARGE = {torch.float64: 30.0, torch.float32: 8.0}


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


ATTEND_EDGES = tuple(
    reach.Edge(name, needs=("attend",))
    for name in (
        *SPEC_EDGES[:3],
        "grouped query heads",
        "an attend of several rows on a warm cache",
        "an attend after an append",
        "large scores",
    )
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
    ):
        if reached:
            reach.note(name)


def check_attend(factory: CacheFactory, plan: AttendPlan) -> None:
    """Every attend returns the reference attention over the rows given since the reset."""
    spec = plan.spec
    cache = build(factory, spec)
    note_attend(plan)
    scale = LARGE[spec.dtype] if plan.large else 1.0
    keys, values = kvst.random_rows(spec, 0, seed=0), kvst.random_rows(spec, 0, 0, values=True)
    for index, (kind, rows) in enumerate(plan.calls):
        seed = plan.seed + 10 * index
        key = kvst.random_rows(spec, rows, seed=seed) * scale
        value = kvst.random_rows(spec, rows, seed=seed + 1, values=True)
        start = keys.shape[2]
        keys, values = torch.cat((keys, key), dim=2), torch.cat((values, value), dim=2)
        where = (
            f"call #{index} ({kind} of {rows} rows at absolute positions {start}.."
            f"{start + rows - 1}) of {plan.describe()}"
        )
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
            expected = attention(query, keys, values, positions[start:], positions, spec.window)
            if not isinstance(got, torch.Tensor):
                raise failures.WrongResults(
                    f"attend returned a {type(got).__name__}, not a tensor\n  at {where}"
                )
            kvassert.assert_close_at(
                got,
                expected,
                what="attend's output and the reference attention",
                where=where,
                position_axis=2,
                first_position=start,
            )
        kvassert.assert_length(cache, start + rows, who="the cache", where=where)


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
)


class AttendTests(KitTests):
    """``attend(query, key, value)``, for caches that compute attention: run when offered."""

    test_attend_equals_the_reference_attention = property_test(ATTEND)
