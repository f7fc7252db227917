"""Assertions with messages for a person at 2 a.m.: what differs, where, by how much.

Every message has one shape: ``{who}: {what went wrong}`` then a line ``  at {where}``,
where ``who`` names a layer (``layer 1``) or a cache (``cache B``) and ``where`` the step of
the plan. Each raises the ``kvcheck.failures`` class that says how serious the failure is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from kvcheck.failures import (
    AcceptsBadInput,
    DataLoss,
    PropertyFailure,
    RefusalChangedState,
    UnclearError,
    WrongResults,
)
from kvcheck.strategies import random_rows

TOLERANCES = {
    torch.float64: {"rtol": 1e-9, "atol": 1e-9},
    torch.float32: {"rtol": 1e-4, "atol": 1e-4},
}


def assert_close_at(
    actual: Tensor,
    expected: Tensor,
    *,
    what: str,
    where: str,
    position_axis: int,
    first_position: int = 0,
    failure: type[PropertyFailure] = WrongResults,
) -> None:
    """``torch.testing.assert_close`` at the dtype's tolerance, naming the first bad position."""
    __tracebackhide__ = True
    tolerance = TOLERANCES[expected.dtype]
    if (
        actual.shape == expected.shape
        and actual.dtype == expected.dtype
        and torch.isclose(actual, expected, **tolerance).all()
    ):
        return  # the same test assert_close makes, without building its report (10x faster)

    def message(default: str) -> str:
        located = first_divergence(actual, expected, position_axis, first_position)
        return f"{what} differ\n  at {where}\n  {located}\n{default}"

    try:
        torch.testing.assert_close(actual, expected, **tolerance, msg=message)
    except AssertionError as error:
        raise failure(str(error)) from None


def first_divergence(
    actual: Tensor, expected: Tensor, position_axis: int, first_position: int
) -> str:
    if actual.shape != expected.shape:
        return f"shapes differ: got {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    tolerance = TOLERANCES[expected.dtype]
    bad = ~torch.isclose(actual, expected, **tolerance)
    by_position = bad.movedim(position_axis, 0).flatten(1)
    positions = by_position.any(dim=1).nonzero().flatten().tolist()
    if not positions:
        return "dtype or layout differs"
    first = positions[0]
    gap = (actual - expected).abs().movedim(position_axis, 0)[first].max().item()
    return (
        f"first diverging absolute position: {first_position + first} (index {first} "
        f"below; {len(positions)} of {by_position.shape[0]} positions diverge); max |diff| there "
        f"{gap:.3g} against atol={tolerance['atol']}, rtol={tolerance['rtol']}"
    )


BITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def differing_rows(got: Tensor, want: Tensor) -> list[int]:
    """Indices along the length axis (2) where ``got`` and ``want`` are not bit-identical
    (compared as bits, so that a nan held as given counts as the same row)."""
    if got.dtype == want.dtype and got.dtype.is_floating_point:
        bits = BITS[got.element_size()]
        got, want = got.contiguous().view(bits), want.contiguous().view(bits)
    return (got != want).movedim(2, 0).flatten(1).any(1).nonzero().flatten().tolist()


def assert_returned_rows(cache, *, who: str, where: str) -> None:
    """What the recorded cache's last append returned is, bit for bit, the most recent rows it
    was given since its reset: all of them, or with a window at least the last W - 1 before
    the new ones and the new ones. None stale, unwritten, moved or changed."""
    __tracebackhide__ = True
    fewest, most = cache.fewest_rows(), cache.given_length
    for name, got, given in zip(("keys", "values"), cache.returned, cache.given, strict=True):
        rows = got.shape[2] if got.ndim == 4 else -1
        if got.shape[:2] + got.shape[3:] != given.shape[:2] + given.shape[3:] or not (
            fewest <= rows <= most
        ):
            count = f"{most}" if fewest == most else f"{fewest} to {most} (window {cache.window})"
            raise DataLoss(
                f"{who}: append returned {name} shaped {tuple(got.shape)}; a cache that was "
                f"given {most} rows since its reset, {cache.new_tokens} by this append, must "
                f"return the last {count} of them, shaped like {tuple(given.shape)}\n  at {where}"
            )
        first = most - rows  # the position of the first row returned
        if bad := differing_rows(got, given[:, :, first:]):
            raise DataLoss(
                f"{who}: {name} row {first + bad[0]} returned by append is not the row appended "
                f"there ({len(bad)} of {rows} rows returned differ: "
                f"{[first + row for row in bad[:8]]})\n  at {where}"
            )


def assert_length(cache, expected: int, *, who: str, where: str) -> None:
    __tracebackhide__ = True
    if cache.length != expected:
        raise DataLoss(f"{who}: length is {cache.length}, expected {expected}\n  at {where}")


def fail_if_not_empty(caches: Sequence, where: str) -> None:
    """Every cache of a fresh or reset set holds nothing."""
    __tracebackhide__ = True
    for layer, cache in enumerate(caches):
        if cache.length != 0:
            raise DataLoss(
                f"layer {layer}: holds {cache.length} tokens on fresh or reset caches; it must "
                f"hold 0\n  at {where}"
            )


def raised_by(call: Callable[[], object]) -> Exception | None:
    try:
        call()
    except Exception as error:  # which exception is what the callers check
        return error
    return None


def assert_refused(error: Exception | None, case, *, where: str) -> bool:
    """The call raised ``error`` (None: it returned). Returns False when ``case`` may be
    accepted and was (the caller then checks the cache is as the contract says); raises
    AcceptsBadInput when it may not. Check the cache is unchanged next, then the error."""
    __tracebackhide__ = True
    if error is None and not case.may_be_accepted:
        raise AcceptsBadInput(f"{case}: accepted without an error\n  at {where}")
    return error is not None


def assert_clear_error(error: Exception, case, bad: tuple, *, where: str) -> None:
    """``error`` is one of the case's exception types, with a message that names the problem."""
    __tracebackhide__ = True
    if not isinstance(error, case.errors):
        allowed = " or ".join(kind.__name__ for kind in case.errors)
        raise UnclearError(
            f"{case}: refused with {type(error).__name__}, not {allowed}: {error}\n  at {where}"
        ) from error
    if not str(error).strip() or not case.named_in(str(error), bad):
        raise UnclearError(
            f"{case}: refused with {str(error)!r}, a message that names neither the problem "
            f"nor an offending value (a word matching {case.words!r}, or the bad shape, "
            f"dtype, device or sizes)\n  at {where}"
        ) from error


def assert_unchanged(cache, spec, *, who: str, where: str, seed: int = 0) -> None:
    """Same length as before a refused call, and a read-back append returns the rows held
    before, then the new one."""
    __tracebackhide__ = True
    if cache.length != cache.given_length:
        raise RefusalChangedState(
            f"{who}: length is {cache.length} after a refused call, was {cache.given_length}"
            f"\n  at {where}"
        )
    row = random_rows(spec, 1, seed=seed + cache.given_length)
    cache.append(row, -row)
    try:
        assert_returned_rows(cache, who=who, where=f"reading back after a refused call, {where}")
    except DataLoss as error:
        raise RefusalChangedState(str(error)) from None
