"""Isolation: caches from one factory share no rows.

Two caches A and B from one factory are given distinct rows in turns; after every call each
returns (on the attend path, attends over) only its own rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from hypothesis import strategies as st

from kvcheck import asserts as kvassert
from kvcheck import failures, reach
from kvcheck import scope as kvscope
from kvcheck import strategies as kvst
from kvcheck import tensors as kvtensors
from kvcheck.harness import (
    SPEC_EDGES,
    assert_served,
    assert_views_kept,
    give,
    note_spec,
    recorded,
    spec_on_path,
)
from kvcheck.kit import KitTests, Property, property_test
from kvcheck.properties.rejection import layer_specs, warm_ups
from kvcheck.strategies import cache_specs, chunk_plans
from kvref import CacheFactory, CacheSpec
from kvref.reprs import short_repr


@short_repr
@dataclass(frozen=True)
class IsolationPlan:
    """Two caches from one factory, A and B, given the chunks of their plans in turns (A, B,
    A, B, ...), then one more row each, to read both back."""

    spec: CacheSpec
    chunks: tuple[tuple[int, ...], tuple[int, ...]]

    def describe(self) -> str:
        a, b = (list(plan) for plan in self.chunks)
        return f"caches A and B from one factory, appends A {a} and B {b} in turns; {self.spec}"

    def summary(self) -> tuple[str, str, str]:
        return self.describe(), "2 caches", str(self.spec.batch)


@st.composite
def isolation_plans(draw) -> IsolationPlan:
    spec = draw(cache_specs(min_length=2), label="spec")
    # Room for one more row in each, to read both back at the end.
    a = draw(chunk_plans(spec.max_length - 1), label="plan A")
    b = draw(chunk_plans(spec.max_length - 1), label="plan B")
    return IsolationPlan(spec, (tuple(a), tuple(b)))


def every_isolation_plan(scope: kvscope.Scope) -> Iterator[IsolationPlan]:
    """Every ``IsolationPlan`` within ``scope``, fewest tokens first, then by spec
    (``rejection.layer_specs``), then by shape: A's and B's a and b rows (each >= 0) in every
    split into appends (none for 0 rows), max_length max(a, b) + 1 (the last row each is
    given). The tokens are a + b + 2: both plans and the row each cache is given last.

    A and B are not renamed into one another: A is built first and goes first in every
    turn, so a cache whose storage is shared by creation order tells them apart. Per spec,
    the plans of m = a + b + 2 tokens number 1 for m = 2 and (k + 3) x 2^(k - 2) for
    k = m - 2 >= 1 (c(0) c(k) + ... + c(k) c(0), c(0) = 1, c(w) = 2^(w-1)): 1, 2, 5, 12,
    28, 64, 144 for m = 2..8."""
    specs = layer_specs(scope)
    for total in range(2, scope.tokens + 1):
        for fields in specs:
            rows = total - 2
            for a_rows in range(rows + 1):
                spec = CacheSpec(max_length=max(a_rows, rows - a_rows) + 1, **fields)
                for a in warm_ups(a_rows):
                    for b in warm_ups(rows - a_rows):
                        yield IsolationPlan(spec, (a, b))


def check_isolation(factory: CacheFactory, plan: IsolationPlan, *, path: str = "append") -> None:
    """Two caches from one factory, given distinct rows in turns, each return only their own."""
    spec = spec_on_path(plan.spec, path)
    caches = {"A": recorded(factory, spec, path), "B": recorded(factory, spec, path)}
    note_spec(spec)
    # Each plan's appends in turns, then one more row for each cache, once both plans are
    # done, to read both back after every append of the other.
    steps = max(map(len, plan.chunks))
    turns = [[*chunks, *[0] * (steps - len(chunks)), 1] for chunks in plan.chunks]
    for step in range(steps + 1):
        for which, ((name, cache), sizes) in enumerate(zip(caches.items(), turns, strict=True)):
            if not sizes[step]:
                continue
            new = kvtensors.random_rows(spec, sizes[step], seed=1000 * which + step)
            give(cache, new, kvtensors.as_values(spec, new, 3), seed=step)
            where = f"{cache.path} #{step} of cache {name}: {plan.describe()}"
            kvassert.assert_length(cache, cache.given_length, who=f"cache {name}", where=where)
            assert_served(cache, who=f"cache {name}", where=where)
            others = {f"cache {other}": cache for other, cache in caches.items() if other != name}
            assert_views_kept(others, where=where)


ISOLATION = Property(
    "isolation",
    "two caches from one factory never return each other's rows",
    check_isolation,
    isolation_plans(),
    failures.DATA_LOSS,
    reaches=tuple(reach.Edge(name) for name in SPEC_EDGES),
    paths=True,
    attend_dtypes=kvst.DTYPES,  # attend's output judged at the dtype's tolerance
    every_plan=every_isolation_plan,
    exhaustive_tokens=12,
    since="1.0",
    holds=("two caches from one factory, appended in turns, never return each other's rows"),
)


class IsolationTests(KitTests):
    """Caches from one factory share no rows."""

    test_caches_from_one_factory_share_no_storage = property_test(ISOLATION)
