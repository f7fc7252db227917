"""A request: one history on one set of caches, as the engine's books record it.

The books are the oracle's side of a session: what the plan fed, kept, moved and reset, never
what a cache says it holds. Every event reads them before it calls the caches and updates
them after; every check compares the caches against them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from kvcheck.harness import Recorder


@dataclass
class Request:
    """One history on one set of caches (one recorder per layer)."""

    name: str
    caches: list[Recorder] | None
    history: Tensor  # (batch, tokens fed since the caches' reset)
    steps: int = 0
    offered: frozenset[str] = field(default_factory=frozenset)  # its caches' capabilities
    # Rows of their own (contract, section 8.1): each row's history, once fed by row, and
    # the position of each row's first token (section 8.3), as the plan set them.
    rows: list[Tensor] | None = None
    firsts: list[int] | None = None
    # After a context shift (section 8.4): what each layer should hold, (keys, values), in the
    # model's dtype and in float64 (the truth half precision is judged by); no uncached pass
    # over the tokens left computes it, so every later step runs the model over these rows.
    shifted: tuple[list[tuple[Tensor, Tensor]], list[tuple[Tensor, Tensor]]] | None = None
    # After a shift per row (section 8.4): for each row, alone at batch 1, what each layer
    # should hold, in the model's dtype and in float64, as ``shifted`` is for the batch.
    row_shifted: list[tuple[list[tuple[Tensor, Tensor]], list[tuple[Tensor, Tensor]]]] | None = None
    # Rows of garbage appended past its history (``Poison``): its history is over, and only
    # a reset, which sheds them, or its end may come next.
    poisoned: int = 0
    salt: object = None  # its tenant, for a prefix-caching pool (section 9.1)
    looked_up: int = 0  # the tokens its last prefix lookup declared
    # Its last event's kind and the state it left (kvcheck.interplay): the next event on it
    # completes a pair of the two.
    last_event: tuple[str, str] | None = None

    @property
    def held(self) -> int:
        """The tokens its caches hold: the longest row's, where rows have their own."""
        if self.rows is not None:
            return max((len(row) for row in self.rows), default=0)
        return self.history.shape[1]

    @property
    def path(self) -> str:
        return self.caches[0].path if self.caches else "append"

    @property
    def batch(self) -> int:
        return self.history.shape[0] if self.rows is None else len(self.rows)

    def row_lengths(self) -> list[int]:
        """Each row's tokens held: a batch fed as one gives every row its history's."""
        return (
            [len(row) for row in self.rows] if self.rows is not None else [self.held] * self.batch
        )

    def own_rows(self) -> list[Tensor]:
        """Each row's history. A batch fed as one so far gives every row that history, and
        from then on the rows are books of their own."""
        if self.rows is None:
            self.rows = list(self.history)
        return self.rows

    def row_firsts(self) -> list[int]:
        """Each row's first position as the plan set it (never the cache's own claim). Asking
        leaves a batch fed as one as it is (``own_rows`` would give it rows of their own)."""
        return self.firsts or [0] * self.batch

    def shared_first(self) -> int:
        """The position of the first token, for a batch fed as one (its rows share it)."""
        firsts = set(self.row_firsts()) if self.firsts else {0}
        if len(firsts) > 1:
            raise TypeError(f"{self.name}'s rows start at {sorted(firsts)}: feed it by row")
        return firsts.pop()
