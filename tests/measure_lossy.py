"""Measure the lossy storage budget (``kvcheck.asserts.LOSSY_FACTOR``) on correct quantized
caches and on broken ones: the figures of docs/quantized.md, which this script writes.

    python -m tests.measure_lossy [--seeds 5] [--examples 20] > docs/quantized.md

For each cache and seed, the logits property's scenarios are drawn in every dtype; at each
new position of each step it records how far the cached logits are from the uncached model's
(from the float64 model's in half precision) beyond the dtype's own tolerance or budget, as
a multiple of the declared step (``Quantized.relative_step``) x max(1, the largest |logit|
there): the factor that position would need. A correct cache must need less than
``LOSSY_FACTOR`` everywhere; a broken one should need more in most scenarios.
"""

from __future__ import annotations

import argparse

import torch
from hypothesis import HealthCheck, given, seed, settings

from kvcheck import asserts as kvassert
from kvcheck import strategies as kvst
from kvcheck.properties.core import run
from kvimpl.quantized import QuantizedCache
from tests.independent.fp8_segment_cache import Fp8SegmentCache
from tests.independent.group_int4_cache import GroupInt4Cache
from tests.independent.kivi_group_cache import KiviGroupCache
from tests.mutants.quantized import (
    AnotherRowsScale,
    Fp8CastUnclamped,
    KeysScaledPerToken,
    ScaleIgnoredOnRead,
    ScaleRedrawnPerFlush,
)

CORRECT = (QuantizedCache, GroupInt4Cache, Fp8SegmentCache, KiviGroupCache)
BROKEN = (
    ScaleIgnoredOnRead,
    AnotherRowsScale,
    KeysScaledPerToken,
    ScaleRedrawnPerFlush,
    Fp8CastUnclamped,
)


def needed(factory, seeds: int, examples: int) -> list[tuple[int, float]]:
    """(scenario, factor needed) at every new position of every step."""
    found: list[tuple[int, float]] = []
    drawn = [0]

    def record(scenario: kvst.Scenario) -> None:
        drawn[0] += 1
        for step in run(factory, scenario):
            lossy = kvassert.coarsest(step.request.caches)
            error, base, scale = kvassert.allowed_errors(
                step.logits, step.expected_logits, step.reference_logits, axis=1
            )
            share = (error - base).clamp_min(0) / (lossy.relative_step * scale)
            share = share.nan_to_num(nan=torch.inf)  # a nan logit needs any factor at all
            found.extend((drawn[0], value) for value in share.tolist())

    for number in range(seeds):
        search = given(scenario=kvst.scenarios())(record)
        quiet = settings(
            max_examples=examples, database=None, deadline=None,
            suppress_health_check=list(HealthCheck),
        )  # fmt: skip
        seed(number)(quiet(search))()
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--examples", type=int, default=20)
    parser.add_argument("--only", nargs="*", help="measure only the caches of these names")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print("# Quantized storage: the logits budget, measured\n")
    print(
        "Written by `python -m tests.measure_lossy "
        f"--seeds {args.seeds} --examples {args.examples}`: the logits property's scenarios "
        "(every dtype), the factor each new position needs beyond the dtype's own tolerance "
        "or budget, in declared steps x max(1, the largest |logit| there). The kit allows "
        f"`LOSSY_FACTOR` = {kvassert.LOSSY_FACTOR:g} (docs/contract.md, section 10.1).\n\n"
        "This budget is the loose one: every row a cache returns is also held to its "
        "declaration's own bound, exactly (`kvcheck.asserts.rows_not_held`), and that check "
        "catches every broken cache below on its own; the two KIVI-style ones "
        "(`KeysScaledPerToken`, `ScaleRedrawnPerFlush`) only by it, their 2-bit keys' step "
        "being coarse enough that the logits stay within the budget. The tail of the correct "
        "caches comes from models with a residual 2 wide, where half a step of the codes can "
        "flip a key's sign. Every dtype is drawn, half precision among them.\n"
    )
    print("| cache | scenarios | positions | median | p99 | max | scenarios over the budget |")
    print("|---|---|---|---|---|---|---|")
    for factory in (*CORRECT, *BROKEN):
        if args.only and factory.__name__ not in args.only:
            continue
        found = needed(factory, args.seeds, args.examples)
        values = sorted(value for _, value in found)
        over = {number for number, value in found if not value <= kvassert.LOSSY_FACTOR}
        scenarios = len({number for number, _ in found})
        at = [values[min(len(values) - 1, int(q * len(values)))] for q in (0.5, 0.99)]
        print(
            f"| {factory.__name__} | {scenarios} | {len(values)} | {at[0]:.3g} | {at[1]:.3g} | "
            f"{values[-1]:.3g} | {len(over)} |"
        )


if __name__ == "__main__":
    main()
