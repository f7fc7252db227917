"""Hand-picked scenarios at the edges (buffers filled exactly, chunks that start, end and
straddle chunk boundaries, resets after nan and inf), run on every cache with every core
check. Plain tests, not @example: a search that finds a bug shrinks it, and these still run."""

import pytest

from tests import checks as kvchk
from tests import scenarios as kvst

CHECKS = (kvchk.check_logits_match_uncached, kvchk.check_lengths, kvchk.check_contents)


@pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.__name__)
@pytest.mark.parametrize(
    "scenario",
    [kvst.BOUNDARIES, kvst.POISONED_RESET],
    ids=["boundaries", "poisoned_reset"],
)
def test_pinned_edge(cache_factory, scenario, check):
    check(cache_factory, scenario)
