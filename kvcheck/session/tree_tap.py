"""What a layer is given under a draft tree (contract, section 9.2), as the recorders need it.

``TreeTap`` stands between the model's ``forward_tree`` and a layer's recorder: the tree's
nodes go to the cache (the plan's poisoned nodes poisoned on the way) and what ``append_tree``
returns must be the committed rows, then the nodes as handed to it, bit for bit. The helpers
say which rows a layer holds before the tree and after a commit, and which of them may be in
codes under a declared storage (contract, 10.1).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvcheck import asserts as kvassert
from kvcheck import failures, reach
from kvcheck.harness import Recorder
from kvref.protocol import kept_rows

NODES_IN_CODES = "draft nodes held in codes"  # contract, 10.1


def committed_rows(recorder: Recorder, like: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """The rows a layer was given since its reset, (B, H_kv, L, D) each: by row where rows
    were fed their own (then all of one length here), else as one batch; none yet: empty
    keys and values shaped like ``like``'s (a latent layer's values are wider than its keys)."""
    if recorder.rows_given is not None:
        return tuple(torch.stack([row[which] for row in recorder.rows_given]) for which in (0, 1))
    if recorder.given is None:
        return tuple(rows[:, :, :0] for rows in like)
    return recorder.given


def coded_with_nodes(recorder: Recorder, length: int, row: int = 0) -> list[int]:
    """Keys' and values' rows of batch row ``row`` that may be in codes once a tree's nodes
    bring the rows given to ``length``: a node is a row as any other, in codes once out of
    the declared recent run (contract, 10.1); with rows of their own, from that row's own
    count."""
    before = recorder.rows_below[row] if recorder.rows_below else recorder.quantized_below
    return recorder.coded_below(before, length)


def committed_below(
    recorder: Recorder, held: int, nodes: int, length: int, row: int = 0
) -> list[int]:
    """The rows that may be in codes once a commit leaves ``length`` of the ``held`` and the
    ``nodes``: any accepted node may be one the tree had in codes, so every row is where
    some node may have been; else as the rows before the tree."""
    with_nodes = coded_with_nodes(recorder, held + nodes, row)
    after = coded_with_nodes(recorder, length, row)
    return [length if tree > held else part for tree, part in zip(with_nodes, after, strict=True)]


class TreeTap:
    """A layer's recorder as ``forward_tree`` sees it: ``append_tree`` goes to the cache with
    the poisoned nodes' keys and values replaced (per batch row) and lent as the recorder
    lends (scribbled over at that cache's next call), and what the cache returns must be the
    committed rows, then the nodes as handed to it, bit for bit. Everything else is the
    recorder's."""

    def __init__(
        self, recorder: Recorder, poisoned: tuple[tuple[int, ...], ...], poison: float, who: str
    ) -> None:
        self.recorder, self.poisoned, self.poison, self.who = recorder, poisoned, poison, who
        self.where = ""
        self.nodes: tuple[Tensor, Tensor] | None = None  # the node rows handed to the cache

    def __getattr__(self, name: str):
        if name == "recorder":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.recorder, name)

    @property
    def length(self) -> int:
        return self.recorder.length

    def append_tree(self, key: Tensor, value: Tensor, parents) -> tuple[Tensor, Tensor]:
        key, value = key.clone(), value.clone()
        for row, nodes in enumerate(self.poisoned):
            if nodes:
                key[row, :, list(nodes)] = self.poison
                value[row, :, list(nodes)] = self.poison
        recorder = self.recorder
        recorder.views = recorder.returned = recorder.rows_returned = None
        committed = committed_rows(recorder, (key, value))
        returned = recorder.cache.append_tree(*recorder._lend(key, value), parents)
        self.nodes = (key, value)
        self._check_returned(returned, committed)
        return returned

    def _check_returned(self, returned, committed) -> None:
        """Bit for bit the committed rows then the nodes, as many as returned (a window may
        return a recent run: rule 7); a count the model refuses is left to its guard."""
        if not (isinstance(returned, (tuple, list)) and len(returned) == 2):
            return
        for which, (name, got) in enumerate(zip(("keys", "values"), returned, strict=True)):
            nodes = self.nodes[which]
            given = torch.cat((committed[which], nodes), dim=2)
            shaped = isinstance(got, Tensor) and got.ndim == 4
            if not shaped or got.shape[:2] + got.shape[3:] != given.shape[:2] + given.shape[3:]:
                return
            if not 0 < got.shape[2] <= given.shape[2]:
                return
            kept = kept_rows(self.recorder.sinks, got.shape[2], given.shape[2])
            bad, beyond, row = self._rows_not_held(which, got, given, kept, nodes.shape[2])
            if bad:
                held = given.shape[2] - nodes.shape[2]
                index = kept[bad[0]]
                said = f"committed row {index}" if index < held else f"draft node {index - held}"
                raise failures.DataLoss(
                    f"{self.who}, batch row {row}: {name} row {index} that append_tree returned "
                    f"is not the {said} given there{beyond} ({len(bad)} of {got.shape[2]} rows "
                    f"returned differ: {[kept[i] for i in bad[:8]]})\n  at {self.where}"
                )

    def _rows_not_held(self, which: int, got, given, kept, nodes: int):
        """``kvassert.rows_not_held`` batch row by batch row, each by its own count of rows
        that may be in codes: the bad rows of the first row with any, their bound, the row."""
        for row in range(got.shape[0]):
            below = coded_with_nodes(self.recorder, given.shape[2], row)[which]
            if below > given.shape[2] - nodes:
                reach.note(NODES_IN_CODES)
            bad, beyond = kvassert.rows_not_held(
                self.recorder, which, got[row : row + 1], given[row : row + 1], kept, below
            )
            if bad:
                return bad, beyond, row
        return [], "", 0
