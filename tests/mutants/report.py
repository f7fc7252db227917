"""Print the README's table of mutants: ``python -m tests.mutants.report``.

For each mutant: the first property (in ``kvcheck.properties.ALL``'s order) that catches it,
the counterexample Hypothesis shrinks that failure to, and which of the other properties
catch it too. The search is derandomized, so the table is the same on every run.
"""

from __future__ import annotations

from hypothesis import settings

from kvcheck import requests as kvreq
from kvcheck.attend import AttendPlan
from kvcheck.exhaustion import ExhaustionPlan
from kvcheck.properties import ALL as PROPERTIES
from kvcheck.strategies import (
    CachePlan,
    EditPlan,
    IsolationPlan,
    ModelPlan,
    StaleRowsPlan,
    describe_step,
)
from tests import mutants as kvmut
from tests.mutants.hunt import hunt, search

EXAMPLES_PER_PROPERTY = 20  # as tests/test_mutants.py

settings.register_profile("mutant-report", derandomize=True, deadline=None, database=None)

HEADER = (
    "| mutant | the bug | caught first by | shrunk counterexample: tokens (chunks per session) "
    "| layers | batch | also caught by |\n|---|---|---|---|---|---|---|"
)


def row(mutant: kvmut.Mutant) -> str:
    # The search alone first, for the smallest counterexample; pinned inputs when it fails.
    catch = hunt(mutant, PROPERTIES, max_examples=EXAMPLES_PER_PROPERTY, shrink=True, pinned=False)
    catch = catch or hunt(mutant, PROPERTIES, max_examples=EXAMPLES_PER_PROPERTY)
    if catch is None:
        return f"| `{mutant.name}` | {mutant.bug} | **not caught** | | | | |"
    with mutant.patch():
        others = [
            prop.name
            for prop in PROPERTIES
            if prop.name != catch.property
            and prop.strategy is not None
            and not (prop.requires and prop.not_offered(mutant.factory))
            and search(mutant.factory, prop, max_examples=EXAMPLES_PER_PROPERTY) is not None
        ]
    caught_by = f"{catch.property} (model guard)" if catch.by_model_guard else catch.property
    sizes = " | ".join(size(catch.example))
    return (
        f"| `{mutant.name}` | {mutant.bug} | {caught_by} | {sizes} | {', '.join(others) or '-'} |"
    )


def size(example: object) -> tuple[str, str, str]:
    """Tokens (with the plan), layers and batch of a counterexample."""
    if isinstance(example, kvreq.RequestPlan):
        fed = sum(event.size for event in example.events if isinstance(event, kvreq.Feed))
        events = "; ".join(event.describe() for event in example.events)
        batches = {event.batch for event in example.events if isinstance(event, kvreq.Start)}
        return f"{fed} ({events})", str(example.config.num_layers), "/".join(map(str, batches))
    if isinstance(example, AttendPlan | ExhaustionPlan):
        return example.describe(), "1 cache", str(example.spec.batch)
    if isinstance(example, EditPlan):
        steps = ", ".join(describe_step(step) for step in example.steps)
        plan = f"{example.max_length} (prompt {example.prompt}; {steps})"
        return plan, str(example.config.num_layers), str(example.batch)
    if isinstance(example, IsolationPlan | StaleRowsPlan):
        return (
            example.describe(),
            "2 caches" if isinstance(example, IsolationPlan) else "1 cache",
            str(example.spec.batch),
        )
    if isinstance(example, CachePlan):
        appends = "+".join(map(str, example.chunks)) or "none"
        return f"{sum(example.chunks)} (appends {appends})", "1 cache", str(example.spec.batch)
    if isinstance(example, ModelPlan):
        chunks = "+".join(map(str, example.chunks))
        return (
            f"{sum(example.chunks)} ({chunks})",
            str(example.config.num_layers),
            str(example.batch),
        )
    plans = "; ".join(
        f"{session.start} {'+'.join(map(str, session.chunks))}" for session in example.sessions
    )
    tokens = sum(session.length for session in example.sessions)
    return f"{tokens} ({plans})", str(example.config.num_layers), str(example.batch)


def main() -> None:
    settings.load_profile("mutant-report")
    print(HEADER)
    for mutant in kvmut.MUTANTS:
        print(row(mutant), flush=True)


if __name__ == "__main__":
    main()
