"""The events plans are written in: one vocabulary, drawn, shrunk and printed as the plan,
which each area's runner turns into session events (``kvcheck.session.events``) that act on
the caches and the oracle's books.

- On a request: ``Start`` (on fresh caches, or on a finished request's reset ones),
  ``Feed`` (a count of new tokens), ``Truncate`` (back from the end) and
  ``TruncateTo`` (to a position), ``Reorder``, ``Fork``, ``Reset``, ``Poison`` (rows of
  garbage left behind for a reset to shed), ``Move`` (to another layout: ``sharded``,
  ``move``) and ``Shift`` (a context shift).
- On a batch whose rows are requests of their own (contract, section 8), one per method, a
  value per row: ``FeedRows``, ``TruncateRows``, ``SelectRows``, ``Join``, ``ResetAt`` and
  ``ShiftRows``.
- On an engine's sequences (contract, section 13), which address their tokens by position:
  ``kvcheck.engine_events`` (a ``Decode`` of feeds at positions, ``Remove`` and ``Shift`` of
  a span of positions, ``Copy``, ``Clear``), below ``kvcheck.engines``.

A request is named by its number (``r0``, ``r1``, ...), never by an object, so that a plan
is a value Hypothesis shrinks and a failure prints a constructor (``drawn=``). The events an
area has alone stay in it: a serving request's arrival (what it is built from), a swap, a
recompute, a finish, the edits' forks that go on. One runner turns a request's events into
the session's (``kvcheck.session.Engine.play``), and one a batch's rows' (``RowsRun``).

Where every area draws an event's parameters alike, their strategy is here, over their whole
domain (``reorder_indices``, ``truncate_backs``): a form that finds bugs (a permutation of
every row, a rollback to a page edge) is drawn for every plan that has the event.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

from kvcheck.strategies import EDGE


@dataclass(frozen=True)
class Start:
    """Request ``request`` starts on fresh caches, or on the reset caches of ``reuse``, a
    request before it that a ``Reset`` emptied: the next session of a long-lived cache, a
    scheduler's slot given to a new request."""

    request: int
    batch: int
    reuse: int | None = None

    def describe(self) -> str:
        caches = "fresh caches" if self.reuse is None else f"the reset caches of r{self.reuse}"
        return f"r{self.request} starts (batch {self.batch}, {caches})"


@dataclass(frozen=True)
class Feed:
    """Request ``request`` is fed its next ``size`` tokens: its prompt, a chunk of it, a
    draft, or a decode step. Where a prefix hit already holds some of them (serving pools),
    only the rest are fed."""

    request: int
    size: int

    def describe(self) -> str:
        return f"r{self.request} is fed {self.size} token{'s' * (self.size != 1)}"


@dataclass(frozen=True)
class Truncate:
    """Request ``request`` forgets its last ``back`` tokens, or all when it holds fewer (a
    draft rejected, an answer regenerated; where truncate is offered)."""

    request: int
    back: int

    def describe(self) -> str:
        return f"r{self.request} forgets its last {self.back} tokens"

    def target(self, held: int) -> int:
        """The tokens left of ``held``."""
        return max(held - self.back, 0)


@dataclass(frozen=True)
class TruncateTo:
    """Request ``request`` forgets every token at position ``position`` or later (none where
    it holds fewer): back to the start of a long history, past what a window keeps."""

    request: int
    position: int

    def describe(self) -> str:
        return f"r{self.request} forgets every token from position {self.position}"

    def target(self, held: int) -> int:
        """The tokens left of ``held``."""
        return min(self.position, held)


@dataclass(frozen=True)
class Reorder:
    """Request ``request``'s batch row b becomes its old row ``indices[b]`` (beam search;
    where reorder is offered)."""

    request: int
    indices: tuple[int, ...]

    def describe(self) -> str:
        return f"r{self.request} reorders its rows as {list(self.indices)}"


@st.composite
def reorder_indices(draw, batch: int) -> tuple[int, ...]:
    """The indices of a reorder of ``batch`` rows over their whole domain: any, repeats
    too (the identity among them); a permutation of every row (random draws of 3 or 4 rows
    seldom are one); the rows reversed; one row for all (a beam that won everywhere)."""
    rows = st.integers(0, batch - 1)
    return draw(
        st.one_of(
            st.lists(rows, min_size=batch, max_size=batch).map(tuple),
            st.permutations(range(batch)).map(tuple),
            st.just(tuple(reversed(range(batch)))),
            rows.map(lambda row: (row,) * batch),
        ),
        label="reorder indices",
    )


@st.composite
def truncate_backs(draw, held: int) -> int:
    """The tokens a truncate of a request holding ``held`` goes back, over its whole domain:
    none, one, any, back to the last page edge below (a rollback into a block written
    full), or all of them."""
    edge = held - (held - 1) // EDGE * EDGE if held > EDGE else held
    forms = st.sampled_from(sorted({0, min(1, held), edge, held})) | st.integers(0, held)
    return draw(forms, label="truncate back")


@dataclass(frozen=True)
class Fork:
    """Request ``child`` is a fork of ``parent``: a parallel sample, a prompt shared (its
    caches' ``fork()``; where fork is not offered, fresh caches fed the parent's history)."""

    parent: int
    child: int

    @property
    def request(self) -> int:
        """The request the event makes: its child."""
        return self.child

    def describe(self) -> str:
        return f"r{self.child} = fork of r{self.parent}"


@dataclass(frozen=True)
class Reset:
    """Request ``request`` is emptied, its caches kept for what it is fed next."""

    request: int

    def describe(self) -> str:
        return f"r{self.request} is reset"


@dataclass(frozen=True)
class Poison:
    """Request ``request`` is left ``rows`` rows of nan, inf, -inf or huge values (``kind``,
    ``kvcheck.tensors.POISON_VALUES``) past its history, appended to every layer: garbage
    the reset or the fresh caches after it must shed."""

    request: int
    kind: str
    rows: int

    def describe(self) -> str:
        return f"r{self.request} is left {self.rows} {self.kind} row{'s' * (self.rows != 1)}"


@dataclass(frozen=True)
class Move:
    """Request ``request``'s caches are moved to the plan's layout ``layout``: exported and
    imported into caches of another kind, block size or shard count (contract, section 11.2;
    where move is offered)."""

    request: int
    layout: int

    def describe(self) -> str:
        return f"r{self.request} moves to layout {self.layout}"


@dataclass(frozen=True)
class Shift:
    """Request ``request`` discards ``count`` tokens from index ``start``, the keys after the
    span re-rotated to their new positions (a context shift, contract section 8.4)."""

    request: int
    start: int
    count: int

    def describe(self) -> str:
        return f"r{self.request} shift({self.start}, {self.count})"


# The capability of the caches each event of a request needs, where it needs one: where it
# is not offered, the event is left out (``kvcheck.session.Engine.offers``).
NEEDS = {Truncate: "truncate", TruncateTo: "truncate", Shift: "shift", Reorder: "reorder"}


# --- Rows of their own (contract, section 8): one batch, a value per row ---


@dataclass(frozen=True)
class FeedRows:
    """Row b is fed ``counts[b]`` new tokens in one call (``append_rows``; 0: its slot a
    pad)."""

    counts: tuple[int, ...]

    def describe(self) -> str:
        return f"rows fed {list(self.counts)}"


@dataclass(frozen=True)
class TruncateRows:
    """Row b keeps its first ``keep[b]`` tokens (``truncate_rows``)."""

    keep: tuple[int, ...]

    def describe(self) -> str:
        return f"truncate_rows to {list(self.keep)}"


@dataclass(frozen=True)
class SelectRows:
    """The batch becomes its rows ``kept``, in that order (``select_rows``): finished rows
    leave, the others stay or are reordered."""

    kept: tuple[int, ...]

    def describe(self) -> str:
        return f"select_rows {list(self.kept)}"


@dataclass(frozen=True)
class Join:
    """A request of one row per ``(prompt, first position)`` of ``joining``, prefilled alone
    (from those first positions where ``reset_at`` is offered), joins after the batch's last
    row (``join``)."""

    joining: tuple[tuple[int, int], ...]

    def describe(self) -> str:
        return f"a request prefilled alone with {list(self.joining)} (prompt, first position) joins"


@dataclass(frozen=True)
class ResetAt:
    """Every row empty, row b's next token at position ``firsts[b]`` (``reset_at``)."""

    firsts: tuple[int, ...]

    def describe(self) -> str:
        return f"reset_at {list(self.firsts)}"


@dataclass(frozen=True)
class ShiftRows:
    """Row b discards ``counts[b]`` tokens from index ``starts[b]`` (0: untouched), the keys
    after its span re-rotated (a shift per row, contract section 8.4)."""

    starts: tuple[int, ...]
    counts: tuple[int, ...]

    def describe(self) -> str:
        return f"shift({list(self.starts)}, {list(self.counts)})"
