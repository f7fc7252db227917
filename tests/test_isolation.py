"""Nothing leaks between caches or across a reset: two caches from one factory share no
storage, and rows written before reset(), even nan, inf or huge ones, never come back."""

from hypothesis import given
from hypothesis import strategies as st

from tests import checks as kvchk
from tests import scenarios as kvst


@given(data=st.data())
def test_caches_from_one_factory_share_no_storage(cache_factory, data):
    spec = data.draw(kvst.cache_specs(), label="spec")
    plans = [data.draw(kvst.chunk_plans(spec.max_length), label=f"plan {i}") for i in (0, 1)]
    caches = [kvchk.WatchedCache(cache_factory(spec)), kvchk.WatchedCache(cache_factory(spec))]
    # Interleave the two caches' appends: A, B, A, B, ... with distinct rows for each.
    for step in range(max(map(len, plans))):
        for which, (cache, plan) in enumerate(zip(caches, plans, strict=True)):
            if step < len(plan):
                rows = kvst.random_rows(spec, plan[step], seed=1000 * which + step)
                cache.append(rows, rows * 3)
                at = f"\n  at cache {'AB'[which]}, step {step}; plans {plans}, spec {spec}"
                kvchk.assert_returned_what_is_held(cache, layer=which, at=at)
    for which, cache in enumerate(caches):
        assert cache.length == cache.held_length, (
            f"cache {'AB'[which]} holds {cache.length} tokens after the other cache's appends; "
            f"it was given {cache.held_length}; plans {plans}, spec {spec}"
        )


@given(data=st.data())
def test_rows_from_before_a_reset_never_come_back(cache_factory, data):
    spec = data.draw(kvst.cache_specs(), label="spec")
    poison = data.draw(st.sampled_from(sorted(kvchk.POISON_VALUES)), label="poison")
    how = data.draw(st.sampled_from(["reset", "fresh cache"]), label="how")
    before = data.draw(kvst.chunk_plans(spec.max_length, min_chunks=1), label="poisoned plan")
    after = data.draw(kvst.chunk_plans(spec.max_length, min_chunks=1), label="clean plan")
    cache = kvchk.WatchedCache(cache_factory(spec))
    for rows in before:
        bad = kvst.random_rows(spec, rows, seed=rows).fill_(kvchk.POISON_VALUES[poison])
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
