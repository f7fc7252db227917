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

A batch whose rows are requests of their own (contract, section 8) has events of its own:
rows fed a count each, rolled back per row, rows leaving, a request joining, every row
restarting at a position of its own. Their pairs are with each other, in states of the rows'
lengths (``ROW_STATES``): ``empty``, ``even`` (every row the same length), ``apart`` (rows of
different lengths) and ``a row full``. A walk keeps to one of the two vocabularies.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from kvcheck import grammar
from kvcheck import strategies as kvst
from kvref.reprs import short_repr

STATES = ("empty", "warm", "page edge", "full")
ROW_STATES = ("empty", "even", "apart", "a row full")
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


def rows_state(rows: tuple[int, ...], max_length: int) -> str:
    """The state of a batch whose rows hold ``rows`` tokens each (rows of their own)."""
    if not any(rows):
        return "empty"
    if max(rows) >= max_length:
        return "a row full"
    return "even" if len(set(rows)) == 1 else "apart"


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
    rows: bool = False  # an event on rows of their own (section 8): its states, ROW_STATES

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
    # Rows of their own (section 8): each needs append_rows besides its own method.
    Kind("feed rows", "append_rows", ROW_STATES, ROW_STATES[1:], rows=True),
    Kind(
        "truncate rows",
        "truncate_rows",
        ROW_STATES[1:],
        ROW_STATES,
        why_not="rows that hold nothing keep nothing of nothing",
        rows=True,
    ),
    Kind("select rows", "select_rows", ROW_STATES, ROW_STATES, rows=True),
    Kind("join", "join", ROW_STATES, ROW_STATES[1:], rows=True),
    Kind(
        "shift rows",
        "shift per row",
        ROW_STATES[1:],
        ROW_STATES,
        why_not="rows that hold nothing have no span to discard",
        rows=True,
    ),
    Kind(
        "reset rows",
        "reset_at",
        ROW_STATES[1:],
        ("empty",),
        why_not="nothing to reset",
        rows=True,
    ),
)
BY_NAME = {kind.name: kind for kind in KINDS}


# The rows a batch with rows of their own starts with, in the walks: three, so that two rows
# may leave and two requests join in turn.
ROWS_BUILT = 3


def kinds_offered(offered: set[str] | frozenset[str], batch: int = ROWS_BUILT) -> list[Kind]:
    """The kinds a cache offering ``offered`` runs, its batch with rows of their own built
    for ``batch`` rows. A join needs a row free, so rows that left first (``select_rows``):
    a cache may refuse a join past the rows it was built for (8.1)."""
    rows = "append_rows" in offered  # every event on rows of their own feeds them so
    joins = batch >= 2 and "select_rows" in offered
    return [
        kind
        for kind in KINDS
        if (kind.needs is None or kind.needs in offered)
        and (rows or not kind.rows)
        and (joins or kind.name != "join")
    ]


def _left(kind: Kind, before: str) -> tuple[str, ...]:
    return (before,) if kind.leaves == (SAME,) else kind.leaves


def pair_name(first: str, state: str, then: str) -> str:
    return f"{first} → [{state}] → {then}"


def offered_pairs(offered: set[str] | frozenset[str], batch: int = ROWS_BUILT) -> list[str]:
    """Every pair ``A → [s] → B`` a cache offering ``offered`` can run, in vocabulary order
    (a batch with rows of their own built for ``batch`` rows: two joins in turn need 3)."""
    kinds = kinds_offered(offered, batch)
    pairs = []
    for first in kinds:
        left = dict.fromkeys(s for before in first.runs_in for s in _left(first, before))
        for state in left:
            pairs += [pair_name(first.name, state, then.name) for then in _alike(first, kinds)]
    return [pair for pair in pairs if not _ruled_out(pair) and _room_for(pair, batch)]


def _room_for(pair: str, batch: int) -> bool:
    """Whether a batch built for ``batch`` rows has room for ``pair``: rows apart are two
    or more, so are those a join leaves and a full row a shift left (another row shifted);
    a join needs a row free besides those, and a feed beside a full row a second row."""
    first, state, then = split(pair)
    shifted_full = first == "shift rows" and state == "a row full"  # another row shifted
    rows = 2 if state == "apart" or first == "join" or shifted_full else 1
    if then == "join":
        rows += 1
    elif then == "feed rows" and state == "a row full":  # a row with room beside the full
        rows = max(rows, 2)
    return rows <= batch


def _alike(first: Kind, kinds) -> list[Kind]:
    """The kinds that may follow ``first``: those of its vocabulary (the batch's, or rows of
    their own's)."""
    return [kind for kind in kinds if kind.rows == first.rows]


# Pairs the contract rules out whatever the state, and why.
NEVER_AFTER = {
    ("reset rows", "join"): "a reset returns the batch to the rows its caches were built for "
    "(8.3), and a cache may refuse a join past them (8.1)",
}


def _ruled_out(pair: str) -> bool:
    first, state, then = split(pair)
    return state not in BY_NAME[then].runs_in or (first, then) in NEVER_AFTER


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
            for then in _alike(first, KINDS):
                if state not in then.runs_in:
                    found.append((pair_name(first.name, state, then.name), then.why_not))
                elif why := NEVER_AFTER.get((first.name, then.name)):
                    found.append((pair_name(first.name, state, then.name), why))
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
    order: tuple[int, ...] | None = None  # a reorder's, a select's rows; None: the walk's choice
    # On rows of their own: each row's length it leaves (``length`` is the longest's).
    rows: tuple[int, ...] | None = None
    starts: tuple[int, ...] | None = None  # a shift per row's first position of each span

    def describe(self) -> str:
        detail = "" if self.start is None else f" from {self.start}"
        if self.rows is not None:
            order = "" if self.order is None else f" {list(self.order)}"
            starts = "" if self.starts is None else f" from {list(self.starts)}"
            return f"{self.kind}{order}{starts}, rows to {list(self.rows)}"
        detail += "" if self.order is None else f" by {list(self.order)}"
        return f"{self.kind} to {self.length}{detail}"

    def weight(self, before: Step | None) -> int:
        """What it counts toward an exhaustive walk's tokens, after the step ``before`` (None:
        the first): the tokens a feed brings (to every row), a joining request's prompt, a
        tree's three drafted ones, one for every other event (else walks of resets, reorders
        or forks alone would never end)."""
        if self.kind in FEEDS:
            return self.length - (before.length if before else 0)
        if self.kind == "feed rows":  # rows fed keep their number: the first from zeros
            return sum(self.rows) - (sum(before.rows) if before else 0)
        if self.kind == "join":
            return self.rows[-1]
        return 3 if self.kind == TREE else 1


def covering_walks(
    offered: set[str] | frozenset[str],
    most: int,
    page: int,
    longest: int = 24,
    batch: int = ROWS_BUILT,
) -> tuple[tuple[Step, ...], ...]:
    """``_covering_walks``, built once per worker for each set of events and sizes (a
    search over rows' lengths takes most of a second, and every test of ``interactions``
    asks for the walks of its cache)."""
    return _covering_walks(frozenset(offered), most, page, longest, batch)


@functools.cache
def _covering_walks(
    offered: frozenset[str], most: int, page: int, longest: int, batch: int
) -> tuple[tuple[Step, ...], ...]:
    """Walks from empty caches (built for ``most`` tokens, pages of ``page`` rows; a batch
    with rows of their own, for ``batch`` rows) that between them run every pair of
    ``offered_pairs``, by construction. From where a walk stands (its last event and the
    lengths it left) it takes the fewest steps to a pair not yet run, ending where most pairs
    remain. A walk ends before it would pass ``longest`` events, so that a failure names a
    short plan (one whose way from empty caches alone is longer is as long as that way), and
    the next starts afresh; pairs no walk can reach (none, for these kinds) are left out."""
    todo = set(offered_pairs(offered, batch))
    kinds = kinds_offered(offered, batch)
    walks: list[tuple[Step, ...]] = []
    walk: list[Step] = []
    while todo:
        path = _way_to_a_pair(walk[-1] if walk else None, todo, kinds, (most, page, batch))
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
    return tuple(walks)


@functools.lru_cache(maxsize=20_000)  # the searches of one set of walks ask again and again
def _moves(here: Step | None, kinds: tuple[Kind, ...], most: int, page: int, batch: int):
    return tuple(_each_move(here, kinds, most, page, batch))


def _each_move(here: Step | None, kinds: tuple[Kind, ...], most: int, page: int, batch: int):
    """Every step possible after ``here`` (None: empty caches, before any event): of the
    batch's vocabulary, or of rows of their own (``batch`` of them at first)."""
    if here is None or here.rows is None:
        held = 0 if here is None else here.length
        state = state_of(held, most, page)
        for then in kinds:
            if not then.rows and state in then.runs_in:
                for length in then.lengths(held, most, page):
                    yield Step(then.name, length, state_of(length, most, page))
    if here is None or here.rows is not None:
        rows = (0,) * batch if here is None else here.rows
        state = rows_state(rows, most)
        for then in kinds:
            if then.rows and state in then.runs_in:
                for after, given in _row_moves(then.name, rows, most, page, batch):
                    yield Step(then.name, max(after), rows_state(after, most), rows=after, **given)


def _row_moves(name: str, rows: tuple[int, ...], most: int, page: int, built: int):
    """The lengths an event on rows of their own can leave rows holding ``rows`` tokens in
    (with a select's rows kept), one per state it can reach from there, of caches built
    for ``built`` rows of ``most`` tokens (pages of ``page``): as ``Kind.lengths``."""
    batch, longest = len(rows), max(rows)
    if name == "feed rows":  # a token each, the rows evened out, drawn apart, one filled,
        # and the last row to the next page edge; a full row idle beside the others
        edge = (rows[-1] // page + 1) * page
        fed = {
            tuple(n + 1 for n in rows),
            (longest + 1,) * batch,
            (rows[0] + 2, *(n + 1 for n in rows[1:])),
            (most, *rows[1:]),
            (*rows[:-1], edge),
        }
        for after in sorted(fed):
            after = tuple(min(most, n) for n in after)
            if after != rows and all(a >= n for a, n in zip(after, rows, strict=True)):
                yield after, {}
    elif name == "truncate rows":  # to the shortest, the first row emptied, one back each,
        # to each row's page edge, every row emptied (none back too: a rollback of nothing)
        kept = {
            (min(rows),) * batch,
            (0, *rows[1:]),
            tuple(max(0, n - 1) for n in rows),
            tuple(n // page * page for n in rows),
            (0,) * batch,
        }
        yield from ((after, {}) for after in sorted(kept))
    elif name == "select rows":  # every row in reverse, and the first leaving
        for order in sorted({tuple(range(batch))[::-1], tuple(range(1, batch)) or (0,)}):
            yield tuple(rows[b] for b in order), {"order": order}
    elif name == "shift rows":  # each row's head, middle or tail span, or the first row's
        # whole history beside the others' first token (every later key moves)
        yield from _row_shifts(rows, page)
    elif name == "join" and batch < built:  # a request of one row: a token, as long as the
        # longest row, a page, full
        for prompt in sorted({1, max(1, longest), page, most}):
            yield (*rows, prompt), {}
    elif name == "reset rows" and batch == built:  # as the caches were built (8.3)
        yield (0,) * batch, {}


def _row_shifts(rows: tuple[int, ...], page: int):
    """Spans per row a shift discards (row b's from ``starts[b]``), as (lengths left,
    starts): each row one token from its head, two from its middle, a page from its tail,
    the first row's whole history beside every other row's first token, and the last row's
    first token alone (a full row beside it stays full); a row too short discards what it
    has."""
    spans = [
        [(0, min(1, n)) for n in rows],
        [*((0, 0) for _ in rows[:-1]), (0, min(1, rows[-1]))],
        [(n // 2, min(2, n - n // 2)) for n in rows],
        [(max(0, n - page), min(page, n)) for n in rows],
        [(0, rows[0]), *((0, min(1, n)) for n in rows[1:])],
    ]
    for span in dict.fromkeys(tuple(span) for span in spans):
        if any(count for _, count in span):
            left = tuple(n - count for n, (_, count) in zip(rows, span, strict=True))
            yield left, {"starts": tuple(start for start, _ in span)}


def _way_to_a_pair(here, todo: set[str], kinds: list[Kind], sizes: tuple[int, int, int]):
    """The fewest steps from ``here`` whose last runs a pair of ``todo``, ending where most
    of ``todo`` remain (breadth first over (event, lengths left)); ``sizes`` are the most
    tokens, the page and the rows built, as ``_moves`` takes them. From a step, a walk keeps
    to its vocabulary. The search gives up past ``SEARCHED`` steps seen (the rows' lengths
    are many): the next walk starts from empty caches, where every offered pair is in reach
    (tests/test_interactions.py holds every offered pair run)."""
    kinds = tuple(kinds)  # for _moves' cache
    if here is not None:
        todo = {pair for pair in todo if BY_NAME[split(pair)[0]].rows == (here.rows is not None)}
    remaining: dict[tuple[str, str], int] = {}
    for pair in todo:
        first, state, _ = split(pair)
        remaining[(first, state)] = remaining.get((first, state), 0) + 1
    frontier: list[tuple[Step | None, list[Step]]] = [(here, [])]
    seen: set[tuple] = set()
    while frontier:
        found, ahead = [], []
        for node, path in frontier:
            for step in _moves(node, kinds, *sizes):
                if node is not None and pair_name(node.kind, node.state, step.kind) in todo:
                    found.append([*path, step])
                # Steps that leave the same lengths by another order or span go on alike.
                if (where := (step.kind, step.length, step.rows)) not in seen:
                    seen.add(where)
                    ahead.append((step, [*path, step]))
        if found:
            return max(found, key=lambda path: remaining.get((path[-1].kind, path[-1].state), 0))
        if len(seen) > SEARCHED:
            return None
        frontier = ahead
    return None


SEARCHED = 5000


def fewest_steps_to(
    pair: str, offered: frozenset[str], most: int, page: int, batch: int = ROWS_BUILT
) -> tuple[Step, ...] | None:
    """The walk of fewest events from empty caches that ends by running ``pair`` (sizes as
    ``covering_walks`` takes them), or None where none does within the search."""
    kinds = kinds_offered(offered, batch)
    path = _way_to_a_pair(None, {pair}, kinds, (most, page, batch))
    return tuple(path) if path else None


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
    """Every walk from empty caches built for ``tokens`` tokens and ``batch`` rows, of the
    kinds a cache offering ``offered`` runs (of those, ``kinds`` alone where given), each
    event with every parameter it takes (every length it can leave, every span a shift
    discards, every order of the rows; on rows of their own every row's count, every length
    each row keeps, every selection of rows, every prompt that joins), whose weights
    (``Step.weight``) add up to at most ``tokens``; fewest first, in vocabulary order.

    Their count: of the kinds every cache runs (prefill, decode, chunk, reset), P(tokens + 1)
    - 1, P the Pell numbers (0, 1, 2, 5, 12, 29, ...): a walk is sessions of 2^(w - 1)
    splits of w tokens each, between resets (tests/test_exhaustive_interactions.py)."""
    taken = [kind for kind in kinds_offered(offered, batch) if kinds is None or kind.name in kinds]

    def moves(here: Step | None, left: int):
        for step in _every_move(here, taken, tokens, batch):
            if (cost := step.weight(here)) <= left:
                yield (step,), step, cost

    walks = grammar.sentences(tokens, None, moves, lambda here: here is not None, at_most=True)
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
    return sum(step.weight(before) for before, step in zip((None, *walk), walk, strict=False))


def _every_move(here: Step | None, kinds: list[Kind], most: int, batch: int) -> Iterator[Step]:
    """Every step after ``here`` (None: empty caches) with every parameter it takes: of the
    batch's vocabulary, or of rows of their own (``batch`` of them at first)."""
    if here is None or here.rows is None:
        yield from _every_batch_move(0 if here is None else here.length, kinds, most, batch)
    if here is None or here.rows is not None:
        rows = (0,) * batch if here is None else here.rows
        state = rows_state(rows, most)
        for kind in kinds:
            if kind.rows and state in kind.runs_in:
                for after, given in _every_row_move(kind.name, rows, most, batch):
                    yield Step(kind.name, max(after), rows_state(after, most), rows=after, **given)


def _every_batch_move(held: int, kinds: list[Kind], most: int, batch: int) -> Iterator[Step]:
    state = state_of(held, most, page=most)  # no page: "page edge" is the full caches' alone
    for kind in kinds:
        if kind.rows or state not in kind.runs_in:
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


def _every_row_move(name: str, rows: tuple[int, ...], most: int, built: int):
    """Every lengths an event on rows of their own can leave ``rows`` at (with a select's
    rows kept): the whole domain of which ``_row_moves`` are the representatives."""
    if name == "feed rows":  # every row's count, one token at least in all
        for after in itertools.product(*(range(n, most + 1) for n in rows)):
            if after != rows:
                yield after, {}
    elif name == "truncate rows":  # every length each row keeps
        yield from ((after, {}) for after in itertools.product(*(range(n + 1) for n in rows)))
    elif name == "select rows":  # every order of every rows kept
        for kept in range(1, len(rows) + 1):
            for order in itertools.permutations(range(len(rows)), kept):
                yield tuple(rows[b] for b in order), {"order": order}
    elif name == "shift rows":  # every span of each row, one token discarded at least
        spans = [  # a row that discards nothing is one span, whatever its start
            [
                (0, 0),
                *((start, count) for count in range(1, n + 1) for start in range(n - count + 1)),
            ]
            for n in rows
        ]
        for span in itertools.product(*spans):
            if any(count for _, count in span):
                left = tuple(n - count for n, (_, count) in zip(rows, span, strict=True))
                yield left, {"starts": tuple(start for start, _ in span)}
    elif name == "join" and len(rows) < built:  # a request of one row, every prompt
        yield from (((*rows, prompt), {}) for prompt in range(1, most + 1))
    elif name == "reset rows" and len(rows) == built:
        yield (0,) * len(rows), {}


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
        "The events on a batch whose rows are requests of their own (contract, section 8: each",
        "needs `append_rows` besides its own method) make pairs with each other, in states of",
        "the rows' lengths: `empty`, `even` (every row the same length), `apart` (rows of",
        "different lengths), `a row full`. A join needs a row free, so rows that left first:",
        f"the walks build the batch for {ROWS_BUILT} rows, or fewer where the cache declares",
        "fewer, and then offer no pair that needs more rows than that (a join after rows apart",
        "or after a join needs three).",
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
