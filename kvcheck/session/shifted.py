"""The oracle after a context shift (contract, section 8.4).

No uncached pass over the tokens a shift leaves computes what a shifted cache holds: their
keys were rotated for positions they no longer have. So from a request's first shift on the
oracle keeps the rows themselves (``Request.shifted`` for the batch, ``Request.row_shifted``
for each row alone at batch 1), shifts them as the cache should
(``kvref.shift_oracle.shifted_rows``,
in ``kvcheck.session.events.shift``) and runs the model over them for every later step, in the
model's dtype and in float64. This module builds those rows and moves them on with a step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from kvcheck import asserts as kvassert
from kvcheck.session.events.base import Session
from kvref import ReferenceTransformer
from kvref.protocol import keys_stored
from kvref.shift_oracle import HeldRows

if TYPE_CHECKING:
    from kvcheck.session.request import Request


def oracles(engine: Session) -> tuple[ReferenceTransformer, ...]:
    """The models a row's oracle runs: the float64 one beside the model only where it
    judges (half precision, ``kvcheck.asserts.needs_reference``)."""
    if kvassert.needs_reference(engine.model.dtype):
        return engine.model, engine.truth
    return (engine.model,)


def batch_rows(engine: Session, request: Request) -> tuple[list, list]:
    """What every layer holds so far, in the model's dtype and in float64: the uncached
    pass's rows over the history."""
    kept = {"start_position": request.shared_first(), "keys": keys_stored(request.caches[0])}
    _, rows = engine.model.forward_with_kv(request.history, **kept)
    _, truth = engine.truth.forward_with_kv(request.history, **kept)
    return rows, truth


def row_rows(engine: Session, request: Request, row: int):
    """What every layer holds for ``row`` so far, at batch 1, in the model's dtype and in
    float64: the uncached pass over its history at its positions (none for an empty row)."""
    history = request.rows[row][None]
    kept = {
        "start_position": request.row_firsts()[row],
        "keys": keys_stored(request.caches[0]),
    }
    if history.shape[1]:
        rows = [model.forward_with_kv(history, **kept)[1] for model in oracles(engine)]
        return rows[0], rows[-1]
    return tuple(
        [
            tuple(part[None, :, :0].to(dtype) for part in cache.rows_given[row])
            for cache in request.caches
        ]
        for dtype in (engine.model.dtype, torch.float64)
    )


def follow(request: Request, edit: Callable[[Tensor], Tensor]) -> None:
    """A whole-batch shift's oracle after an edit that moves no position (a truncate keeps a
    head of the rows, a reorder takes other rows of the batch): ``edit`` applied to every
    layer's keys and values, in both dtypes."""
    if request.shifted is not None:
        request.shifted = tuple(
            [(edit(keys), edit(values)) for keys, values in rows] for rows in request.shifted
        )


def after_shift(
    engine: Session, request: Request, new: Tensor
) -> tuple[Tensor, Callable[[], Tensor]]:
    """The model's logits for ``new`` over the rows the oracle holds, and the float64
    model's over its own; both oracles take the new rows."""
    first, stored = request.shared_first(), keys_stored(request.caches[0])
    answers = []
    for model, rows in zip((engine.model, engine.truth), request.shifted, strict=True):
        held = [HeldRows(keys, values, first, stored) for keys, values in rows]
        answers.append((model(new, caches=held), [(c.keys, c.values) for c in held]))
    (expected, rows), (truth, truth_rows) = answers
    request.shifted = (rows, truth_rows)
    return expected, lambda: truth


def after_row_shift(
    engine: Session, request: Request, row: int, tokens: Tensor
) -> tuple[Tensor, Tensor]:
    """``row``'s logits for ``tokens`` at batch 1 over the rows its oracle holds, in the
    model's dtype and (where it judges) in float64; both of its oracles take the new rows."""
    first, stored = request.row_firsts()[row], keys_stored(request.caches[0])
    answers = []
    for model, rows in zip(oracles(engine), request.row_shifted[row], strict=False):
        held = [HeldRows(keys, values, first, stored) for keys, values in rows]
        answers.append((model(tokens[None], caches=held), [(c.keys, c.values) for c in held]))
    (expected, rows), (truth, truth_rows) = answers[0], answers[-1]
    request.row_shifted[row] = (rows, truth_rows)
    return expected, truth
