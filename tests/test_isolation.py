"""Nothing leaks between caches or across a reset: two caches from one factory share no
storage, and rows written before reset(), even nan, inf or huge ones, never come back."""

from hypothesis import given
from hypothesis import strategies as st

from tests import checks as kvchk
from tests import scenarios as kvst

NAMES = ("A", "B")


@given(data=st.data())
def test_caches_from_one_factory_share_no_storage(cache_factory, data):
    spec = data.draw(kvst.cache_specs(min_length=2), label="spec")
    # Room for one more row in each, to read both back at the end.
    plans = [data.draw(kvst.chunk_plans(spec.max_length - 1), label=f"plan {n}") for n in NAMES]
    caches = [kvchk.WatchedCache(cache_factory(spec)) for _ in NAMES]
    steps = max(map(len, plans))
    # Interleave the appends, A, B, A, B, ..., with distinct rows for each, then append one
    # more row to each: every rows any cache returns must be its own.
    for step in range(steps + 1):
        for which, (cache, plan) in enumerate(zip(caches, plans, strict=True)):
            rows = plan[step] if step < len(plan) else 1 if step == steps else 0
            if rows:
                new = kvst.random_rows(spec, rows, seed=1000 * which + step)
                cache.append(new, new * 3)
                at = (
                    f"\n  in cache {NAMES[which]} of two from one factory, step {step} of plans "
                    f"{dict(zip(NAMES, plans, strict=True))}; spec {spec}"
                )
                assert cache.length == cache.held_length, (
                    f"cache {NAMES[which]} holds {cache.length} tokens, was given "
                    f"{cache.held_length}{at}"
                )
                kvchk.assert_returned_what_is_held(cache, layer=which, at=at)


@given(data=st.data())
def test_rows_from_before_a_reset_never_come_back(cache_factory, data):
    spec = data.draw(kvst.cache_specs(), label="spec")
    poison = data.draw(st.sampled_from(sorted(kvst.POISON_VALUES)), label="poison")
    how = data.draw(st.sampled_from(["reset", "fresh cache"]), label="how")
    before = data.draw(kvst.chunk_plans(spec.max_length, min_chunks=1), label="poisoned plan")
    after = data.draw(kvst.chunk_plans(spec.max_length, min_chunks=1), label="clean plan")
    cache = kvchk.WatchedCache(cache_factory(spec))
    for rows in before:
        bad = kvst.random_rows(spec, rows, seed=rows).fill_(kvst.POISON_VALUES[poison])
        cache.append(bad, bad.clone())
    if how == "reset":
        cache.reset()
    else:
        cache = kvchk.WatchedCache(cache_factory(spec))
    for step, rows in enumerate(after):
        clean = kvst.random_rows(spec, rows, seed=step)
        cache.append(clean, clean * 2)
        at = (
            f"\n  at step {step} after a {how} that followed {before} rows of {poison}; spec {spec}"
        )
        kvchk.assert_returned_what_is_held(cache, layer=0, at=at)
