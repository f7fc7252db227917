"""Memory: ``nbytes`` never claims less than the keys and values held; under a declared
lossy storage (contract, section 10.1), never more than the tensors the cache holds either:
a compressed cache's savings are what it claims, so a count of the full-precision size
(quanto's quantized tensors report theirs) would hide that nothing was saved."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

from kvcheck import failures, reach
from kvcheck import scope as kvscope
from kvcheck import strategies as kvst
from kvcheck import tensors as kvtensors
from kvcheck.harness import SPEC_EDGES, note_spec, recorded, rows_written
from kvcheck.kit import KitTests, Property, property_test
from kvcheck.properties.rejection import every_cache_plan
from kvref import CacheFactory, min_nbytes
from kvref.memory import held_nbytes


def check_nbytes(factory: CacheFactory, plan: kvst.CachePlan) -> None:
    """nbytes is an int, never below B x H_kv x L x (D + the value width) x itemsize (the
    packed size of the rows that may be in codes, under a declared lossy storage, and then
    never above what the cache's tensors take), at every step of the plan, filled to
    max_length, and after a reset."""
    spec, cache = plan.spec, recorded(factory, plan.spec)
    note_spec(spec)
    for step, rows in enumerate([*plan.chunks, "fill", "reset"]):
        if rows == "reset":
            cache.reset()
        else:
            # Last, the rest of max_length: a cache that preallocates is then full.
            rows = spec.max_length - cache.length if rows == "fill" else rows
            if not rows:
                continue
            new = kvtensors.rows_of_kind(rows_written(plan, cache), spec, rows, seed=step)
            cache.append(new, kvtensors.as_values(spec, new))
        nbytes = cache.nbytes
        needed = min_nbytes(spec, cache.length, cache.storage, tuple(cache.quantized_below))
        where = f"step {step} of {plan.describe()}"
        if isinstance(nbytes, bool) or not isinstance(nbytes, int):
            raise failures.WrongResults(
                f"the cache: nbytes must be an int, got {type(nbytes).__name__}\n  at {where}"
            )
        if nbytes < needed:
            rows = spec.rows_needed(cache.length)
            width = (
                f"{spec.head_dim}"
                if spec.value_dim is None
                else f"({spec.head_dim} + {spec.value_dim})"
            )
            formula = f"{spec.batch} x {spec.kv_heads} x {rows} rows x {width} x itemsize"
            if spec.value_dim is None:
                formula = "2 x " + formula
            if any(cache.storage):
                formula = (
                    f"the rows as given, and those that may be in codes at the declared "
                    f"{declared(cache)} (packed codes and 2-byte scales)"
                )
            raise failures.WrongResults(
                f"the cache: nbytes is {nbytes} while holding {cache.length} tokens, which take "
                f"at least {needed} bytes ({formula})\n  at {where}"
            )
        held = held_nbytes(cache.cache) if any(cache.storage) else None
        if held is None and any(cache.storage):  # not checked: say so, not "pass" in silence
            warnings.warn(
                f"memory: the upper bound on the nbytes of {type(cache.cache).__name__} was not "
                f"checked: it holds an object the kit cannot see into (contract, section 10.1)",
                stacklevel=2,
            )
        if held is not None and nbytes > held:
            raise failures.WrongResults(
                f"the cache: nbytes is {nbytes}, but the tensors reachable from it (its "
                f"attributes, their collections, bound methods and partials, each storage once, "
                f"whole) take {held} bytes: under the declared {declared(cache)}, nbytes counts "
                f"what its codes and scales take, not the rows' full-precision size (a cache "
                f"whose rows lie where its attributes do not lead, a module-level arena say, "
                f"cannot be measured: keep a reference to them on the cache)\n  at {where}"
            )


def declared(cache) -> str:
    """The recorded cache's declared storage, each kind once: "int8 per token, ..."."""
    return "; ".join(dict.fromkeys(part.describe() for part in cache.storage if part))


def every_memory_plan(scope: kvscope.Scope) -> Iterator[kvst.CachePlan]:
    """``rejection.every_cache_plan`` with room 0 and at least one append: every split of
    L rows into appends on a cache built for max_length L (full at the last), then the
    reset; 2^(L-1) plans of L tokens per spec. A cache with more room needs none of its
    own: the check fills the rest of max_length by one more append, which is the plan
    warmed by that append too."""
    return every_cache_plan(scope, room=0, min_chunks=1)


MEMORY = Property(
    "memory",
    "nbytes is never below 2 x B x H_kv x L x D x itemsize",
    check_nbytes,
    # Half the specs with real heads: under codes, a saving shows only where codes are
    # narrower than the rows they stand for (on heads of 2, the scales outweigh the codes).
    kvst.cache_plans(room=0, min_chunks=1, wide_one_in=2),
    failures.WRONG_RESULTS,
    reaches=tuple(reach.Edge(name) for name in SPEC_EDGES),
    every_plan=every_memory_plan,
    exhaustive_tokens=12,
    since="1.0",
    holds=(
        "`nbytes` is never below 2 x B x H_kv x L x D x itemsize (`kvref.min_nbytes`; under a "
        "declared lossy storage, the packed size of the rows that may be in codes, and then never "
        "above what the cache's tensors take, `kvref.held_nbytes`), at every step, filled to "
        "`max_length` and after a reset"
    ),
)


class MemoryTests(KitTests):
    """``nbytes`` never claims less than the keys and values held."""

    test_nbytes_never_less_than_what_is_held = property_test(MEMORY)
