"""Interactions: pairs of session events, the unit of coverage beside single edges.

Most bugs that survive a good random search sit where two events meet: an event that left
the caches in a particular state, then another (a truncate that ends on a page boundary,
then a decode; a fork, then a write to the parent; a reset right after a truncate to 0). A
pair here is ``A → [s] → B``: event ``A``, which left the request in state ``s``, then
event ``B`` on it.

- ``KINDS`` is the vocabulary: each kind of event on one request, the capability it needs,
  the states it may run in and the states it can leave (its parameters chosen for each).
- ``offered_pairs(offered)`` is every pair a cache offering ``offered`` can run, and
  ``ruled_out()`` every pair the contract rules out, with the reason (docs/interactions.md,
  generated).
- ``covering_walks(offered, ...)`` builds walks that run every offered pair at least once
  by construction: the ``interactions`` property runs them on every cache
  (``kvcheck.properties.interactions``).
- The session engine says which pair each event it runs completes (``kvcheck.session.pairs``), for
  every property's plans alike: the verdict reports per cache which offered pairs ran in a
  passing test (``interactions: M of N pairs ran``) and ``--kv-require-reach`` holds them.

States name what a next event can tell apart: ``empty`` (no token held), ``warm`` (some,
none of the others), ``page edge`` (a whole number of pages of ``page`` rows), ``full`` (as
many as the caches were built for).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from kvcheck import strategies as kvst
from kvref.reprs import short_repr

STATES = ("empty", "warm", "page edge", "full")
# The note a pair is reached by: kvcheck.reach collects it with the edges.
PREFIX = "pair: "


def page_of(declared: int | None) -> int:
    """The page the states are counted in: the one a cache declares, 16 rows otherwise, and
    two for pages of one row (where every length would be an edge)."""
    return max(2, declared or kvst.EDGE)


def state_of(held: int, max_length: int, page: int) -> str:
    """The state of a request holding ``held`` tokens, of caches built for ``max_length``."""
    if held == 0:
        return "empty"
    if held >= max_length:
        return "full"
    return "page edge" if held % page == 0 else "warm"


@dataclass(frozen=True)
class Kind:
    """A kind of event on one request: what it needs, where it runs, what it can leave.

    ``runs_in`` are the states it may start from; ``leaves`` the states it can leave (a
    reorder, a fork and an offload change no length: they leave the state they found)."""

    name: str
    needs: str | None  # a capability (kvcheck.kit.offered's names), None: every cache
    runs_in: tuple[str, ...]
    leaves: tuple[str, ...]
    why_not: str = ""  # what the contract says of it in the states it does not run in

    def lengths(self, held: int, most: int, page: int) -> list[int]:
        """The lengths it can leave caches holding ``held`` of ``most`` tokens in, one per
        state it can reach from there (pages of ``page`` rows)."""
        up = [held + 1] if self.name == "decode" else []
        # Besides a few tokens on, each lands on, or one short of, a page edge and the end:
        # a decode from one short of either reaches it.
        if self.name == "prefill":
            up = [5, page - 1, page, most - 1, most]
        elif self.name == "chunk":
            edge = (held // page + 1) * page
            up = [held + 2, held + 3, edge - 1, edge, most - 1, most]
            up = [n for n in up if n - held >= 2]
        elif self.name == "reset":
            return [0]
        elif self.name == TREE:  # three nodes drafted, a path of one or two committed
            return [held + 1, held + 2] if held + 3 <= most else []
        elif self.name in ("truncate", "shift"):  # a shift discards held - length tokens
            return sorted({0, held - 1, (held - 1) // page * page})
        elif self.name not in ("decode",):
            return [held]  # a reorder, a fork, an offload and restore, a move: no length changes
        return sorted({n for n in up if n <= most})

    def every_length(self, held: int, most: int) -> range | list[int]:
        """Every length it can leave caches holding ``held`` of ``most`` tokens in: the whole
        domain of which ``lengths`` are the representatives (the exhaustive walks')."""
        if self.name == "prefill":
            return range(1, most + 1)
        if self.name == "chunk":
            return range(held + 2, most + 1)
        if self.name in ("truncate", "shift"):
            return range(held)
        return self.lengths(held, most, page=most)  # one or two lengths: the same


SAME = "same"
TREE = "tree draft and commit"
KINDS = (
    Kind(
        "prefill",
        None,
        ("empty",),
        ("warm", "page edge", "full"),
        why_not="a prefill is the first tokens of empty caches: on others, tokens are a decode "
        "or a chunk",
    ),
    Kind(
        "decode",
        None,
        ("warm", "page edge"),
        ("warm", "page edge", "full"),
        why_not="a token past max_length is bad input (overflow), and on empty caches the "
        "first tokens are a prefill",
    ),
    Kind(
        "chunk",
        None,
        ("warm", "page edge"),
        ("warm", "page edge", "full"),
        why_not="tokens past max_length are bad input (overflow), and on empty caches the "
        "first tokens are a prefill",
    ),
    Kind("reset", None, ("warm", "page edge", "full"), ("empty",), why_not="nothing to reset"),
    Kind(
        "truncate",
        "truncate",
        ("warm", "page edge", "full"),
        ("empty", "warm", "page edge"),
        why_not="a truncate of empty caches keeps nothing of nothing",
    ),
    Kind(
        "shift",
        "shift",
        ("warm", "page edge", "full"),
        ("empty", "warm", "page edge"),
        why_not="a shift of empty caches discards nothing",
    ),
    Kind(
        TREE,
        "tree",
        ("warm", "page edge"),
        ("warm", "page edge"),  # full: its third node would have no room
        why_not="a draft tree hangs after committed tokens, and one past max_length is bad "
        "input (overflow)",
    ),
    Kind(
        "reorder",
        "reorder",
        ("warm", "page edge", "full"),
        (SAME,),
        why_not="a reorder of empty caches moves no row",
    ),
    Kind(
        "fork",
        "fork",
        ("warm", "page edge", "full"),
        (SAME,),
        why_not="a fork of empty caches shares no row",
    ),
    Kind(
        "offload and restore",
        "offload",
        ("warm", "page edge", "full"),
        (SAME,),
        why_not="empty caches have no block to offload",
    ),
    Kind(
        "move",  # every layer's rows exported into fresh caches, where the request goes on
        "move",
        ("warm", "page edge", "full"),
        (SAME,),
        why_not="empty caches have no rows to move",
    ),
)
BY_NAME = {kind.name: kind for kind in KINDS}


def kinds_offered(offered: set[str] | frozenset[str]) -> list[Kind]:
    return [kind for kind in KINDS if kind.needs is None or kind.needs in offered]


def _left(kind: Kind, before: str) -> tuple[str, ...]:
    return (before,) if kind.leaves == (SAME,) else kind.leaves


def pair_name(first: str, state: str, then: str) -> str:
    return f"{first} → [{state}] → {then}"


def offered_pairs(offered: set[str] | frozenset[str]) -> list[str]:
    """Every pair ``A → [s] → B`` a cache offering ``offered`` can run, in vocabulary order."""
    kinds = kinds_offered(offered)
    pairs = []
    for first in kinds:
        left = dict.fromkeys(s for before in first.runs_in for s in _left(first, before))
        for state in left:
            pairs += [pair_name(first.name, state, then.name) for then in kinds]
            pairs = [p for p in pairs if not _ruled_out(p)]
    return pairs


def _ruled_out(pair: str) -> bool:
    _, state, then = split(pair)
    return state not in BY_NAME[then].runs_in


def split(pair: str) -> tuple[str, str, str]:
    first, rest = pair.split(" → [", 1)
    state, then = rest.split("] → ", 1)
    return first, state, then


def ruled_out() -> list[tuple[str, str]]:
    """Each pair no cache runs, and why: the contract says what the second event is there."""
    found = []
    for first in KINDS:
        left = dict.fromkeys(s for before in first.runs_in for s in _left(first, before))
        for state in left:
            for then in KINDS:
                if state not in then.runs_in:
                    found.append((pair_name(first.name, state, then.name), then.why_not))
    return found


# --- the walks that cover every offered pair ---------------------------------------------


@short_repr
@dataclass(frozen=True)
class Step:
    """One event of a walk: its kind, the length it leaves the request at, and so the state."""

    kind: str
    length: int
    state: str
    start: int | None = None  # a shift's first position discarded; None: the walk's choice
    order: tuple[int, ...] | None = None  # a reorder's; None: the walk's choice

    def describe(self) -> str:
        detail = "" if self.start is None else f" from {self.start}"
        detail += "" if self.order is None else f" by {list(self.order)}"
        return f"{self.kind} to {self.length}{detail}"

    def weight(self, held: int) -> int:
        """What it counts toward an exhaustive walk's tokens: the tokens a feed brings, a
        tree's three drafted ones, one for every other event (else walks of resets,
        reorders or forks alone would never end)."""
        if self.kind in FEEDS:
            return self.length - held
        return 3 if self.kind == TREE else 1


def covering_walks(
    offered: set[str] | frozenset[str], most: int, page: int, longest: int = 24
) -> list[tuple[Step, ...]]:
    """Walks from empty caches (built for ``most`` tokens, pages of ``page`` rows) that
    between them run every pair of ``offered_pairs``, by construction. From where a walk
    stands (its last event and the length it left) it takes the fewest steps to a pair not
    yet run, ending where most pairs remain. A walk ends before it would pass ``longest``
    events, so that a failure names a short plan (one whose way from empty caches alone is
    longer is as long as that way), and the next starts afresh; pairs no walk can reach
    (none, for these kinds) are left out."""
    todo = set(offered_pairs(offered))
    kinds = kinds_offered(offered)
    walks: list[tuple[Step, ...]] = []
    walk: list[Step] = []
    while todo:
        path = _way_to_a_pair(walk[-1] if walk else None, todo, kinds, most, page)
        if walk and (path is None or len(walk) + len(path) > longest):
            walks.append(tuple(walk))  # the next pair from empty caches, in a walk of its own
            walk = []
            continue
        if path is None:
            break  # from empty caches nothing left is reachable
        for step in path:  # the last step runs a pair not run before: every loop ends one
            if walk:
                todo.discard(pair_name(walk[-1].kind, walk[-1].state, step.kind))
            walk.append(step)
    if walk:
        walks.append(tuple(walk))
    return walks


def _moves(here: Step | None, kinds: list[Kind], most: int, page: int) -> Iterator[Step]:
    """Every step possible after ``here`` (None: empty caches, before any event)."""
    held = 0 if here is None else here.length
    state = state_of(held, most, page)
    for then in kinds:
        if state in then.runs_in:
            for length in then.lengths(held, most, page):
                yield Step(then.name, length, state_of(length, most, page))


def _way_to_a_pair(here, todo: set[str], kinds: list[Kind], most: int, page: int):
    """The fewest steps from ``here`` whose last runs a pair of ``todo``, ending where most
    of ``todo`` remain (breadth first over (event, length left))."""
    remaining: dict[tuple[str, str], int] = {}
    for pair in todo:
        first, state, _ = split(pair)
        remaining[(first, state)] = remaining.get((first, state), 0) + 1
    frontier: list[tuple[Step | None, list[Step]]] = [(here, [])]
    seen = {here}
    while frontier:
        found, ahead = [], []
        for node, path in frontier:
            for step in _moves(node, kinds, most, page):
                if node is not None and pair_name(node.kind, node.state, step.kind) in todo:
                    found.append([*path, step])
                if step not in seen:
                    seen.add(step)
                    ahead.append((step, [*path, step]))
        if found:
            return max(found, key=lambda path: remaining.get((path[-1].kind, path[-1].state), 0))
        frontier = ahead
    return None


def pairs_of(walk: tuple[Step, ...]) -> Iterator[str]:
    for before, after in itertools.pairwise(walk):
        yield pair_name(before.kind, before.state, after.kind)


# --- every walk, for the bounded-exhaustive mode -------------------------------------------


# The kinds that feed tokens: a walk of these alone is a split of its tokens into chunks.
FEEDS = ("prefill", "decode", "chunk")


@functools.cache
def every_walk(
    offered: frozenset[str], tokens: int, batch: int, kinds: tuple[str, ...] | None = None
) -> tuple[tuple[Step, ...], ...]:
    """Every walk from empty caches built for ``tokens`` tokens, of the kinds a cache
    offering ``offered`` runs (of those, ``kinds`` alone where given), each event with
    every parameter it takes (every length it can leave, every span a shift discards, every
    order of ``batch`` rows), whose weights
    (``Step.weight``) add up to at most ``tokens``; fewest first, in vocabulary order.

    Their count: of the kinds every cache runs (prefill, decode, chunk, reset), P(tokens + 1)
    - 1, P the Pell numbers (0, 1, 2, 5, 12, 29, ...): a walk is sessions of 2^(w - 1)
    splits of w tokens each, between resets (tests/test_exhaustive_interactions.py)."""
    moves = [kind for kind in kinds_offered(offered) if kinds is None or kind.name in kinds]
    walks: list[tuple[Step, ...]] = []

    def extend(walk: tuple[Step, ...], held: int, left: int) -> None:
        if walk:
            walks.append(walk)
        for step in _every_move(held, moves, tokens, batch):
            if (cost := step.weight(held)) <= left:
                extend((*walk, step), step.length, left - cost)

    extend((), 0, tokens)
    return tuple(sorted(walks, key=walk_weight))  # stable: vocabulary order within a weight


def tokens_fed(walk: tuple[Step, ...]) -> tuple[int, ...]:
    """The tokens each feed of ``walk`` brings, in order."""
    held, fed = 0, []
    for step in walk:
        if step.kind in FEEDS:
            fed.append(step.length - held)
        held = step.length
    return tuple(fed)


def walk_weight(walk: tuple[Step, ...]) -> int:
    held, total = 0, 0
    for step in walk:
        total, held = total + step.weight(held), step.length
    return total


def _every_move(held: int, kinds: list[Kind], most: int, batch: int) -> Iterator[Step]:
    state = state_of(held, most, page=most)  # no page: "page edge" is the full caches' alone
    for kind in kinds:
        if state not in kind.runs_in:
            continue
        for length in kind.every_length(held, most):
            after = state_of(length, most, page=most)
            if kind.name == "shift":  # every start of a span of held - length tokens
                for start in range(length + 1):
                    yield Step(kind.name, length, after, start=start)
            elif kind.name == "reorder":
                for order in itertools.product(range(batch), repeat=batch):
                    yield Step(kind.name, length, after, order=order)
            else:
                yield Step(kind.name, length, after)


def table() -> str:
    """The vocabulary, the pairs a cache offering every capability runs, and those the
    contract rules out with the reason, as the Markdown of docs/interactions.md."""
    lines = [
        "# Interactions: the pairs of events the kit runs",
        "",
        "Generated by `python -m kvcheck.catalogue` from `kvcheck.interplay`;",
        "`tests/test_catalogue.py` fails where this page is not what it writes. A pair",
        "`A → [s] → B` is event `A`, which left the request in state `s`, then event `B`.",
        "The `interactions` property (contract, section 14) runs every pair a cache offers;",
        "the verdict says how many of them ran in its passing tests",
        "(`interactions: M of N pairs of events ran`), and `--kv-require-reach` holds them.",
        "",
        "| event | needs | runs in | can leave |",
        "|---|---|---|---|",
    ]
    for kind in KINDS:
        leaves = "the state it found" if kind.leaves == (SAME,) else ", ".join(kind.leaves)
        needs = f"`{kind.needs}`" if kind.needs else "every cache"
        lines.append(f"| {kind.name} | {needs} | {', '.join(kind.runs_in)} | {leaves} |")
    every = offered_pairs({kind.needs for kind in KINDS if kind.needs})
    plain = offered_pairs(set())
    lines += [
        "",
        f"A cache with none of the capabilities offers {len(plain)} pairs; one with all of "
        f"them, {len(every)}:",
        "",
        *(f"- {pair}" for pair in every),
        "",
        "## Pairs the contract rules out",
        "",
        "| pair | why none runs |",
        "|---|---|",
        *(f"| {pair} | {why} |" for pair, why in ruled_out()),
        "",
    ]
    return "\n".join(lines)
