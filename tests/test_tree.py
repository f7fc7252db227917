"""Tree drafts (docs/contract.md, section 9.2): the reference model's ``forward_tree`` against
the uncached model on each node's path (with poisoned siblings beside it), the checks of a
tree and of its accepted paths, the built-in ``kvimpl.tree`` mixin (on ``chunked``, and on
caches with rows of their own, where each row commits a path of its own length), and the
kit's property, ``tree drafts`` (kvcheck/properties/tree.py), on them."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from kvcheck.badinput import BAD_TREE_CALLS, TreeCall
from kvcheck.properties.tree import TREE, TreeTests
from kvimpl import ChunkedCache, ConcatCache, PagedPool, PreallocatedCache
from kvimpl.tree import TreeDraftsMixin
from kvref import (
    CacheContractError,
    CacheSpec,
    ModelConfig,
    ReferenceTransformer,
    capabilities,
    check_accepted,
    check_tree,
)
from kvref.tree import tree_depths, tree_mask, tree_paths
from tests import depth
from tests.independent.aside_tree_cache import AsideTreeCache, AsideTreeRowsCache
from tests.independent.left_padded_batch_cache import LeftPaddedBatchCache

CONFIG = ModelConfig(vocab_size=19, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4, seed=3)
MODEL = ReferenceTransformer(CONFIG)
# Two roots, node 1 with an earlier sibling, nodes in no depth-first order.
PARENTS = (-1, -1, 0, 1, 1, 3, 2)


class TreePreallocated(TreeDraftsMixin, PreallocatedCache):
    """``preallocated`` with the mixin: rows of their own, each committing its own path."""


class TreeLeftPadded(TreeDraftsMixin, LeftPaddedBatchCache):
    """An independent left-padded cache with the mixin: its rows laid out to the left."""


def tokens(batch: int, length: int, seed: int) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, CONFIG.vocab_size, (batch, length), generator=generator)


def spec(batch: int = 2, max_length: int = 64) -> CacheSpec:
    return MODEL.cache_spec(batch, max_length)


def rows(seed: int, batch: int = 2, count: int = 3) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    shape = (batch, CONFIG.num_kv_heads, count, CONFIG.head_dim)
    return torch.randn(shape, generator=generator, dtype=torch.float64)


# --- the tree and its paths ---------------------------------------------------------------
def test_paths_depths_and_the_mask_follow_the_parents():
    assert tree_paths(PARENTS) == ((0,), (1,), (0, 2), (1, 3), (1, 4), (1, 3, 5), (0, 2, 6))
    assert tree_depths(PARENTS) == (0, 0, 1, 1, 1, 2, 2)
    seen = tree_mask(PARENTS)
    assert seen[5].tolist() == [False, True, False, True, False, True, False]  # 1, 3 and itself
    assert not seen[4, 3]
    assert not seen[2, 1]


@pytest.mark.parametrize(
    ("parents", "nodes", "problem"),
    [
        ((-1, 0), 3, "one entry per draft node"),
        ((-1, 1), 2, r"parents\[1\] is 1"),  # a node its own parent
        ((0,), 1, r"parents\[0\] is 0"),
        ((-1, -2), 2, r"parents\[1\] is -2"),
        ((-1, True), 2, r"parents\[1\] is True"),
        ((-1, 0.0), 2, r"parents\[1\] is 0.0"),
        ("ab", 2, "sequence of ints"),
        (None, 1, "sequence of ints"),
    ],
)
def test_a_bad_tree_is_refused(parents, nodes, problem):
    with pytest.raises(ValueError, match=problem):
        check_tree(parents, nodes)


def test_a_tree_is_taken_as_a_tuple():
    assert check_tree([-1, 0, 0], 3) == (-1, 0, 0)
    assert check_tree(torch.tensor([-1, -1]), 2) == (-1, -1)


@pytest.mark.parametrize(
    ("accepted", "problem"),
    [
        (((0, 2),), "one sequence of nodes per batch row"),
        (((0, 2), (2,)), "not a path from a root down"),  # starts below a root
        (((0, 3), ()), "not a path from a root down"),  # 3 is 1's child, not 0's
        (((0, 2, 6, 7), ()), "holds 7, not a draft node"),
        (((0, -1), ()), "holds -1, not a draft node"),
        (((0, True), ()), "holds True, not a draft node"),
        ((3, ()), "must be a sequence of node indices"),
        ("ab", "one sequence of nodes per batch row"),
    ],
)
def test_accepted_paths_that_are_no_paths_are_refused(accepted, problem):
    with pytest.raises(ValueError, match=problem):
        check_accepted(accepted, PARENTS, 2)


def test_paths_of_different_lengths_are_refused_only_for_one_length():
    accepted = ((1, 3, 5), [])
    assert check_accepted(accepted, PARENTS, 2) == ((1, 3, 5), ())
    with pytest.raises(ValueError, match=r"lengths \[3, 0\]"):
        check_accepted(accepted, PARENTS, 2, same_length=True)


# --- forward_tree ---------------------------------------------------------------------------
def warm_caches(factory, config: ModelConfig = CONFIG, prefix: int = 14, batch: int = 2):
    model = MODEL if config is CONFIG else ReferenceTransformer(config)
    history = tokens(batch, prefix, seed=1)
    caches = model.new_caches(factory, batch=batch, max_length=64)
    model(history, caches=caches)
    return model, history, caches


@pytest.mark.parametrize(
    ("config", "factory"),
    [
        (CONFIG, ChunkedCache),
        (
            ModelConfig(
                vocab_size=19, num_layers=2, num_heads=6, num_kv_heads=2, head_dim=6, window=4
            ),
            ChunkedCache,
        ),
        # chunked's attend (its prefix's path) keeps no sinks: preallocated appends.
        (ModelConfig(num_layers=3, window=3, window_layers="alternate", sinks=2), TreePreallocated),
    ],
    ids=["global", "window 4", "window 3 and sinks on even layers"],
)
def test_each_node_is_the_uncached_model_on_its_path(config, factory):
    model, history, caches = warm_caches(factory, config)
    draft = tokens(2, len(PARENTS), seed=2)
    logits = model.forward_tree(draft, PARENTS, caches)
    assert all(cache.length == 14 + len(PARENTS) for cache in caches)
    for node, path in enumerate(tree_paths(PARENTS)):
        alone = model(torch.cat((history, draft[:, list(path)]), dim=1))[:, -1]
        torch.testing.assert_close(logits[:, node], alone, msg=lambda m, n=node: f"node {n}: {m}")
    oracle = model.forward_tree_uncached(history, draft, PARENTS)
    torch.testing.assert_close(logits, oracle)


class Poisoning:
    """A cache whose ``append_tree`` is handed ``nodes``' keys and values as ``value``."""

    def __init__(self, cache, nodes: list[int], value: float) -> None:
        self.cache, self.nodes, self.value = cache, nodes, value

    @property
    def length(self) -> int:
        return self.cache.length

    def append_tree(self, key: Tensor, value: Tensor, parents):
        key, value = key.clone(), value.clone()
        key[:, :, self.nodes] = self.value
        value[:, :, self.nodes] = self.value
        return self.cache.append_tree(key, value, parents)


@pytest.mark.parametrize("value", [float("nan"), 1e30])
def test_a_poisoned_branch_reaches_no_other_node(value):
    model, history, caches = warm_caches(ChunkedCache)
    draft = tokens(2, len(PARENTS), seed=2)
    poisoned = [3, 5]  # node 4's earlier sibling and its child
    logits = model.forward_tree(draft, PARENTS, [Poisoning(c, poisoned, value) for c in caches])
    oracle = model.forward_tree_uncached(history, draft, PARENTS)
    clean = [0, 1, 2, 4, 6]
    assert logits[:, clean].isfinite().all()
    torch.testing.assert_close(logits[:, clean], oracle[:, clean])
    if value != value:  # nan: the poisoned nodes themselves show it
        assert logits[:, poisoned].isnan().all()


def test_a_cache_without_append_tree_is_refused_before_any_cache_changes():
    caches = MODEL.new_caches(ConcatCache, batch=2, max_length=64)
    MODEL(tokens(2, 3, seed=1), caches=caches)
    with pytest.raises(CacheContractError, match="offers no append_tree"):
        MODEL.forward_tree(tokens(2, 2, seed=2), (-1, 0), caches)
    assert [cache.length for cache in caches] == [3, 3]


def test_a_bad_tree_is_refused_before_any_cache_changes():
    _, _, caches = warm_caches(ChunkedCache)
    with pytest.raises(ValueError, match="one entry per draft node"):
        MODEL.forward_tree(tokens(2, 3, seed=2), (-1, 0), caches)
    with pytest.raises(ValueError, match=r"parents\[1\] is 1"):
        MODEL.forward_tree(tokens(2, 2, seed=2), (-1, 1), caches)
    assert [cache.length for cache in caches] == [14, 14]


class ReturnsTooFewRows(ChunkedCache):
    def append_tree(self, key, value, parents):
        keys, values = super().append_tree(key, value, parents)
        return keys[:, :, 1:], values[:, :, 1:]


def test_append_tree_returning_too_few_rows_is_refused():
    _, _, caches = warm_caches(ReturnsTooFewRows)
    with pytest.raises(CacheContractError, match="append_tree must return 21 rows"):
        MODEL.forward_tree(tokens(2, len(PARENTS), seed=2), PARENTS, caches)


# --- the mixin ------------------------------------------------------------------------------
def appended(cache, seed: int) -> tuple[Tensor, Tensor]:
    """Append one row of ``seed``'s and return what the cache returned, copied."""
    keys, values = cache.append(rows(seed, count=1), rows(seed + 1, count=1))
    return keys.clone(), values.clone()


def test_the_commit_keeps_each_rows_path_in_order_and_nothing_else():
    cache = ChunkedCache(spec())
    committed = (rows(0, count=14), rows(1, count=14))
    cache.append(*committed)
    nodes = (rows(2, count=len(PARENTS)), rows(3, count=len(PARENTS)))
    keys, values = cache.append_tree(*nodes, PARENTS)
    assert cache.length == 14 + len(PARENTS)
    torch.testing.assert_close(keys, torch.cat((committed[0], nodes[0]), dim=2), rtol=0, atol=0)
    cache.commit_tree([(1, 3, 5), (0, 2, 6)])
    assert cache.length == 17
    keys, values = appended(cache, seed=4)
    for which, got in enumerate((keys, values)):
        for row, path in enumerate([(1, 3, 5), (0, 2, 6)]):
            want = torch.cat((committed[which][row], nodes[which][row][:, list(path)]), dim=1)
            assert torch.equal(got[row, :, :17], want)
    # A second tree after the first commit, and an empty path.
    cache.append_tree(*(rows(5, count=2), rows(6, count=2)), (-1, 0))
    cache.commit_tree([(), ()])
    assert cache.length == 18
    assert torch.equal(appended(cache, seed=7)[0][:, :, :18], keys)


def state(cache) -> tuple[int, Tensor]:
    """The cache's length and every row it holds, read by appending one more."""
    length = cache.length
    keys, values = appended(cache, seed=99)
    return length, torch.cat((keys, values))


@pytest.mark.parametrize(
    ("call", "problem"),
    [
        (lambda c: c.append_tree(rows(2), rows(3), (-1, 1, 0)), r"parents\[1\] is 1"),
        (lambda c: c.append_tree(rows(2), rows(3), (-1, 0)), "one entry per draft node"),
        (lambda c: c.append_tree(rows(2), rows(3, count=2), (-1, 0, 0)), "differ"),
        (lambda c: c.append_tree(rows(2).float(), rows(3).float(), (-1, 0, 0)), "dtype"),
        (lambda c: c.append_tree([1.0], rows(3), (-1,)), "tensor"),
        (lambda c: c.commit_tree([(0,), (0,)]), "no draft tree is waiting"),
    ],
    ids=["a node its own parent", "too few parents", "value longer", "dtype", "list", "commit"],
)
def test_a_bad_call_before_a_tree_is_refused_changing_nothing(call, problem):
    cache, twin = ChunkedCache(spec()), ChunkedCache(spec())
    for each in (cache, twin):
        each.append(rows(0, count=5), rows(1, count=5))
    with pytest.raises(ValueError, match=problem):
        call(cache)
    assert cache._draft_tree is None
    got, want = state(cache), state(twin)
    assert got[0] == want[0]
    assert torch.equal(got[1], want[1])


@pytest.mark.parametrize(
    ("call", "problem"),
    [
        (lambda c: c.append_tree(rows(4), rows(5), (-1, 0, 1)), "waiting for commit_tree"),
        (lambda c: c.commit_tree([(0, 2)]), "one sequence of nodes per batch row"),
        (lambda c: c.commit_tree([(1,), (0,)]), "not a path from a root down"),
        (lambda c: c.commit_tree([(0, 1), ()]), r"lengths \[2, 0\]"),  # chunked: one length
    ],
    ids=["a second tree", "a row missing", "no path", "lengths differ"],
)
def test_a_bad_call_on_a_tree_is_refused_changing_nothing(call, problem):
    cache, twin = ChunkedCache(spec()), ChunkedCache(spec())
    for each in (cache, twin):
        each.append(rows(0, count=5), rows(1, count=5))
        each.append_tree(rows(2), rows(3), (-1, 0, 1))
    with pytest.raises(ValueError, match=problem):
        call(cache)
    assert cache.length == 8
    for each in (cache, twin):  # the tree still waits, and commits as it would have
        each.commit_tree([(0, 1), (0, 1)])
    got, want = state(cache), state(twin)
    assert got[0] == want[0] == 7
    assert torch.equal(got[1], want[1])


def test_a_reset_forgets_the_tree():
    cache = ChunkedCache(spec())
    cache.append(rows(0, count=5), rows(1, count=5))
    cache.append_tree(rows(2), rows(3), (-1, 0, 1))
    cache.reset()
    with pytest.raises(ValueError, match="no draft tree is waiting"):
        cache.commit_tree([(0,), (0,)])
    cache.append_tree(rows(2), rows(3), (-1, 0, 1))  # not refused as a second tree
    assert cache.length == 3


def test_chunked_offers_tree_drafts():
    assert "tree" in capabilities(ChunkedCache(spec()))
    assert "tree" not in capabilities(ConcatCache(spec()))


@pytest.mark.parametrize(
    "factory",
    [TreePreallocated, TreeLeftPadded, PagedPool()],
    ids=["preallocated", "left padded", "paged"],
)
def test_rows_of_their_own_commit_paths_of_their_own_lengths(factory):
    cache = factory(spec())
    committed = (rows(0, count=6), rows(1, count=6))
    cache.append(*committed)
    nodes = (rows(2, count=len(PARENTS)), rows(3, count=len(PARENTS)))
    cache.append_tree(*nodes, PARENTS)
    accepted = [(1, 3, 5), (0,)]
    cache.commit_tree(accepted)
    assert tuple(cache.row_lengths) == (9, 7)
    # One more row each: every row's rows read back.
    keys, values, valid = cache.append_rows(rows(4, count=1), rows(5, count=1), (1, 1))
    for which, got in enumerate((keys, values)):
        for row, path in enumerate(accepted):
            held = got[row][:, valid[row]]
            want = torch.cat(
                (
                    committed[which][row],
                    nodes[which][row][:, list(path)],
                    rows(4 + which, count=1)[row],
                ),
                dim=1,
            )
            assert torch.equal(held, want), (row, which)


def test_a_tree_needs_one_length_on_rows_of_their_own():
    cache = TreePreallocated(spec())
    cache.append_rows(rows(0), rows(1), counts=(3, 1))
    with pytest.raises(ValueError, match="different numbers of tokens"):
        cache.append_tree(rows(2), rows(3), (-1, 0, 0))
    assert tuple(cache.row_lengths) == (3, 1)


# --- the kit's property (on the built-ins chunked and paged: tests/test_builtins.py) ---------
@pytest.mark.soak
class TestPreallocatedTree(TreeTests):
    """Tree drafts with rows of their own: each row's path of its own length, the batch fed
    by row after."""

    factory = TreePreallocated
    examples_scale = depth.pick(0.5, soak=1.0)


@pytest.mark.soak  # the default run holds chunked and paged to the property (test_builtins)
class TestLeftPaddedTree(TreeTests):
    """Tree drafts on a left-padded cache of rows of their own."""

    factory = TreeLeftPadded
    examples_scale = depth.pick(0.15, soak=1.0)


# --- bad tree calls (kvcheck.badinput.BAD_TREE_CALLS) ---------------------------------------
def tree_call(cache_rows: bool, batch: int = 2) -> TreeCall:
    keys = rows(2, batch=batch, count=len(PARENTS))
    return TreeCall(PARENTS, batch, cache_rows, keys, keys.clone(), ((1, 3), (0, 2)))


def test_the_first_pinned_tree_takes_every_bad_tree_call():
    # The pinned plan sends every case; each must apply to its tree on a dense batch of two.
    first = TREE.pinned[0].rounds[0]
    assert first.parents == PARENTS
    assert first.bad == tuple(case.name for case in BAD_TREE_CALLS)
    assert all(case.applies(tree_call(cache_rows=False)) for case in BAD_TREE_CALLS)


@pytest.mark.parametrize("factory", [ChunkedCache, AsideTreeCache, AsideTreeRowsCache])
@pytest.mark.parametrize("case", BAD_TREE_CALLS, ids=str)
def test_each_bad_tree_call_is_refused_changing_nothing(factory, case):
    cache_rows = factory is AsideTreeRowsCache
    call = tree_call(cache_rows)
    if not case.applies(call):
        pytest.skip("not bad for a cache with rows of its own")
    cache = factory(spec())
    cache.append(rows(0, count=5), rows(1, count=5))
    if case.when != "before":
        cache.append_tree(call.keys, call.values, PARENTS)
    if case.when == "after":
        cache.commit_tree(call.accepted)
    method, bad = case.make(call)
    held = cache.length
    with pytest.raises(case.errors):
        getattr(cache, method)(*bad)
    assert cache.length == held
