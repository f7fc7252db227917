"""Interactions (kvcheck.interplay, the ``interactions`` property): the pairs a cache offers
follow from its capabilities, the covering walks run every one of them by construction, the
session engine notes the pair each event completes in any property's plan, and the verdict
counts them."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvcheck import failures, interplay, reach
from kvcheck import tensors as kvtensors
from kvcheck.properties.interactions import check_every_offered_pair, pairs_offered, run_walk
from kvcheck.session import Engine
from kvimpl import ConcatCache
from kvimpl.preallocated import PreallocatedCache
from kvref import CacheContractError, ModelConfig, check_append, check_truncate
from tests import depth
from tests import interplay as bugs
from tests.pytest_run import run_in_process

# The capabilities the batch's events need, and the methods rows of their own's need.
CAPABILITIES = sorted(kind.needs for kind in interplay.KINDS if kind.needs and not kind.rows)
ROW_METHODS = sorted(kind.needs for kind in interplay.KINDS if kind.rows)
SUBSETS = [
    set(combo)
    for r in range(len(CAPABILITIES) + 1)
    for combo in itertools.combinations(CAPABILITIES, r)
]


# On pages of 16, none of the seven capabilities, each alone, all but one and all (every
# set under --soak: the walks' search treats kinds alike, so a pair no walk reaches shows
# with few kinds or with nearly all); on the pages whose states sit closest (2 and 3 rows)
# and a wide one, none, each alone and all of them.
WALK_CASES = [
    (offered, 16)
    for offered in SUBSETS
    if depth.SOAK or not 2 <= len(offered) <= len(CAPABILITIES) - 2
] + [
    (offered, page)
    for page in (3, 2, 128)
    for offered in (set(), *({name} for name in CAPABILITIES), set(CAPABILITIES))
]


@pytest.mark.parametrize(
    ("offered", "page"),
    WALK_CASES,
    ids=[f"{'+'.join(sorted(offered)) or 'none'}-{page}" for offered, page in WALK_CASES],
)
def test_the_walks_run_every_offered_pair_and_only_pairs_a_cache_can_run(offered, page):
    most = 2 * page + 5
    walks = interplay.covering_walks(offered, most, page)
    ran = {pair for walk in walks for pair in interplay.pairs_of(walk)}
    assert ran == set(interplay.offered_pairs(offered)), sorted(
        set(interplay.offered_pairs(offered)) ^ ran
    )
    for walk in walks:
        assert 1 < len(walk) <= 24, walk
        held = 0
        for step in walk:  # each step runs where it may, and leaves the state it says
            kind = interplay.BY_NAME[step.kind]
            assert interplay.state_of(held, most, page) in kind.runs_in, (walk, step)
            assert step.state == interplay.state_of(step.length, most, page), step
            held = step.length


# On pages of 16 and three rows, rows fed alone and with each method (every set of them
# under --soak); all of them on the pages whose states sit closest (2 and 3 rows) and a
# wide one, on three, two and one rows (each on each under --soak).
OTHER_ROW_METHODS = sorted(set(ROW_METHODS) - {"append_rows"})
ROW_CASES = [
    ({"append_rows", *combo}, 16, 3)
    for r in range(len(ROW_METHODS))
    for combo in itertools.combinations(OTHER_ROW_METHODS, r)
    if depth.SOAK or r in (0, 1)
] + [
    (set(ROW_METHODS), page, batch)
    for page in (2, 3, 16, 128)
    for batch in (1, 2, 3)
    if depth.SOAK or (page, batch) in ((2, 3), (3, 2), (128, 1))
]


@pytest.mark.parametrize(
    ("offered", "page", "batch"),
    ROW_CASES,
    ids=[f"{'+'.join(sorted(offered))}-{page}-{batch}" for offered, page, batch in ROW_CASES],
)
def test_the_walks_on_rows_of_their_own_run_every_offered_pair_where_they_may(offered, page, batch):
    most = 2 * page + 5
    walks = interplay.covering_walks(offered, most, page, batch=batch)
    ran = {pair for walk in walks for pair in interplay.pairs_of(walk)}
    assert ran == set(interplay.offered_pairs(offered, batch)), sorted(
        set(interplay.offered_pairs(offered, batch)) ^ ran
    )
    for walk in [walk for walk in walks if walk[0].rows is not None]:
        assert 1 < len(walk) <= 24, walk
        rows = (0,) * batch
        for step in walk:  # each step runs where it may, and leaves the lengths it says
            kind = interplay.BY_NAME[step.kind]
            assert kind.rows, (walk, step)
            assert interplay.rows_state(rows, most) in kind.runs_in, (walk, step)
            assert step.state == interplay.rows_state(step.rows, most), step
            assert max(step.rows) <= most, step
            assert 1 <= len(step.rows) <= batch, step
            if step.kind == "feed rows":  # every row fed 0 or more, one at least
                assert all(a >= b for a, b in zip(step.rows, rows, strict=True)), step
                assert step.rows != rows, step
            elif step.kind == "truncate rows":
                assert all(a <= b for a, b in zip(step.rows, rows, strict=True)), step
            elif step.kind == "select rows":  # the rows kept, each with its length
                assert step.rows == tuple(rows[b] for b in step.order), step
                assert len(set(step.order)) == len(step.order), step
            elif step.kind == "join":  # one row joins, where one left
                assert step.rows[:-1] == rows, step
                assert len(rows) < batch, step
            elif step.kind == "shift rows":  # each row's span inside it, one token at least
                spans = zip(step.starts, rows, step.rows, strict=True)
                assert all(0 <= start <= after for start, _, after in spans), step
                assert all(a <= b for a, b in zip(step.rows, rows, strict=True)), step
                assert step.rows != rows, step
            elif step.kind == "reset rows":  # on the rows the caches were built for (8.3)
                assert len(rows) == batch, step
                assert not any(step.rows), step
            rows = step.rows


def test_rows_of_their_own_make_pairs_of_their_own_and_never_with_the_batch_s():
    every = set(CAPABILITIES) | set(ROW_METHODS)
    assert [len(interplay.offered_pairs(every, batch)) for batch in (1, 2, 3)] == [292, 345, 353]
    rows = interplay.offered_pairs(set(ROW_METHODS))
    assert len(rows) == 123
    assert "select rows → [apart] → join" in rows
    assert not any(
        pair.endswith("→ join") for pair in interplay.offered_pairs({"append_rows", "join"})
    )
    assert not any("rows" in pair for pair in interplay.offered_pairs(every - {"append_rows"}))
    batch_kinds = {kind.name for kind in interplay.KINDS if not kind.rows}
    for pair in interplay.offered_pairs(every):  # a walk keeps to one vocabulary
        first, _, then = interplay.split(pair)
        assert (first in batch_kinds) == (then in batch_kinds), pair
    assert ("reset rows → [empty] → join", interplay.NEVER_AFTER[("reset rows", "join")]) in (
        interplay.ruled_out()
    )


def test_a_cache_with_no_capability_offers_the_pairs_of_feeds_and_resets():
    assert len(interplay.offered_pairs(set())) == 22
    # 130 before shift joined: 17 pairs begin with it (empty: a prefill; warm and page edge:
    # every kind but a prefill) and 20 end with it (every pair before it that leaves tokens).
    # Then a tree: 18 begin with it (warm and page edge: every kind but a prefill) and 16 end
    # with it (every pair before it that leaves warm or page edge caches). Then a move: 27
    # begin with it (warm, page edge, full: every kind that runs there) and 27 end with it,
    # 3 of them both.
    assert len(interplay.offered_pairs(set(CAPABILITIES))) == 252
    assert "truncate → [page edge] → decode" in interplay.offered_pairs({"truncate"})
    assert not any("truncate" in pair for pair in interplay.offered_pairs(set()))


def test_every_pair_ruled_out_says_why_and_none_is_offered():
    every = set(interplay.offered_pairs(set(CAPABILITIES)))
    for pair, why in interplay.ruled_out():
        assert why, pair
        assert pair not in every, pair


def small_engine(factory, max_length: int, layers: int) -> tuple[Engine, ModelConfig]:
    """An engine over a float64 model of ``layers`` layers of one kv head of width 4, and its
    config."""
    config = ModelConfig(vocab_size=11, num_layers=layers, num_heads=2, num_kv_heads=1, head_dim=4)
    model = kvtensors.build_model(config, torch.float64)
    return Engine(factory, model, max_length=max_length), config


def row_tokens(config: ModelConfig, *counts: int) -> list[torch.Tensor]:
    """A row's tokens for each of ``counts``, each row's its own (its count the seed)."""
    return [kvtensors.random_tokens(config, 1, count, count)[0] for count in counts]


def pairs_in(noted) -> set[str]:
    """The pairs of events among the names ``reach`` noted."""
    prefix = interplay.PREFIX
    return {name.removeprefix(prefix) for name in noted if name.startswith(prefix)}


def test_the_engine_notes_the_pair_each_event_completes():
    engine, config = small_engine(ConcatCache, max_length=37, layers=1)
    request = engine.start("r0", 1)
    with reach.collecting() as noted:
        engine.feed(request, kvtensors.random_tokens(config, 1, 20, 1))
        engine.truncate(request, 16)
        engine.feed(request, kvtensors.random_tokens(config, 1, 1, 2))
        engine.reset(request)
        engine.feed(request, kvtensors.random_tokens(config, 1, 3, 3))
    pairs = pairs_in(noted)
    assert pairs == {
        "prefill → [warm] → truncate",
        "truncate → [page edge] → decode",
        "decode → [warm] → reset",
        "reset → [empty] → prefill",
    }, pairs


def test_the_engine_notes_the_pairs_of_rows_of_their_own():
    engine, config = small_engine(PreallocatedCache, max_length=37, layers=1)
    request = engine.start("r0", 3)

    with reach.collecting() as noted:
        engine.feed_rows(request, row_tokens(config, 3, 2, 5))
        engine.truncate_rows(request, [3, 2, 3])
        engine.select_rows(request, [2, 0])
        joining = engine.start("r1", 1)
        engine.feed_rows(joining, row_tokens(config, 37))
        engine.join(request, joining)
        engine.shift_rows(request, [1, 0, 0], [1, 0, 0])
        engine.reset_at(request, [5, 0, 9])
        engine.feed_rows(request, row_tokens(config, 2, 2, 2))
    pairs = pairs_in(noted)
    assert pairs == {
        "feed rows → [apart] → truncate rows",
        "truncate rows → [apart] → select rows",
        "select rows → [even] → join",
        "join → [a row full] → shift rows",
        "shift rows → [a row full] → reset rows",
        "reset rows → [empty] → feed rows",
    }, pairs
    engine.finish()


def test_rows_shifted_then_selected_joined_truncated_and_shifted_again_hold_on_a_correct_cache():
    # The books of keys a shift per row re-rotated follow each row through a selection, a
    # join and a rollback: a walk of caches built for 21 tokens shifted a row that had joined
    # after a shift, and the recorder's books had no entry for it (an IndexError in the kit).
    engine, config = small_engine(PreallocatedCache, max_length=21, layers=2)
    request = engine.start("r0", 3)

    engine.feed_rows(request, row_tokens(config, 6, 4, 9))
    engine.select_rows(request, [2])
    engine.shift_rows(request, [2], [3])  # one row, shifted
    for name in ("r1", "r2"):  # two requests join it
        joining = engine.start(name, 1)
        engine.feed_rows(joining, row_tokens(config, 5))
        engine.join(request, joining)
    engine.truncate_rows(request, [5, 4, 5])
    engine.shift_rows(request, [0, 1, 2], [1, 1, 1])  # the joined rows shifted too
    engine.select_rows(request, [2, 0, 1])
    engine.feed_rows(request, row_tokens(config, 1, 1, 1))
    engine.finish()


def test_after_a_shift_every_event_is_followed_and_noted_on_a_correct_cache():
    # The oracle after a shift keeps rows of its own: a truncate, a reorder and a fork of
    # them are judged as the caches should hold them, and the pairs they complete count.
    engine, config = small_engine(PreallocatedCache, max_length=37, layers=2)
    request = engine.start("r0", 2)
    with reach.collecting() as noted:
        engine.feed(request, kvtensors.random_tokens(config, 2, 12, 1))
        engine.shift(request, 3, 2)
        engine.truncate(request, 8)
        engine.shift(request, 0, 1)
        engine.reorder(request, torch.tensor([1, 1]))
        engine.shift(request, 2, 3)
        child = engine.fork(request, "r1")
        engine.feed(request, kvtensors.random_tokens(config, 2, 1, 2))
        engine.feed(child, kvtensors.random_tokens(config, 2, 2, 3))
    assert request.rows is None  # still a batch fed as one
    pairs = pairs_in(noted)
    assert {
        "shift → [warm] → truncate",
        "shift → [warm] → reorder",
        "shift → [warm] → fork",
        "fork → [warm] → decode",
        "fork → [warm] → chunk",
    } <= pairs, pairs


class ChunkListCache:
    """Rows in a list of chunks of 8; ``stale_edge``: a truncate that ends on a chunk's
    boundary keeps that chunk whole (the rows past the length come back with the next
    append): a truncate alone, or ending inside a chunk, is right."""

    CHUNK = 8

    def __init__(self, spec, stale_edge: bool = False):
        self.spec, self.stale_edge = spec, stale_edge
        self.reset()

    @property
    def length(self) -> int:
        return self._length

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.chunks)

    def append(self, key, value):
        check_append(self.spec, self._length, key, value)
        for row in range(key.shape[2]):
            if not self.chunks or self.chunks[-1][0].shape[2] == self.CHUNK:
                empty = key[:, :, :0]
                self.chunks.append((empty, value[:, :, :0]))
            k, v = self.chunks[-1]
            self.chunks[-1] = (
                torch.cat((k, key[:, :, row : row + 1]), 2),
                torch.cat((v, value[:, :, row : row + 1]), 2),
            )
        self._length += key.shape[2]
        keys = torch.cat([k for k, _ in self.chunks], 2)
        return keys, torch.cat([v for _, v in self.chunks], 2)

    def truncate(self, length: int) -> None:
        check_truncate(self._length, length)
        whole, part = divmod(length, self.CHUNK)
        kept = self.chunks[:whole]
        if part or (self.stale_edge and whole < len(self.chunks)):
            k, v = self.chunks[whole]
            kept.append((k, v) if not part else (k[:, :, :part], v[:, :, :part]))
        self.chunks, self._length = kept, length

    def reset(self) -> None:
        self.chunks, self._length = [], 0


def test_a_bug_where_a_truncate_meets_a_page_boundary_is_caught():
    config = ModelConfig(vocab_size=13, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4)
    model = kvtensors.build_model(config, torch.float64)
    walks = interplay.covering_walks({"truncate"}, 21, 8)

    def run_all(factory) -> None:
        for walk in walks:
            run_walk(factory, model, walk, 21, 2, "append", "a walk")

    run_all(ChunkListCache)  # the correct twin holds every walk
    with pytest.raises((AssertionError, CacheContractError)):
        run_all(lambda spec: ChunkListCache(spec, stale_edge=True))


def test_a_failing_walk_is_told_on_the_fewest_events_to_its_pair():
    # The slot bug fails the first covering walk at its 17th step (a select, then a join);
    # three events from empty caches reach the same pair and fail too: those are told, the
    # covering walk's failure is what they were raised from.
    with pytest.raises(failures.DataLoss) as caught:
        check_every_offered_pair(bugs.INTERPLAY_BUGS["JoinReusesLiveSlot"])
    told, found = caught.value, caught.value.__cause__
    assert isinstance(found, failures.DataLoss)
    assert "(step #2)" in str(told), failures.whole_message(told)
    assert "(step #16)" in str(found), failures.whole_message(found)


def test_the_verdict_counts_the_pairs_that_ran(pytester):
    (pytester.path / "test_mine.py").write_text(
        "from kvcheck.properties.interactions import InteractionTests\n"
        "from kvimpl import ConcatCache\n\n\n"
        "class TestMine(InteractionTests):\n    factory = ConcatCache\n"
    )
    result = run_in_process(pytester, "test_mine.py")
    assert result.returncode == 0, result.stdout
    pairs = len(pairs_offered(ConcatCache))
    assert f"interactions {pairs} of {pairs} pairs of events ran" in result.stdout, result.stdout
