"""Print the README's table of mutants: ``python -m tests.mutants.report``.

For each mutant: the first property (in the hunt's order, ``tests.mutants.hunt.HUNT_ORDER``)
that catches it,
the counterexample Hypothesis shrinks that failure to, and which of the other properties
catch it too. The search is derandomized, so the table is the same on every run.
"""

from __future__ import annotations

from hypothesis import settings

from tests import mutants as kvmut
from tests.mutants.hunt import HUNT_ORDER as PROPERTIES
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
    sizes = " | ".join(catch.example.summary())  # tokens (the plan), layers, batch
    return (
        f"| `{mutant.name}` | {mutant.bug} | {caught_by} | {sizes} | {', '.join(others) or '-'} |"
    )


def main() -> None:
    settings.load_profile("mutant-report")
    print(HEADER)
    for mutant in kvmut.MUTANTS:
        print(row(mutant), flush=True)


if __name__ == "__main__":
    main()
