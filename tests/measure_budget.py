"""Measure the half-precision error budget (``kvcheck.asserts.BUDGETS``) on correct caches
and on a cache that stores float16 as bfloat16: the numbers behind docs/half-precision.md.

    python -m tests.measure_budget [--seeds 10] [--examples 20] [--device cpu] [--path attend]

For every built-in and independent cache, and every seed, the logits property's scenarios
are drawn in bfloat16 and float16; at each new position of each step it records how far
the cached logits are from the float64 model, against how far the uncached run in the same
dtype is: their ratio, and the excess in roundings (the unit roundoff times the largest
|float64 logit| there, at least 1). A correct cache must stay inside the budget at every
position; the narrow-storage mutant must leave it in most scenarios. With ``--path attend``
the same on the attend path (the model calling the cache's own ``attend``), for every
correct cache that offers one.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from hypothesis import HealthCheck, given, seed, settings

import kvimpl
from kvcheck import asserts as kvassert
from kvcheck import devices as kvdevices
from kvcheck import strategies as kvst
from kvcheck.kit import offered
from kvcheck.properties.core import run
from tests.independent.deque_window_cache import DequeWindowCache
from tests.independent.fifo_paged_pool import FifoPagedPool
from tests.independent.list_cache import ListCache
from tests.independent.paged_cache import PagedCache
from tests.independent.pooled_ring_cache import RingCache
from tests.independent.sdpa_cache import SdpaCache
from tests.independent.slot_cache import SlotCache
from tests.independent.stacked_cache import StackedCache
from tests.independent.view_cache import ViewCache
from tests.mutants.caches import StoresFloat16AsBfloat16

CORRECT = {
    **kvimpl.CACHES,
    **{cache.__name__: cache for cache in (DequeWindowCache, ListCache, PagedCache, RingCache)},
    **{cache.__name__: cache for cache in (SlotCache, StackedCache, ViewCache, SdpaCache)},
    "FifoPagedPool": FifoPagedPool(),
}


def measure(factory, dtypes, seeds: int, examples: int, path: str = "append") -> list[dict]:
    """One row per position: dtype, scenario, the ratio, the excess in roundings, and
    whether the budget holds there."""
    rows: list[dict] = []
    drawn = [0]

    def record(scenario: kvst.Scenario) -> None:
        drawn[0] += 1
        for step in run(factory, scenario, path):
            ref = step.reference_logits
            budgets = kvassert.budgets_for(step.request.caches)  # the kit's, on this path
            bad, cached, _ = kvassert.over_budget(
                step.logits, step.expected_logits, ref, 1, budgets=budgets
            )
            uncached = kvassert.position_errors(step.expected_logits, ref, 1)
            scale = ref.double().abs().amax(dim=(0, 2)).clamp_min(1)
            rounding = torch.finfo(scenario.dtype).eps / 2 * scale
            for index in range(bad.numel()):
                rows.append(
                    {
                        "dtype": scenario.dtype,
                        "scenario": drawn[0],
                        "ratio": (cached[index] / uncached[index]).item(),
                        "excess": ((cached[index] - uncached[index]) / rounding[index]).item(),
                        "over": bool(bad[index]),
                    }
                )

    for number in range(seeds):
        search = given(scenario=kvst.scenarios(dtypes=dtypes))(record)
        quiet = settings(
            max_examples=examples,
            database=None,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        )
        seed(number)(quiet(search))()
    return rows


def quantiles(values: list[float]) -> str:
    ordered = sorted(value for value in values if value == value)  # 0 / 0 is no evidence
    if not ordered:
        return "-"
    at = [ordered[min(len(ordered) - 1, int(q * len(ordered)))] for q in (0.5, 0.99, 0.999)]
    return f"p50 {at[0]:.3g}, p99 {at[1]:.3g}, p99.9 {at[2]:.3g}, max {ordered[-1]:.3g}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--examples", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--path", choices=("append", "attend"), default="append")
    args = parser.parse_args(argv)
    kvdevices.choose(args.device)
    torch.set_num_threads(1)
    budgets = kvassert.ATTEND_BUDGETS if args.path == "attend" else kvassert.BUDGETS
    for dtype, budget in budgets.items():  # a cache's own attend: ATTEND_BUDGETS, as the kit
        print(f"{dtype}: budget {budget.describe(dtype)}")
    by_dtype = defaultdict(list)
    for name, factory in CORRECT.items():
        if args.path == "attend" and "attend" not in offered(factory):
            continue
        rows = measure(factory, kvst.HALF_DTYPES, args.seeds, args.examples, args.path)
        over = sum(row["over"] for row in rows)
        print(f"{name}: {len(rows)} positions, {over} over the budget; cached / uncached error: ")
        print(f"  {quantiles([row['ratio'] for row in rows])}")
        for row in rows:
            by_dtype[row["dtype"]].append(row)
    for dtype, rows in by_dtype.items():
        print(f"correct caches, {dtype}, {len(rows)} positions:")
        print(f"  cached / uncached error: {quantiles([row['ratio'] for row in rows])}")
        print(f"  excess, in roundings:    {quantiles([row['excess'] for row in rows])}")
    if args.path == "attend":
        return
    rows = measure(StoresFloat16AsBfloat16, (torch.float16,), args.seeds, args.examples)
    scenarios = {row["scenario"] for row in rows}
    caught = {row["scenario"] for row in rows if row["over"]}
    print(
        f"StoresFloat16AsBfloat16, float16: over the budget in {len(caught)} of "
        f"{len(scenarios)} scenarios; cached / uncached error: "
        f"{quantiles([row['ratio'] for row in rows])}"
    )


if __name__ == "__main__":
    main()
