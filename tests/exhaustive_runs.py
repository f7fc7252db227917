"""A property's enumeration run as the exhaustive mode runs it, for the tests of the
enumerations (tests/test_exhaustive*.py): every plan to N tokens, on every path the cache
offers and every case of a table, inside the cache's declared sizes, on one torch thread
and in the property's context (the sharded runtime's processes)."""

from __future__ import annotations

from contextlib import nullcontext

import pytest

from kvcheck import profiles as kvprofiles
from kvcheck import sizes as kvsizes
from kvcheck.kit import kit_paths
from kvcheck.scope import Scope
from kvref import CacheContractError
from tests.mutants import MUTANTS

MUTANT = {mutant.name: mutant for mutant in MUTANTS}


def by_property(cases) -> dict:
    """``pytest.mark.parametrize``'s values and ids for rows that begin with a property."""
    return {"argvalues": cases, "ids": [prop.name for prop, *_ in cases]}


def run_every(prop, factory, tokens: int) -> int:
    """Every plan of ``prop`` to ``tokens`` tokens on ``factory``, every case and path; the
    runs made (none would prove nothing: the property must be offered), a plan that calls
    what the cache does not offer left out."""
    runs = 0
    context = prop.context(factory) if prop.context else nullcontext()
    sizes = kvsizes.aiming_at(kvsizes.declared_by(factory))
    with context, sizes, kvprofiles.torch_threads():
        assert prop.not_offered(factory) is None, f"{factory} does not offer {prop.name}"
        for plan in prop.every_plan(Scope.within_domain(tokens)):
            for path in kit_paths(prop, factory):
                for case in prop.cases or [None]:
                    try:
                        prop.run(factory, plan, case, path)
                    except kvsizes.OutsideDomain:
                        continue  # counted apart by the mode, as here: not a run
                    runs += 1
    return runs


def assert_caught(prop, name: str, tokens: int) -> None:
    """The catalogue's mutant ``name`` fails a plan of ``prop`` to ``tokens`` tokens: a
    failure or the model's guard, never a refusal to run it ("not offered")."""
    mutant = MUTANT[name]
    with pytest.raises((AssertionError, CacheContractError)) as caught, mutant.patch():
        run_every(prop, mutant.factory, tokens)
    assert "does not offer" not in str(caught.value), caught.value
