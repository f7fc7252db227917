"""The comparisons every event's checks share: cached logits against the oracle's
(``assert_logits``), and, when they differ, which layer's cache went wrong first
(``diagnose``, ``first_wrong_layer``); ``row_said`` names a row of a batch with rows of
their own in a message."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from kvcheck import asserts as kvassert
from kvcheck import failures, reach
from kvref import ReferenceTransformer
from kvref.protocol import keys_stored
from kvref.quantized import Quantized

if TYPE_CHECKING:
    from kvcheck.session.request import Request


def row_said(row: int, first: int, lengths: list[int]) -> str:
    """A row of a batch with rows of their own, for a message: its length before the call,
    its first position, and its neighbours' lengths (a row must not depend on them)."""
    neighbours = [n for b, n in enumerate(lengths) if b != row]
    return (
        f"row {row} (held {lengths[row]} tokens before this call, from position {first}; its "
        f"neighbours held {neighbours})"
    )


# On the attend path a cache computes attention in another order than the model does, so its
# logits differ from the uncached model's by rounding, which an ill-conditioned model (a
# residual of width 2, say, normalized by RMSNorm) can amplify past a fixed tolerance at a
# position. There they are held to what the uncached run in the same dtype does: no further
# from the float64 model than this many times its distance, plus the tolerance. On the
# append path the cached model computes exactly what the uncached one does, bit for bit.
ATTEND_PATH_FACTOR = 2.0


def assert_logits(
    logits: Tensor,
    expected: Tensor,
    reference: Callable[[], Tensor],
    *,
    where: str,
    start: int,
    path: str,
    what: str = "cached and uncached logits",
    lossy: Quantized | None = None,
    budgets: dict = kvassert.BUDGETS,
    rows_held: Callable[[], None] | None = None,
) -> None:
    """Cached ``logits`` against the uncached model's ``expected``: at the dtype's tolerance
    (in half precision, its error budget against the float64 model's logits, ``reference()``);
    on the attend path, a gap past the tolerance is allowed where the uncached run is itself
    as far from the float64 model (``ATTEND_PATH_FACTOR``); with ``lossy`` storage declared,
    its budget on top (``kvcheck.asserts.LOSSY_FACTOR``). A gap past that budget, off the
    attend path, goes to ``rows_held`` (the check of every row the caches returned against
    its declared bound, raising where one is not): see ``LOSSY_GAP_OF_THE_MODEL``."""
    __tracebackhide__ = True
    half = kvassert.needs_reference(expected.dtype)
    try:
        kvassert.assert_close_at(
            logits,
            expected,
            what=what,
            where=where,
            position_axis=1,
            first_position=start,
            reference=reference() if half else None,
            lossy=lossy,
            budgets=budgets,
        )
    except failures.WrongResults as error:
        if lossy is not None and path != "attend" and rows_held is not None:
            rows_held()  # the sharp check: a row past its bound fails here, naming it
            reach.note(LOSSY_GAP_OF_THE_MODEL)
            return
        if half or path != "attend" or logits.shape != expected.shape:
            raise
        truth = reference()
        cached = kvassert.position_errors(logits, truth, 1)
        uncached = kvassert.position_errors(expected, truth, 1)
        tolerance = kvassert.TOLERANCES[expected.dtype]
        scale = truth.double().abs().movedim(1, 0).flatten(1).amax(dim=1)
        allowed = ATTEND_PATH_FACTOR * uncached + tolerance["atol"] + tolerance["rtol"] * scale
        if (cached <= allowed).all():  # a nan is never allowed
            return
        worst = int((cached - allowed).argmax())
        error.add_note(
            f"  on the attend path the gap is also beyond {ATTEND_PATH_FACTOR:g} x the uncached "
            f"run's own distance from the float64 model + the tolerance: at absolute position "
            f"{start + worst}, |cached - float64| {cached[worst].item():.3g} against "
            f"{allowed[worst].item():.3g} allowed (the uncached run is {uncached[worst].item():.3g}"
            f" from float64)"
        )
        raise


# Lossy storage (contract, section 10.1): off the attend path the model attends over exactly
# the rows the caches returned, so cached logits are the model's over rows each of which the
# row check holds to its declared bound. A gap past LOSSY_FACTOR with every row within its
# bound is the model's amplification of errors the contract allows (an ill-conditioned draw:
# a residual 2 wide whose RMS at a position is near 0, where RMSNorm multiplies a half step
# many times over), not the cache's: there the rows decide. Measured: with the budget made
# infinite, every mutant of the catalogue is still caught by the property that catches it.
LOSSY_GAP_OF_THE_MODEL = "lossy logits past the budget, every row within its bound"


def diagnose(error: BaseException, model: ReferenceTransformer, request: Request, first=0):
    """Add to ``error`` which layer's cache went wrong first (``first_wrong_layer``), and its
    root where that is a row (``failures.set_root``)."""
    rows: list[int] = []
    error.add_note(first_wrong_layer(model, request, first, rows))
    if rows:
        failures.set_root(error, rows[0])


def first_wrong_layer(
    model: ReferenceTransformer, request: Request, first: int = 0, found: list | None = None
) -> str:
    """Which layer's cache went wrong first (later layers inherit its error): the first whose
    returned rows differ from the uncached pass's keys and values (from position ``first``),
    or, on the attend path, whose attention differs from the reference attention over the
    rows it was given. The indices since the reset of the rows that differ go to ``found``."""
    stored = keys_stored(request.caches[0])
    _, uncached = model.forward_with_kv(request.history, start_position=first, keys=stored)
    for layer, cache in enumerate(request.caches):
        if cache.attended is not None:
            got, want = cache.attended_and_reference()
            if got.shape != want.shape or not torch.isclose(got, want, **_loose(want)).all():
                gap = (got.double() - want.double()).abs().nan_to_num(float("inf")).max().item()
                return (
                    f"  diagnosis: layer {layer} is the first whose attend() differs from the "
                    f"reference attention over the rows it was given (max |diff| {gap:.3g})"
                )
            continue
        for which, (name, got) in enumerate(zip(("keys", "values"), cache.returned, strict=True)):
            if cache.given_length != request.held:
                return (
                    f"  diagnosis: layer {layer}'s cache was given {cache.given_length} rows "
                    f"since its reset, but the history holds {request.held} tokens: the model "
                    f"fed it other tokens than the new ones"
                )
            held = cache.kept(got.shape[2]) if got.ndim == 4 else []
            want = uncached[layer][which][:, :, held]
            if got.shape != want.shape:
                return (
                    f"  diagnosis: layer {layer}'s cache returned {name} shaped "
                    f"{tuple(got.shape)}, not {tuple(want.shape)}"
                )
            far = ~torch.isclose(got, want, **_loose(want))
            if far.any():
                # The absolute positions of the rows that differ: where to look first.
                rows = far.movedim(2, 0).flatten(1).any(1).nonzero().flatten().tolist()
                positions = [first + held[row] for row in rows]
                if found is not None:
                    found.extend(held[row] for row in rows)
                return (
                    f"  diagnosis: layer {layer} is the first whose cache returned {name} "
                    f"unlike the uncached pass's, at absolute positions {positions[:8]}"
                    f"{' ...' if len(rows) > 8 else ''} ({len(rows)} of {len(held)} rows)"
                )
    if request.path == "attend":
        return (
            "  diagnosis: every layer's attend() is within a few roundings of the reference "
            "attention over the rows it was given; small differences added up through the "
            "layers (in half precision: an attend that accumulates below float32?)"
        )
    return (
        "  diagnosis: every layer's cache returned the uncached pass's keys and values, so the "
        "model used them wrongly (mask, positions) or the cache changed them after returning"
    )


def refusal_diagnosis(request: Request) -> str | None:
    """Where the model refused what a layer's cache returned (``kvref.guards``): the first
    layer whose last append returned keys and values that disagree with each other or with
    the rows it was given since its reset, and how; None where every layer's agree."""
    for layer, cache in enumerate(request.caches):
        if cache.returned is None:  # not called since its reset: a later layer
            continue
        keys, values = cache.returned
        if keys.ndim != 4 or values.ndim != 4:
            return (
                f"  diagnosis: layer {layer}'s cache returned keys of rank {keys.ndim} and "
                f"values of rank {values.ndim}, not 4 (batch, kv heads, rows, width)"
            )
        given, fewest = cache.given_length, cache.fewest_rows()
        since = "since its reset" if cache.resets else "since it was built"
        rows = {"keys": keys.shape[2], "values": values.shape[2]}
        wrong = {name: n for name, n in rows.items() if not fewest <= n <= given}
        if not wrong and rows["keys"] == rows["values"]:
            continue
        said = f"{rows['keys']} key rows and {rows['values']} value rows"
        if too_many := [name for name, n in wrong.items() if n > given]:
            came_back = "rows from before its reset" if cache.resets else "rows it was never given"
            why = f"{came_back} came back in its {' and '.join(too_many)}"
        elif wrong:
            why = f"its {' and '.join(wrong)} lost rows (it must return {fewest} at least)"
        else:
            why = "its keys and values disagree"
        return (
            f"  diagnosis: layer {layer}'s cache was given {given} rows {since} and returned "
            f"{said}: {why}"
        )
    return None


def _loose(tensor: Tensor) -> dict[str, float]:
    # A diagnosis, not a verdict: half precision at a few roundings.
    return kvassert.TOLERANCES.get(tensor.dtype, {"rtol": 2e-2, "atol": 2e-2})
