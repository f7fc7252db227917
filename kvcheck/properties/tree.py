"""Tree drafts (docs/contract.md, section 9.2): speculative decoding that verifies a tree of
draft tokens in one call, then keeps one path per batch row.

A ``TreePlan`` is a batch, a warm prefix fed in 1 to 3 chunks, and two rounds, each a draft
tree (depth 1 to 4, 1 to 3 children a node, up to 3 roots, in any order its parents come
first), per batch row the path accepted (empty, part of a branch, a whole branch; one
length for every row or each its own) and the nodes whose rows are poisoned with nan or
1e30 on their way into the cache (nodes off that row's path, with their subtrees; 1e30
alone in bfloat16, ``TreePlan.poison_held``), then decode steps after the commit. The oracle
is the one of every property: node i's logits are the uncached model's on the committed
tokens and node i's path (``ReferenceTransformer.forward_tree_uncached``), for every node
no poisoned row can reach; ``append_tree`` returns the committed rows then the nodes, bit
for bit; after the commit, every step is the uncached model on the committed and accepted
tokens, and on the append path every append returns exactly those rows (the recorders are
told what the commit keeps). Paths of different lengths are drafted for a cache without rows
of their own too, and cut to the shortest there (it may take one length only); where the
rows differ after a commit, the batch goes on through ``feed_rows``, and each row is fed up
to the longest before the next tree (a tree starts after one length).

After a commit, a round may go on with later events where the cache offers them (a truncate
back into the accepted path, per row where the rows differ; a reorder; a fork, the parent
then dropped; a reset, so that the next tree starts on an empty cache), and each round sends
bad tree calls (``kvcheck.badinput.BAD_TREE_CALLS``: before its tree, while it waits, after
its commit) to every layer: each must be refused with a ``ValueError`` naming the problem and
change nothing, which every later step shows (a tree the cache lost, replaced or cut is read
back by the oracle). Each case, event and kind of path is an edge (``kvcheck.reach``).

The engine (``kvcheck.session``) runs every event of a plan, the tree's too: its draft and
its commit are events beside the others (``kvcheck.session.events.tree``), so any plan may
mix them; this module draws the plans and the bad calls sent between them.

- ``tree drafts``: where ``append_tree`` and ``commit_tree`` are offered.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from hypothesis import strategies as st
from torch import Tensor

from kvcheck import asserts as kvassert
from kvcheck import badinput as kvbad
from kvcheck import devices as kvdevices
from kvcheck import failures, reach
from kvcheck import scope as kvscope
from kvcheck import sizes as kvsizes
from kvcheck import strategies as kvst
from kvcheck import tensors as kvtensors
from kvcheck.devices import dtype_name
from kvcheck.harness import PATHS, Recorder
from kvcheck.kit import KitTests, Property, path_for, property_test
from kvcheck.plan_events import Feed, Fork, Reorder, Reset, Truncate
from kvcheck.session import Engine, Request
from kvcheck.session.tree_tap import NODES_IN_CODES
from kvref import CacheFactory, ModelConfig
from kvref.reprs import short_repr
from kvref.tree import tree_paths

EDGE = kvst.EDGE
MAX_NODES = 10
MAX_DEPTH = 4  # levels: a root's depth is 0, the deepest node's 3
MAX_CHILDREN = 3
MAX_ROOTS = 3
POISONS = ("nan", "huge")  # kvtensors.POISON_VALUES
ROUNDS = 2  # a second tree after the first commit
# The most a plan's caches hold: a prefix of 3 chunks of 17, then per round a tree, the rows
# fed up to one length and the steps after (TreePlan.max_length); the model's budget.
MOST_HELD = 3 * (EDGE + 1) + ROUNDS * (MAX_NODES + MAX_DEPTH + 2 * 3)

# Built once: a strategy is validated the first time it is drawn from, and a plan draws
# per node and per row (integers are built once per range by Hypothesis itself).
ACCEPTANCE = st.sampled_from(("branch", "partial", "empty"))
POISONED = st.integers(0, 2)  # 2: a third of the nodes off the path root a poisoned subtree
PREFIX_CHUNKS = st.lists(
    st.one_of(st.integers(1, 6), st.sampled_from((EDGE - 2, EDGE - 1, EDGE, EDGE + 1))),
    min_size=1,
    max_size=3,
)
STEPS_AFTER = {last: st.lists(st.integers(1, 3), min_size=last, max_size=2) for last in (0, 1)}
# In bfloat16, 1e30 alone (``TreePlan.poison_held``).
POISON_DRAWS = {False: st.sampled_from(POISONS), True: st.just("huge")}
# After a commit, where the cache offers them (TreeRound.then): a truncate BACK tokens back,
# the rows reversed, a fork the round goes on with, a reset.
LATER_EVENTS = ("truncate", "reorder", "fork", "reset")
THEN = st.lists(st.sampled_from(LATER_EVENTS), max_size=2)
BACK = st.integers(1, MAX_DEPTH)
BAD_CALLS = {case.name: case for case in kvbad.BAD_TREE_CALLS}
BAD = st.lists(st.sampled_from(tuple(BAD_CALLS)), max_size=5, unique=True)


Later = Truncate | Reorder | Fork | Reset  # an event after a commit


@dataclass(frozen=True)
class TreeRound:
    """One draft tree: node i's parent ``parents[i]`` (-1: the last committed token); per
    batch row the path it accepts and the nodes whose rows it poisons (subtrees whole); then
    the plan events of its request after the commit (``Later`` events, then the feeds)."""

    parents: tuple[int, ...]
    accepted: tuple[tuple[int, ...], ...]
    poisoned: tuple[tuple[int, ...], ...]
    then: tuple[Later | Feed, ...] = ()
    bad: tuple[str, ...] = ()  # names of BAD_TREE_CALLS, each sent at its moment

    @property
    def fed_after(self) -> int:
        """The tokens its feeds after the commit bring."""
        return sum(event.size for event in self.then if isinstance(event, Feed))

    def describe(self) -> str:
        then = f", then {[event.describe() for event in self.then]}" if self.then else ""
        bad = f", bad calls {list(self.bad)}" if self.bad else ""
        return (
            f"a tree of parents {list(self.parents)}, accepted per row "
            f"{[list(path) for path in self.accepted]}, poisoned per row "
            f"{[list(nodes) for nodes in self.poisoned]}{bad}{then}"
        )


@short_repr
@dataclass(frozen=True)
class TreePlan:
    """A prefix fed in chunks, then draft trees verified and committed, each followed by
    decode steps."""

    config: ModelConfig
    dtype: torch.dtype
    batch: int
    prefix: tuple[int, ...]
    rounds: tuple[TreeRound, ...]
    token_seed: int
    poison: str = "nan"  # what the poisoned nodes' keys and values hold
    path: str = "append"  # the model's path through the caches for the prefix and decode

    @property
    def poison_held(self) -> str:
        """The poison the rows hold: ``poison``, but 1e30 in bfloat16. A poisoned node sees
        its own rows, so its activations are nan, and torch's bfloat16 matmul on the CPU
        lets a nan (or inf) in one row of its input reach the row beside it: a neighbour's
        logits would be nan through no cache's doing (1e30 keeps every activation finite
        there, and any row that leaks still moves a logit far past the budget)."""
        return "huge" if self.dtype == torch.bfloat16 else self.poison

    @property
    def max_length(self) -> int:
        """The most a cache holds: the prefix, every tree whole, the rows fed up to the
        longest (at most a path) and the steps after."""
        return sum(self.prefix) + sum(
            len(tree.parents) + MAX_DEPTH + tree.fed_after for tree in self.rounds
        )

    def describe(self) -> str:
        trees = "; ".join(
            f"tree #{index}: {tree.describe()}" for index, tree in enumerate(self.rounds)
        )
        return (
            f"tree plan: batch {self.batch}, {dtype_name(self.dtype)}, poison {self.poison_held}, "
            f"{self.path} path, prefix chunks {list(self.prefix)}; {trees}\n  model: "
            f"{kvst.describe_config(self.config)}"
        )

    def summary(self) -> tuple[str, str, str]:
        nodes = "+".join(str(len(tree.parents)) for tree in self.rounds)
        fed = sum(self.prefix) + sum(tree.fed_after for tree in self.rounds)
        return f"{fed} (trees of {nodes} nodes)", str(self.config.num_layers), str(self.batch)


@st.composite
def draft_trees(draw, max_nodes: int = MAX_NODES) -> tuple[int, ...]:
    """Parents, one node at a time: each a child of an earlier node with room (depth below
    ``MAX_DEPTH`` levels, fewer than ``MAX_CHILDREN`` children) or, up to ``MAX_ROOTS``, a
    root. The latest node comes first among the choices, so a tree shrinks to a chain."""
    nodes = draw(st.integers(1, max_nodes), label="nodes")
    parents: list[int] = []
    depths: list[int] = []
    children = [0] * nodes
    for node in range(nodes):
        choices = [
            n
            for n in reversed(range(node))
            if depths[n] < MAX_DEPTH - 1 and children[n] < MAX_CHILDREN
        ]
        if parents.count(-1) < MAX_ROOTS:
            choices.append(-1)
        parent = choices[draw(st.integers(0, len(choices) - 1), label="parent")]
        parents.append(parent)
        depths.append(0 if parent < 0 else depths[parent] + 1)
        if parent >= 0:
            children[parent] += 1
    return tuple(parents)


@st.composite
def accepted_paths(draw, parents: tuple[int, ...], batch: int) -> tuple[tuple[int, ...], ...]:
    """Per batch row, the path it accepts: one length for every row (each row its own path
    of it), or each row empty, part of a branch or a whole branch."""
    paths = tree_paths(parents)
    leaves = [node for node in range(len(parents)) if node not in parents]
    inner = [node for node in range(len(parents)) if node in parents]
    if draw(st.booleans(), label="one accepted length for every row"):
        length = draw(st.integers(0, max(map(len, paths))), label="accepted length")
        ends = [node for node, path in enumerate(paths) if len(path) == length]
        return tuple(
            paths[ends[draw(st.integers(0, len(ends) - 1), label="accepted node")]]
            if length
            else ()
            for _ in range(batch)
        )
    accepted = []
    for _ in range(batch):
        kind = draw(ACCEPTANCE, label="accepted")
        if kind == "empty":
            accepted.append(())
            continue
        ends = leaves if kind == "branch" or not inner else inner
        accepted.append(paths[ends[draw(st.integers(0, len(ends) - 1), label="accepted node")]])
    return tuple(accepted)


@st.composite
def poisoned_nodes(draw, parents: tuple[int, ...], path: tuple[int, ...]) -> tuple[int, ...]:
    """Nodes off ``path`` (siblings of its nodes, nodes below its end, other roots) whose
    rows are poisoned, each with its whole subtree."""
    picked = {
        node
        for node in range(len(parents))
        if node not in path and draw(POISONED, label="poisons its subtree") == 2
    }
    return tuple(
        node for node, above in enumerate(tree_paths(parents)) if picked.intersection(above)
    )


@st.composite
def tree_rounds(draw, batch: int, last: bool) -> TreeRound:
    """A tree, each row's accepted path and poison, and the feeds after its commit (at least
    one after the ``last`` tree's, so that what it kept is read back)."""
    parents = draw(draft_trees(), label="tree")
    accepted = draw(accepted_paths(parents, batch), label="accepted paths")
    poisoned = tuple(draw(poisoned_nodes(parents, path), label="row's poison") for path in accepted)
    steps = draw(STEPS_AFTER[int(last)], label="feeds after")
    names = draw(THEN, label="events after the commit")
    back = draw(BACK, label="tokens a truncate goes back")
    later = tuple(later_event(name, back, batch) for name in names)
    bad = draw(BAD, label="bad tree calls")
    feeds = tuple(Feed(0, size) for size in steps)
    return TreeRound(parents, accepted, poisoned, (*later, *feeds), tuple(bad))


def later_event(name: str, back: int, batch: int) -> Later:
    """The plan event of ``name`` (one of ``LATER_EVENTS``) after a commit: a truncate
    ``back`` tokens back, the ``batch`` rows reversed, a fork, a reset."""
    if name == "truncate":
        return Truncate(0, back)
    if name == "reorder":
        return Reorder(0, tuple(reversed(range(batch))))
    return Fork(0, 1) if name == "fork" else Reset(0)


@st.composite
def tree_plans(draw) -> TreePlan:
    """A prefix of 1 to 3 chunks (ending before, at and past a 16-row block edge), then two
    trees, each committed and followed by decode steps (at least one after the last)."""
    prefix = draw(PREFIX_CHUNKS, label="prefix chunks")
    config = draw(kvst.model_configs(max_layers=2, tokens=MOST_HELD), label="config")
    room = kvst.attention_room(config, MOST_HELD)
    batch = draw(kvsizes.batches(small_max=3, room=room), label="batch")
    rounds = tuple(
        draw(tree_rounds(batch, index == ROUNDS - 1), label="round") for index in range(ROUNDS)
    )
    dtype = draw(kvst.dtypes_on_device(kvst.WITH_HALF), label="dtype")
    return TreePlan(
        config=config,
        dtype=dtype,
        batch=batch,
        prefix=tuple(prefix),
        rounds=rounds,
        token_seed=draw(st.integers(0, 2**16), label="token seed"),
        poison=draw(POISON_DRAWS[dtype == torch.bfloat16], label="poison"),
        path=draw(st.sampled_from(PATHS), label="path"),
    )


# --- the tree's steps of the session ----------------------------------------------------
def draft(
    engine: Engine,
    request: Request,
    tree: TreeRound,
    new: Tensor,
    accepted: tuple[tuple[int, ...], ...],
    poison: float,
    label: str,
) -> list[tuple[Tensor, Tensor]]:
    """The round's draft tree through the engine (``kvcheck.session.events.tree``): the node
    rows each layer was handed, poisoned where the plan says."""
    return engine.draft_tree(
        request,
        tree.parents,
        new,
        poisoned=tree.poisoned,
        poison=poison,
        accepted=accepted,
        label=label,
    )


def commit(
    engine: Engine,
    request: Request,
    handed: list[tuple[Tensor, Tensor]],
    new: Tensor,
    accepted: tuple[tuple[int, ...], ...],
    label: str,
) -> None:
    """The round's commit through the engine, then what holds after every event."""
    engine.commit_tree(request, handed, new, accepted, label=label)
    engine.check(f"{label}, commit_tree({[list(path) for path in accepted]})")


def one_length(accepted: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
    """Each row's path cut to the shortest: what a cache without rows of their own takes."""
    shortest = min(len(path) for path in accepted)
    return tuple(path[:shortest] for path in accepted)


def note_the_tree(tree: TreeRound, accepted, held: int, own_lengths: bool, index: int) -> None:
    """The edges a tree and its accepted paths reach."""
    parents, nodes = tree.parents, len(tree.parents)
    lengths = {len(path) for path in accepted}
    ends = [path[-1] for path in accepted if path]
    reached = {
        "a second tree after a commit": index > 0,
        "a tree on an empty cache": not held,
        "a tree right after a 16-row block edge": held > 0 and not held % EDGE,
        "a tree across a 16-row block edge": held // EDGE != (held + nodes - 1) // EDGE,
        "a node with an earlier sibling": len(set(parents)) < nodes,
        "a poisoned node beside an accepted path": any(tree.poisoned),
        "an empty accepted path": 0 in lengths,
        "a whole branch accepted": any(end not in parents for end in ends),
        "a path accepted up to a node inside the tree": any(end in parents for end in ends),
        "paths of different lengths on rows of their own": own_lengths and len(lengths) > 1,
    }
    reach.note(*(name for name, hit in reached.items() if hit))


class BadCalls:
    """The round's bad tree calls (``TreeRound.bad``), each sent to every layer at its moment:
    refused with a ``ValueError`` (or ``TypeError``) naming the problem, the length (and each
    row's) as before. What else a refusal changed, the commit and every step after show."""

    def __init__(self, engine: Engine, request: Request, tree: TreeRound, own: bool, label: str):
        self.engine, self.request, self.tree, self.label = engine, request, tree, label
        self.own = own
        self.sent: list[str] = []

    def send(self, when: str, *, tokens=None, handed=None, accepted=()) -> None:
        cases = [BAD_CALLS[name] for name in self.tree.bad if BAD_CALLS[name].when == when]
        for layer, recorder in enumerate(self.request.caches if cases else ()):
            keys, values = handed[layer] if handed else self._rows_like(tokens)
            call = kvbad.TreeCall(
                self.tree.parents, self.request.batch, self.own, keys, values, tuple(accepted)
            )
            for case in cases:
                if case.applies(call):
                    self._refused(case, call, recorder, f"{self.request.name}'s layer {layer}")
        self.sent += [case.name for case in cases]

    def _rows_like(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """Node rows shaped as the tree's will be, for a bad tree drafted before it."""
        spec = self.engine.model.cache_spec(tokens.shape[0], self.engine.max_length)
        keys = kvtensors.random_rows(spec, tokens.shape[1], seed=tokens.shape[1])
        return keys, kvtensors.as_values(spec, keys)

    def _refused(self, case, call: kvbad.TreeCall, recorder: Recorder, who: str) -> None:
        method, bad = case.make(call)
        where = self.engine.where(f"{self.request.name}: {self.label}, {case.when} its commit")
        held = (recorder.length, tuple(getattr(recorder.cache, "row_lengths", ())))
        recorder.views = None  # any call ends the views' life
        error = kvassert.raised_by(lambda: getattr(recorder.cache, method)(*bad))
        kvassert.assert_refused(error, case, where=f"{who}: {method}, {where}")
        now = (recorder.length, tuple(getattr(recorder.cache, "row_lengths", ())))
        if now != held:
            raise failures.RefusalChangedState(
                f'{who}: (length, row_lengths) {now} after refusing "{case}", was {held}\n'
                f"  at {where}"
            )
        kvassert.assert_clear_error(error, case, bad, where=where)
        reach.note(case.name)

    @contextmanager
    def named_in_failures(self) -> Iterator[None]:
        """A failure after bad calls says which were sent: a refusal may have changed what
        the commit or a later step reads."""
        try:
            yield
        except failures.PropertyFailure as error:
            if self.sent:
                error.add_note(f"  after the refused bad tree calls {self.sent} of {self.label}")
            raise


def after_the_commit(
    engine: Engine, request: Request, tree: TreeRound, accepted, label: str, tokens
) -> Request:
    """``tree.then``'s events, each where the cache offers it (and the rows allow), a feed's
    tokens from ``tokens(*shape)``; the request the round goes on with (a fork's child)."""
    for event in tree.then:
        at = f" (after {label}'s commit_tree({[list(path) for path in accepted]}))"
        if isinstance(event, Feed):  # rows of their own after the commit: fed by row
            if request.rows is None:
                engine.play(request, event, new=tokens(request.batch, event.size), at=at)
            else:
                engine.feed_rows(request, [tokens(event.size) for _ in request.rows], at=at)
        elif isinstance(event, Truncate):
            truncate_back(engine, request, event.back, at)
        elif isinstance(event, Reorder) and request.rows is None:
            if engine.play(request, event, at=at) and request.batch > 1:
                reach.note("reorder after a commit")
        elif isinstance(event, Fork) and request.rows is None and "fork" in request.offered:
            # Named after its parent: each of several forks after a commit has its own name
            # (the engine's drop goes by name).
            child = engine.fork(request, f"the fork of {request.name}", at=at)
            engine.drop(request)  # its blocks now the child's alone
            request = child
            reach.note("fork after a commit")
        elif isinstance(event, Reset):
            engine.play(request, event)
            request.rows = None
            reach.note("reset after a commit")
        engine.check(f"{label}: {event.describe()}{at}")
    return request


def truncate_back(engine: Engine, request: Request, back: int, at: str) -> None:
    """Every row ``back`` tokens back (into the accepted path, or past it into the committed
    rows): by row where rows differ, through ``truncate_rows``."""
    if request.rows is None:
        offered = "truncate" in request.offered and request.held
        if offered and engine.truncate(request, max(0, request.held - back), at=at):
            reach.note("truncate after a commit")
        return
    if callable(getattr(request.caches[0].cache, "truncate_rows", None)):
        keep = [max(0, len(row) - back) for row in request.rows]
        if engine.truncate_rows(request, keep, at=at):
            reach.note("truncate_rows after a commit")


def check_tree_drafts(factory: CacheFactory, plan: TreePlan) -> None:
    """Each tree's nodes equal the uncached model on the committed tokens and their path, and
    after each commit every step equals it on the committed and accepted tokens."""
    model = kvtensors.build_model(plan.config, plan.dtype)
    path = path_for(plan.path, factory)
    engine = Engine(factory, model, max_length=plan.max_length, path=path, describe=plan.describe)
    generator = torch.Generator().manual_seed(plan.token_seed)
    device = kvdevices.current()

    def tokens(*shape: int) -> Tensor:
        drawn = torch.randint(0, plan.config.vocab_size, shape, generator=generator)
        return drawn.to(device)

    request = engine.start("the request", plan.batch)
    for index, size in enumerate(plan.prefix):
        engine.feed(request, tokens(plan.batch, size), at=f" (prefix chunk #{index})")
        engine.check(f"prefix chunk #{index}")
    own_lengths = "append_rows" in request.offered
    poison = kvtensors.poison_value(plan.poison_held, model.dtype)
    for index, tree in enumerate(plan.rounds):
        label = f"tree #{index}"
        if request.rows is not None:  # up to one length: a tree starts after one
            longest = max(len(row) for row in request.rows)
            if any(len(row) < longest for row in request.rows):
                more = [tokens(longest - len(row)) for row in request.rows]
                engine.feed_rows(request, more, at=f" (each row fed up to {longest} for {label})")
                engine.check(f"rows fed up to one length for {label}")
                reach.note("rows fed up to one length before a tree")
        accepted = tree.accepted if own_lengths else one_length(tree.accepted)
        note_the_tree(tree, accepted, request.held, own_lengths, index)
        new = tokens(plan.batch, len(tree.parents))
        bad = BadCalls(engine, request, tree, own_lengths, label)
        bad.send("before", tokens=new)
        handed = draft(engine, request, tree, new, accepted, poison, label)
        with bad.named_in_failures():
            bad.send("waiting", handed=handed, accepted=accepted)
            commit(engine, request, handed, new, accepted, label)
            bad.send("after", handed=handed, accepted=accepted)
            request = after_the_commit(engine, request, tree, accepted, label, tokens)
    engine.finish()


# --- Every plan within a scope (kvcheck.scope), for the bounded-exhaustive mode ---
ENUMERATED_NODES = 3  # the most nodes of an enumerated tree ("a few draft tokens")


def every_parents(nodes: int) -> Iterator[tuple[int, ...]]:
    """Every draft tree of ``nodes`` nodes whose parents come first (node i's parent -1, a
    root, or one of nodes 0..i-1): nodes! parent assignments, those with more than
    ``MAX_ROOTS`` roots left out (the strategy's bound: one at 4 nodes, the all-roots tree);
    chains first."""
    for parents in itertools.product(*(range(node - 1, -2, -1) for node in range(nodes))):
        if parents.count(-1) <= MAX_ROOTS:
            yield parents


def every_acceptance(parents: tuple[int, ...], batch: int) -> Iterator[tuple[tuple[int, ...], ...]]:
    """Per batch row, every path a row may accept: none, or a root down to any node (part of
    a branch or a whole one): (nodes + 1)^batch, each row its own."""
    choices = ((), *tree_paths(parents))
    return itertools.product(choices, repeat=batch)


def off_the_paths(parents: tuple[int, ...], accepted) -> tuple[tuple[int, ...], ...]:
    """Per row, every node off the path it accepts (a closed set: a node off the path has
    its subtree off it too)."""
    return tuple(
        tuple(node for node in range(len(parents)) if node not in path) for path in accepted
    )


def every_tree_plan(scope: kvscope.Scope) -> Iterator[TreePlan]:
    """Every plan of one tree round: a prefix of p tokens fed as one prefill (none at p = 0:
    the tree on an empty cache; its splits are the search's, every one would multiply the
    plans by 2^(p - 1)), a tree of n nodes in every parent assignment (``every_parents``,
    n <= ``ENUMERATED_NODES``), per batch row every accepted path (``every_acceptance``), the
    nodes off each row's path poisoned or none (the poisoned variant only where some node is
    off a path), then a >= 1 tokens fed after the commit in every split; p + n + a tokens
    in all (the rows fed up to one length for a cache of rows of their own are the accepted
    paths' difference, at most n, which the nodes bound already). Per layout of B rows, at T
    tokens: sum over p + n + a = T of sum over trees of sum over acceptances of
    (1 + [some node off a path]) x 2^(a - 1).

    Fixed, and why: one round (a second multiplies the plans by the first's; the search
    draws two), no later events (truncate, reorder, fork, reset after the commit) and no bad
    tree calls (those are the search's and ``bad tree call``'s), poison nan (the first any
    read of a poisoned row shows; 1e30 in bfloat16, ``poison_held``), the append path (the
    tree itself goes through append_tree on either path), token seed 0. Poisoning every node
    off the paths, or none, stands for its subsets: all of them is where any row a cache
    keeps that it should not shows, none is where every node's logits are compared."""
    for tokens in range(1, scope.tokens + 1):
        for layout in scope.layouts:
            config = layout.config()
            for prefix_tokens in range(tokens - 1):
                for prefix in [(prefix_tokens,) if prefix_tokens else ()]:
                    room = tokens - prefix_tokens
                    for nodes in range(1, min(room - 1, ENUMERATED_NODES) + 1):
                        for parents in every_parents(nodes):
                            for accepted in every_acceptance(parents, layout.batch):
                                off = off_the_paths(parents, accepted)
                                poisons = [tuple(() for _ in accepted)]
                                if any(off):
                                    poisons.append(off)
                                for poisoned in poisons:
                                    for after in kvscope.compositions(room - nodes):
                                        feeds = tuple(Feed(0, size) for size in after)
                                        tree = TreeRound(parents, accepted, poisoned, feeds)
                                        yield TreePlan(
                                            config=config,
                                            dtype=scope.dtype,
                                            batch=layout.batch,
                                            prefix=prefix,
                                            rounds=(tree,),
                                            token_seed=0,
                                        )


# Tried first on every run: a tree that crosses the 16-row block edge, two roots, the
# accepted paths neither the first nodes in order nor of one length, the nodes before them in
# order poisoned (a sibling seen, or a rejected row kept, shows as nan), then a second tree;
# every bad tree call, a truncate back into the paths after the first commit, a reorder
# after the second. Then one length accepted on a prefix of one whole block, a fork and a
# reset after the first commit (the second tree on an empty cache), a reorder and a truncate
# after the second: the later events where the rows keep one length.
ALL_BAD = tuple(BAD_CALLS)
PINNED = (
    TreePlan(
        config=ModelConfig(vocab_size=23, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8),
        dtype=torch.float64,
        batch=2,
        prefix=(EDGE - 3, 1),
        rounds=(
            TreeRound(
                parents=(-1, -1, 0, 1, 1, 3, 2),
                accepted=((1, 4), (0, 2, 6)),
                poisoned=((0, 2, 3, 5, 6), (1, 3, 4, 5)),
                then=(Truncate(0, 2), Feed(0, 1)),
                bad=ALL_BAD,
            ),
            TreeRound(
                parents=(-1, 0, 0, 1, 2),
                accepted=((0, 2, 4), (0, 2)),
                poisoned=((1, 3), (1, 3, 4)),
                then=(Reorder(0, (1, 0)), Feed(0, 1), Feed(0, 2)),
            ),
        ),
        token_seed=7,
    ),
    TreePlan(
        config=ModelConfig(vocab_size=23, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8),
        dtype=torch.float64,
        batch=2,
        prefix=(EDGE,),
        rounds=(
            TreeRound(
                parents=(-1, 0, 1, 0),
                accepted=((0, 1), (0, 3)),
                poisoned=((2, 3), (1, 2)),
                then=(Fork(0, 1), Reset(0)),
            ),
            TreeRound(
                parents=(-1, -1, 1),
                accepted=((1, 2), (1, 2)),
                poisoned=((0,), (0,)),
                then=(Reorder(0, (1, 0)), Truncate(0, 1), Feed(0, 1)),
            ),
        ),
        token_seed=5,
    ),
)

TREE_EDGES = (
    reach.Edge(NODES_IN_CODES, needs=("tree", "lossy storage")),
    *(
        reach.Edge(name, needs=("tree",))
        for name in (
            "a second tree after a commit",
            "a tree on an empty cache",
            "a tree right after a 16-row block edge",
            "a tree across a 16-row block edge",
            "a node with an earlier sibling",
            "a poisoned node beside an accepted path",
            "an empty accepted path",
            "a whole branch accepted",
            "a path accepted up to a node inside the tree",
            "reset after a commit",
        )
    ),
    reach.Edge("paths of different lengths on rows of their own", needs=("tree", "append_rows")),
    reach.Edge("rows fed up to one length before a tree", needs=("tree", "append_rows")),
    reach.Edge("truncate_rows after a commit", needs=("tree", "append_rows")),
    reach.Edge("truncate after a commit", needs=("tree", "truncate")),
    reach.Edge("reorder after a commit", needs=("tree", "reorder")),
    reach.Edge("fork after a commit", needs=("tree", "fork")),
    # Each bad tree call refused (on a cache without rows of their own, paths of different
    # lengths among them).
    *(reach.Edge(name, needs=("tree",)) for name in ALL_BAD),
)

TREE = Property(
    "tree drafts",
    "each node of a draft tree verified in one call equals the uncached model on the "
    "committed tokens and its path, and after the commit the cache holds the accepted path "
    "alone",
    check_tree_drafts,
    tree_plans(),
    failures.WRONG_RESULTS,
    requires=("tree",),
    # Drafted through append_tree on either path; the search draws the path of the steps
    # around the trees.
    pinned=PINNED,
    since="1.3",
    reaches=TREE_EDGES,
    every_plan=every_tree_plan,
    exhaustive_tokens=6,
    holds=(
        "each node of a draft tree verified in one call (`append_tree`) equals the uncached model "
        "on the committed tokens and its path, and after `commit_tree` the cache holds the accepted"
        " path alone ([contract.md, section 9.2](contract.md#92-tree-drafts-speculative-decoding))"
    ),
)


class TreeTests(KitTests):
    """Tree drafts (``append_tree``, ``commit_tree``): run when offered."""

    test_tree_drafts_match_the_model_on_each_path = property_test(TREE)
