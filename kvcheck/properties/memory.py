"""Memory: ``nbytes`` never claims less than the keys and values held."""

from __future__ import annotations

from kvcheck import failures
from kvcheck import strategies as kvst
from kvcheck.harness import recorded
from kvcheck.kit import KitTests, Property, property_test
from kvref import CacheFactory, min_nbytes


def check_nbytes(factory: CacheFactory, plan: kvst.CachePlan) -> None:
    """nbytes is an int, never below 2 x B x H_kv x L x D x itemsize, at every step of the
    plan and after a reset."""
    spec, cache = plan.spec, recorded(factory, plan.spec)
    for step, rows in enumerate([*plan.chunks, "reset"]):
        if rows == "reset":
            cache.reset()
        else:
            new = kvst.random_rows(spec, rows, seed=step)
            cache.append(new, kvst.as_values(spec, new))
        nbytes = cache.nbytes
        needed = min_nbytes(spec, cache.length, cache.storage, tuple(cache.quantized_below))
        where = f"step {step} of {plan.describe()}"
        if isinstance(nbytes, bool) or not isinstance(nbytes, int):
            raise failures.WrongResults(
                f"the cache: nbytes must be an int, got {type(nbytes).__name__}\n  at {where}"
            )
        if nbytes < needed:
            formula = (
                f"2 x {spec.batch} x {spec.kv_heads} x {cache.length} x {spec.head_dim} x itemsize"
            )
            if any(cache.storage):
                formula = (
                    f"the rows as given, and those that may be in codes at the declared "
                    f"{'; '.join(part.describe() for part in cache.storage if part)} (packed "
                    f"codes and 2-byte scales)"
                )
            raise failures.WrongResults(
                f"the cache: nbytes is {nbytes} while holding {cache.length} tokens, which take "
                f"at least {needed} bytes ({formula})\n  at {where}"
            )


MEMORY = Property(
    "memory",
    "nbytes is never below 2 x B x H_kv x L x D x itemsize",
    check_nbytes,
    kvst.cache_plans(room=0, min_chunks=1),
    failures.WRONG_RESULTS,
)


class MemoryTests(KitTests):
    """``nbytes`` never claims less than the keys and values held."""

    test_nbytes_never_less_than_what_is_held = property_test(MEMORY)
