"""The bounded-exhaustive mode (kvcheck.exhaustive, kvcheck.scope): its enumerations count
what they claim against closed forms, its blocks cover every plan once, and a run of it says
"every plan holds" only where every block ran and held, names the first failing plan
otherwise, resumes what an earlier run held and writes its scope to the JSON report."""

from __future__ import annotations

import itertools
import json
import math

import pytest

import kvimpl
from kvcheck import exhaustive
from kvcheck import scope as kvscope
from kvcheck import sizes as kvsizes
from kvcheck.properties import ALL
from kvcheck.properties.core import LOGITS, every_session
from kvcheck.scope import LAYOUTS, Scope
from kvimpl.latent import LatentCache
from kvref import CacheContractError
from tests.mutants.small_scope import SMALL_SCOPE_MUTANTS
from tests.pytest_run import run_in_process


@pytest.mark.parametrize("n", [*range(1, 8), pytest.param(8, marks=pytest.mark.soak)])
def test_compositions_are_every_split_once(n):
    splits = list(kvscope.compositions(n))
    assert len(splits) == 2 ** (n - 1) == len(set(splits))
    assert all(sum(chunks) == n and min(chunks) >= 1 for chunks in splits)
    # Against a count made another way: every tuple of positive sizes summing to n.
    brute = {
        chunks
        for k in range(1, n + 1)
        for chunks in itertools.product(range(1, n + 1), repeat=k)
        if sum(chunks) == n
    }
    assert set(splits) == brute


def test_splits_run_fewest_tokens_first():
    splits = list(kvscope.splits(6))
    assert len(splits) == 2**6 - 1
    assert [sum(chunks) for chunks in splits] == sorted(sum(chunks) for chunks in splits)
    assert len(list(kvscope.splits(6, least=3))) == 2**6 - 2**2


@pytest.mark.parametrize("counts", [(0,), (3,), (1, 1), (2, 3), (1, 2, 2)])
def test_orders_are_every_interleaving_once(counts):
    orders = list(kvscope.orders(counts))
    multinomial = math.factorial(sum(counts)) // math.prod(map(math.factorial, counts))
    assert len(orders) == multinomial == len(set(orders))
    assert all(order.count(i) == c for order in orders for i, c in enumerate(counts))


def test_first_use_order_keeps_one_naming_per_class():
    # Sequences of n labels from {0, 1, 2}: one kept per class under renaming the labels,
    # so as many as there are partitions of n steps into at most 3 labelled-by-use blocks
    # (Stirling numbers of the second kind, S(n, 1) + S(n, 2) + S(n, 3)).
    n = 5
    every = list(itertools.product(range(3), repeat=n))
    kept = [s for s in every if kvscope.first_use_order(s)]
    assert len(kept) == 1 + 15 + 25
    # Exactly one per class: each kept one is its class's renaming, and every class has one.
    assert all(canonical(s) == s for s in kept)
    assert {canonical(s) for s in every} == set(kept)


def canonical(labels):
    names: dict[int, int] = {}
    return tuple(names.setdefault(label, len(names)) for label in labels)


def test_every_session_counts_every_split_on_every_model():
    for tokens in (1, 3, 6):
        scope = Scope(tokens)
        plans = list(every_session(scope))
        assert len(plans) == len(LAYOUTS) * (2**tokens - 1) == len(set(plans))
        totals = [plan.sessions[0].length for plan in plans]
        assert totals == sorted(totals), "plans do not run fewest tokens first"
        assert {plan.dtype for plan in plans} == {scope.dtype}


def test_a_scope_moves_its_models_inside_the_declared_domain():
    from kvcheck import sizes as kvsizes

    declared = kvsizes.Sizes(
        supports=kvsizes.Domain(head_dims=(4, 8), kv_heads=(1,), windows=False)
    )
    with kvsizes.aiming_at(declared):
        scope = Scope.within_domain(4)
    assert all(layout.head_dim == 4 and layout.kv_heads == 1 for layout in scope.layouts)
    assert all(layout.window is None for layout in scope.layouts)
    assert len(scope.layouts) == len(set(scope.layouts)), "a model enumerated twice"


@pytest.mark.parametrize("value", ["0", "-3", "many", 2.5, True])
def test_a_bad_setting_is_refused_with_the_reason(value):
    with pytest.raises(ValueError, match="neither a positive number of tokens nor 'auto'"):
        exhaustive.parse(value)
    assert exhaustive.parse("auto") == "auto"
    assert exhaustive.parse("8") == 8


def test_blocks_cover_every_plan_once_and_sort_as_the_plans_do():
    scope = Scope(6)
    blocks = exhaustive.blocks(LOGITS, scope)
    total = len(LAYOUTS) * (2**6 - 1)
    assert [(b.first, b.stop) for b in blocks] == [
        (first, min(first + exhaustive.BLOCK, total)) for first in range(0, total, exhaustive.BLOCK)
    ]
    assert sorted(blocks, key=str) == blocks, "test ids would not sort as the plans do"
    assert all(block.count == len(blocks) for block in blocks)


def test_every_enumerating_property_has_plans_within_a_small_scope():
    """Every property that enumerates yields plans of its own within 4 tokens, distinct, in
    the domain of the first built-in cache that offers it (a latent layer's plans exist only
    for a cache that declares latent layers, such as LatentCache)."""
    for prop in ALL:
        if prop.every_plan is None:
            continue
        candidates = [*kvimpl.CACHES.values(), LatentCache]
        offered = [f for f in candidates if not offered_nowhere(prop, f)]
        assert offered, f"{prop.name}: no built-in cache offers it"
        with kvsizes.aiming_at(kvsizes.declared_by(offered[0])):
            plans = list(prop.every_plan(Scope.within_domain(4, prop.dtypes)))
        assert plans, f"{prop.name}: no plan within 4 tokens"
        assert len(set(map(repr, plans))) == len(plans), f"{prop.name}: a plan enumerated twice"


def offered_nowhere(prop, factory) -> bool:
    with kvsizes.aiming_at(kvsizes.declared_by(factory)):
        return prop.not_offered(factory) is not None


CLASS = """
from kvcheck import CacheTests
from {module} import {name}


class TestIt(CacheTests):
    factory = {name}
"""


def write_class(pytester, module: str, name: str) -> None:
    (pytester.path / "test_it.py").write_text(CLASS.format(module=module, name=name))


def test_a_correct_cache_holds_every_plan_and_the_verdict_says_so(pytester):
    write_class(pytester, "kvimpl", "ConcatCache")
    report = pytester.path / "report.json"
    result = run_in_process(
        pytester,
        "--kv-property",
        "logits",
        "--kv-property",
        "lengths",
        "--kv-exhaustive",
        "3",
        "--kv-report",
        str(report),
    )
    assert result.returncode == 0, result.stdout
    plans = len(LAYOUTS) * (2**3 - 1)
    assert f"every plan holds: logits {plans}, lengths {plans}" in result.stdout, result.stdout
    assert "kv exhaustive: every plan to 3 tokens" in result.stdout
    cache = json.loads(report.read_text())["caches"]["ConcatCache"]
    assert cache["scope"]["models"] == [layout.describe() for layout in LAYOUTS]
    row = cache["properties"]["logits"]["exhaustive"]
    assert (row["tokens"], row["plans"], row["runs held"]) == (3, plans, plans), row
    assert row["complete"], row
    assert row["blocks run"] == row["blocks"] == 1


def test_the_first_failing_plan_is_named_and_rerun_as_a_pinned_example(pytester):
    write_class(pytester, "tests.mutants.caches", "OffByOneWrite")
    result = run_in_process(pytester, "-k", "logits_match", "--kv-exhaustive", "4")
    assert result.returncode == 1
    out = result.stdout
    assert "FAIL         logits [wrong results]" in out, out
    # Rerun through Hypothesis: it reports the call that failed, the plan as its argument
    # (drawn=...), under a heading each of its versions words its own way.
    assert "drawn=Scenario(" in out, "not rerun through Hypothesis"
    # The first failing plan of the first block: every plan before it held.
    assert "the first of its block (#1-50) to" in out, out
    assert "every plan holds" not in out


def test_a_run_with_blocks_left_out_is_not_called_exhaustive(pytester):
    write_class(pytester, "kvimpl", "ConcatCache")
    second = "test_it.py::TestIt::test_logits_match_uncached[ConcatCache-exhaustive 51-60 of 60]"
    result = run_in_process(
        pytester, "-k", "logits_match", "--deselect", second, "--kv-exhaustive", "4"
    )
    assert result.returncode == 0, result.stdout
    assert "partly run   logits: 1 of 2 blocks" in result.stdout, result.stdout
    assert "every plan holds: logits" not in result.stdout


def test_a_resumed_run_passes_over_what_an_earlier_run_held(pytester):
    write_class(pytester, "kvimpl", "ConcatCache")
    args = ("-p", "cacheprovider", "--kv-property", "logits", "--kv-exhaustive", "3")
    first = run_in_process(pytester, *args, "--kv-exhaustive-resume")
    assert first.returncode == 0, first.stdout
    assert "runs resumed" not in first.stdout
    again = run_in_process(pytester, *args, "--kv-exhaustive-resume")
    plans = len(LAYOUTS) * (2**3 - 1)
    assert f"logits {plans}, {plans} runs resumed" in again.stdout, again.stdout
    # Another cache's code is not the one that held them: it runs every plan.
    write_class(pytester, "kvimpl", "PreallocatedCache")
    other = run_in_process(pytester, *args, "--kv-exhaustive-resume")
    assert "runs resumed" not in other.stdout, other.stdout


def test_resume_without_the_mode_is_a_usage_error(pytester):
    write_class(pytester, "kvimpl", "ConcatCache")
    result = run_in_process(pytester, "--kv-exhaustive-resume")
    assert result.returncode == 4
    assert "the run is not exhaustive" in result.stdout + result.stderr


def test_a_class_can_ask_for_the_mode_itself(pytester):
    (pytester.path / "test_it.py").write_text(
        CLASS.format(module="kvimpl", name="ConcatCache") + "    exhaustive = 2\n"
    )
    result = run_in_process(pytester, "--kv-property", "logits")
    assert "every plan holds: logits 12" in result.stdout, result.stdout


# The small-scope mutants (tests/mutants/small_scope.py): each a bug whose trigger is a
# conjunction of small exact sizes, and the plan of the logits property's enumeration that
# first shows it (docs/exhaustive-power.md measures what the ci search makes of them).
SMALL_SCOPE_FIRST_PLANS = {
    "DecodeTailGoesStale": 71,
    "MqaDecodePositionFromPrompt": 34,
    "TailFastPathAtBoundary": 32,
    "RingGrowsInPlace": 120,
}


@pytest.mark.parametrize("mutant", SMALL_SCOPE_MUTANTS, ids=lambda m: m.__name__)
def test_a_small_scope_mutant_fails_a_plan_of_the_logits_enumeration(mutant):
    """Every plan before the one on record holds; that one fails: the enumeration reaches
    the conjunction, and in the order it claims (fewest tokens first, layout by layout)."""
    first = SMALL_SCOPE_FIRST_PLANS[mutant.__name__]
    plans = itertools.islice(LOGITS.every_plan(Scope(8)), first)
    with kvsizes.aiming_at(kvsizes.declared_by(mutant)):
        for index, plan in enumerate(plans, start=1):
            if index < first:
                LOGITS.check_all_cases(mutant, plan)
            else:  # a failure, or the model's guard on what the cache returned
                with pytest.raises((AssertionError, CacheContractError)):
                    LOGITS.check_all_cases(mutant, plan)


def test_a_property_with_cases_run_block_by_block_is_complete(pytester):
    # Its blocks sit mid-id ([ConcatCache-exhaustive 1-n of n-wrong batch]): one test a case.
    write_class(pytester, "kvimpl", "ConcatCache")
    result = run_in_process(pytester, "--kv-property", "bad append", "--kv-exhaustive", "2")
    assert result.returncode == 0, result.stdout
    assert "partly run" not in result.stdout, result.stdout
    assert "every plan holds: bad append" in result.stdout, result.stdout
