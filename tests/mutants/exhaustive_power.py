"""What the exhaustive mode adds over the ci profile's search, measured on the catalogue.

    CI=true python -m tests.mutants.exhaustive_power [--tokens 8] [--jobs 2] [--cap 120]
        [--property-cap 10]
        [--write docs/exhaustive-power.md]

For each mutant (``tests.mutants.MUTANTS``, then the small-scope mutants of
``tests/mutants/small_scope.py``): the first property, in the hunt's order with
the property that caught it last first (``FIRST_CATCHES``), one of whose plans up to
``--tokens`` tokens (``Property.every_plan``, every case of its table) fails, and which plan
(its index: every plan before it held); then whether that property's ci search (the hunt's:
its pinned inputs, 20 derandomized examples, no shrinking) finds the mutant too; for a
small-scope mutant, whether the whole ci hunt (every property) does. A mutant
the scope finds nowhere (each property's plans walked for ``--property-cap`` seconds at most,
the mutant's for ``--cap``) is "not caught to N tokens": what lies
beyond the scope (long sessions, half precision, page edges past N tokens) or beyond the
enumerated properties. Run it with ``CI`` set: the ci profile (no deadline) is what the ci
search is measured under.
"""

from __future__ import annotations

import argparse
import multiprocessing
import time
from collections import Counter
from datetime import date
from pathlib import Path

import torch

from kvcheck import sizes as kvsizes
from kvcheck.failures import OutsideDomain
from kvcheck.scope import Scope
from kvref import CacheContractError
from tests import mutants as kvmut
from tests.mutants.hunt import (
    EXAMPLES_PER_PROPERTY,
    FIRST_CATCHES,
    HUNT_ORDER,
    Crashed,
    hunt_as_tested,
    search,
)
from tests.mutants.small_scope import SMALL_SCOPE_MUTANTS


def first_failing_plan(mutant: kvmut.Mutant, prop, tokens: int, deadline: float):
    """The index (from 1) of the first plan of ``prop`` to ``tokens`` tokens that the mutant
    fails, or None; "cap" past ``deadline``; ("crash", why) where a plan raised neither a
    failure nor a guard. The plans are walked as they are enumerated, never listed: some
    properties have millions at 8 tokens, and a mutant is mostly caught in the first few."""
    plans = prop.every_plan(Scope.within_domain(tokens, prop.dtypes))
    for index, plan in enumerate(plans, start=1):
        if time.monotonic() > deadline:
            return "cap"
        try:
            prop.check_all_cases(mutant.factory, plan)
        except OutsideDomain:
            continue
        except (AssertionError, CacheContractError):
            return index
        except Exception as error:
            return "crash", f"{type(error).__name__}: {error}".splitlines()[0][:100]
    return None


def measure(args: tuple[int, int, float, float]) -> dict:
    index, tokens, cap, property_cap = args
    torch.set_num_threads(1)
    mutant = CATALOGUE[index]
    first = FIRST_CATCHES.get(mutant.name)
    order = sorted(
        (prop for prop in HUNT_ORDER if prop.every_plan is not None),
        key=lambda prop: prop.name != first,
    )
    small = index >= len(kvmut.MUTANTS)
    row = {"mutant": mutant.name, "small scope": small, "caught by": None, "ci": None}
    row["stopped"] = []  # the properties whose plans ran past property_cap, none failing
    deadline = time.monotonic() + cap
    start = time.monotonic()
    with mutant.patch(), kvsizes.aiming_at(kvsizes.declared_by(mutant.factory)):
        for prop in order:
            if prop.not_offered(mutant.factory):
                continue
            if time.monotonic() > deadline:
                row["caught by"] = "cap"
                break
            ends = min(deadline, time.monotonic() + property_cap)
            found = first_failing_plan(mutant, prop, tokens, ends)
            if found == "cap":
                row["stopped"].append(prop.name)
                continue
            if found is None:
                continue
            if isinstance(found, tuple):
                row.update({"crash": f"{prop.name}: {found[1]}"})
                continue
            row.update({"caught by": prop.name, "plan": found})
            try:
                catch = search(mutant.factory, prop, max_examples=EXAMPLES_PER_PROPERTY)
            except Crashed:
                catch = None
            row["ci"] = catch is not None
            break
    row["seconds"] = round(time.monotonic() - start, 1)
    if small:  # not in the catalogue: does the whole ci hunt, every property, miss it too?
        try:
            row["ci hunt"] = (catch := hunt_as_tested(mutant)) and catch.property
        except Crashed as crash:
            row["ci hunt"] = f"a crash ({str(crash)[:80]})"
    return row


# The catalogue, then the small-scope mutants (tests/mutants/small_scope.py: bugs whose
# trigger is a conjunction of small exact sizes), which the ci hunt is not held to catch.
CATALOGUE = (*kvmut.MUTANTS, *(kvmut.Mutant(factory) for factory in SMALL_SCOPE_MUTANTS))


def render(rows: list[dict], tokens: int, cap: float, property_cap: float) -> str:
    catalogue = [row for row in rows if not row["small scope"]]
    small = [row for row in rows if row["small scope"]]
    caught = [row for row in catalogue if row["caught by"] not in (None, "cap")]
    beyond_ci = [row for row in caught if not row["ci"]]
    capped = [row for row in catalogue if row["caught by"] == "cap"]
    missed = [row for row in catalogue if row["caught by"] is None]
    by = Counter(row["caught by"] for row in caught)
    lines = [
        f"<!-- Generated by `CI=true python -m tests.mutants.exhaustive_power --tokens {tokens} "
        f"--cap {cap:g} --property-cap {property_cap:g} --write docs/exhaustive-power.md` on "
        f"{date.today()}: do not edit by hand. -->",
        "",
        f"# What the exhaustive mode adds, measured on the catalogue (N = {tokens})",
        "",
        f"Of the catalogue's {len(catalogue)} mutants, **{len(caught)} fall to the exhaustive "
        f"mode to {tokens} tokens alone** (no random search: the first property, in the hunt's "
        "order with the one that caught it last first, one of whose plans fails). For "
        f"**{len(beyond_ci)}** of them that property's ci search (its pinned inputs and 20 "
        "derandomized examples) misses the mutant: the exhaustive mode adds that property's "
        f"catch. {len(missed)} are not caught to {tokens} tokens: their bugs lie beyond the "
        "scope (longer sessions, half precision, the properties it searches), or past the "
        f"plans of a property that {property_cap:g} s reached (a property's plans are walked "
        f"for {property_cap:g} s a mutant at most, fewest tokens first: the properties so "
        f"stopped are named); {len(capped)} were stopped at the cap of {cap:g} s a mutant.",
        "",
        "Caught by property: " + ", ".join(f"{name} {n}" for name, n in by.most_common()) + ".",
        "",
    ]
    if small:
        lines += [
            "## The small-scope mutants",
            "",
            "Bugs whose trigger is a conjunction of small exact sizes "
            "(`tests/mutants/small_scope.py`), outside the catalogue: the ci hunt (every "
            "property's pinned inputs and 20 derandomized examples) against the exhaustive "
            "mode.",
            "",
            "| mutant | caught to N tokens by | first failing plan | that property's ci search "
            "| the whole ci hunt |",
            "|---|---|---|---|---|",
            *(
                f"| {row['mutant']} | {_caught(row, cap)} | {_plan(row)} | {_ci(row)} "
                f"| {_hunt(row)} |"
                for row in small
            ),
            "",
        ]
    lines += [
        "## The catalogue",
        "",
        "| mutant | caught to N tokens by | first failing plan | the property's ci search |",
        "|---|---|---|---|",
    ]
    for row in catalogue:
        lines.append(f"| {row['mutant']} | {_caught(row, cap)} | {_plan(row)} | {_ci(row)} |")
    return "\n".join([*lines, ""])


def _caught(row: dict, cap: float) -> str:
    crash = f" (a crash: {row['crash']})" if "crash" in row else ""
    if row["stopped"] and row["caught by"] in (None, "cap"):
        crash += f" (walked in part: {', '.join(row['stopped'])})"
    if row["caught by"] is None:
        return f"not caught{crash}"
    if row["caught by"] == "cap":
        return f"stopped at {cap:g} s{crash}"
    return row["caught by"]


def _plan(row: dict) -> str:
    return f"#{row['plan']:,}" if "plan" in row else ""


def _ci(row: dict) -> str:
    return "" if row["ci"] is None else "catches it" if row["ci"] else "**misses it**"


def _hunt(row: dict) -> str:
    return f"caught by {row['ci hunt']}" if row.get("ci hunt") else "**misses it**"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--cap", type=float, default=120.0, help="seconds per mutant at most")
    parser.add_argument(
        "--property-cap", type=float, default=10.0, help="seconds per property and mutant"
    )
    parser.add_argument("--only", nargs="*", default=None, help="these mutants alone")
    parser.add_argument("--write", type=Path, default=None)
    args = parser.parse_args(argv)
    indices = [i for i, m in enumerate(CATALOGUE) if not args.only or m.name in args.only]
    work = [(i, args.tokens, args.cap, args.property_cap) for i in indices]
    with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
        rows = []
        for row in pool.imap(measure, work):
            print(row, flush=True)
            rows.append(row)
    text = render(rows, args.tokens, args.cap, args.property_cap)
    if args.write:
        args.write.write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
