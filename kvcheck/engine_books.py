"""The engine oracle's books of keys and values: what a KV cache holds, per sequence.

An engine keeps each token's keys and values as they were computed when it was decoded. A
removal leaves the tokens after the span with keys and values computed while the span was
still there, and a shift moves keys by rotation alone: in a model of more than one layer a
layer's keys and values depend on the context the token was decoded in, so after either the
engine's logits are not the uncached pass's over what the sequence holds (that pass
recomputes every kept token without the removed ones, at the new distances). Held to that
pass, every correct engine fails after a middle or head removal, and after a shift of part
of a sequence, once the model has two layers.

``CacheBooks`` is the reference model with a cache of its own per sequence: each decode runs
the reference's own blocks (``ReferenceTransformer._run`` with a positioned cache per layer)
and keeps the new keys (rotated at their positions) and values; ``remove`` drops rows,
``copy`` copies them, ``shift`` moves positions and re-rotates the keys (``kvref.rerotate``).
Where nothing was removed from before a token and nothing shifted, its rows are the uncached
pass's, and so are the logits.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvref import ReferenceTransformer
from kvref.engine import Step
from kvref.model import attention
from kvref.rope import rerotate


class _Rows:
    """One sequence's rows of one layer: keys (rotated at ``positions``) and values."""

    def __init__(self, truth: ReferenceTransformer) -> None:
        c, like = truth.config, {"dtype": truth.dtype, "device": truth.device}
        self.keys = torch.zeros((1, c.num_kv_heads, 0, c.head_dim), **like)
        self.values = torch.zeros((1, c.num_kv_heads, 0, c.head_dim), **like)
        self.positions = torch.zeros((0,), dtype=torch.long, device=truth.device)
        self.at: Tensor | None = None  # the positions of the step being decoded

    def attend(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        keys = torch.cat((self.keys, key), dim=2)
        values = torch.cat((self.values, value), dim=2)
        positions = torch.cat((self.positions, self.at))
        self.keys, self.values, self.positions = keys, values, positions
        return attention(query, keys, values, self.at, positions)

    def kept(self, inside: Tensor) -> None:
        self.keys, self.values = self.keys[:, :, ~inside], self.values[:, :, ~inside]
        self.positions = self.positions[~inside]

    def copied(self, truth: ReferenceTransformer) -> _Rows:
        rows = _Rows(truth)
        rows.keys, rows.values, rows.positions = self.keys, self.values, self.positions
        return rows


class CacheBooks:
    """Per sequence, per layer, the rows a KV cache holds after the events so far."""

    def __init__(self, truth: ReferenceTransformer, sequences: int) -> None:
        self.truth = truth
        self.rows = [self.fresh() for _ in range(sequences)]

    def fresh(self) -> list[_Rows]:
        return [_Rows(self.truth) for _ in range(self.truth.config.num_layers)]

    @torch.no_grad()
    def decode(self, step: Step) -> Tensor:
        """The logits of ``step``'s tokens over what its sequence holds; its rows then kept."""
        layers = self.rows[step.sequence]
        at = torch.tensor(step.positions, dtype=torch.long, device=self.truth.device)
        for rows in layers:
            rows.at = at
        tokens = torch.tensor([step.tokens], device=self.truth.device)
        logits, _ = self.truth._run(tokens, layers, int(at[0]), int(at[0]), positions=at)
        return logits[0]

    def span(self, rows: _Rows, start: int, end: int | None) -> Tensor:
        inside = rows.positions >= start
        return inside & (rows.positions < end) if end is not None else inside

    def remove(self, sequence: int, start: int, end: int | None) -> None:
        for rows in self.rows[sequence]:
            rows.kept(self.span(rows, start, end))

    def copy(self, source: int, target: int) -> None:
        self.rows[target] = [rows.copied(self.truth) for rows in self.rows[source]]

    def shift(self, sequence: int, start: int, end: int | None, delta: int) -> None:
        base = self.truth.config.rope_base
        for rows in self.rows[sequence]:
            inside = self.span(rows, start, end)
            keys = rows.keys.clone()
            keys[:, :, inside] = rerotate(rows.keys[:, :, inside], delta, base)
            rows.keys = keys
            rows.positions = torch.where(inside, rows.positions + delta, rows.positions)

    def clear(self) -> None:
        self.rows = [self.fresh() for _ in self.rows]
