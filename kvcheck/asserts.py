"""Assertions with messages for a person at 2 a.m.: what differs, where, by how much.

Every message has one shape: ``{who}: {what went wrong}`` then a line ``  at {where}``,
where ``who`` names a layer (``layer 1``) or a cache (``cache B``) and ``where`` the step of
the plan. Each raises the ``kvcheck.failures`` class that says how serious the failure is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

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

# float64 and float32 are exact enough for a fixed tolerance: float64 tight.
TOLERANCES = {
    torch.float64: {"rtol": 1e-9, "atol": 1e-9},
    torch.float32: {"rtol": 1e-4, "atol": 1e-4},
}


@dataclass(frozen=True)
class Budget:
    """How far a cached run in half precision may be from the float64 model: at each
    position, ``factor`` times as far as the uncached run in the same dtype is, plus
    ``floor`` roundings of the position's largest reference value (at least 1)."""

    factor: float
    floor: float

    def allowed(self, uncached_error: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
        unit_roundoff = torch.finfo(dtype).eps / 2
        return self.factor * uncached_error + self.floor * unit_roundoff * scale.clamp_min(1)

    def describe(self, dtype: torch.dtype) -> str:
        name = str(dtype).removeprefix("torch.")
        return (
            f"{self.factor:g} x the uncached {name} run's error + {self.floor:g} x "
            f"{torch.finfo(dtype).eps / 2:.3g} ({name}'s unit roundoff) x max(1, the largest "
            "|float64 value| at the position)"
        )


# Half precision is too coarse for any fixed tolerance (one that hides float64 bugs cries
# wolf here): a cached run must stay about as close to the float64 model as the uncached
# run in the same dtype. Measured on every built-in and independent cache (README, "Half
# precision"): at most 1.28 x the uncached error, and 0.78 roundings above it.
BUDGETS = {
    torch.bfloat16: Budget(factor=2.0, floor=1.0),
    torch.float16: Budget(factor=2.0, floor=1.0),
}


def needs_reference(dtype: torch.dtype) -> bool:
    """Whether results in ``dtype`` are judged against the float64 model (an error budget)."""
    return dtype in BUDGETS


def assert_close_at(
    actual: Tensor,
    expected: Tensor,
    *,
    what: str,
    where: str,
    position_axis: int,
    first_position: int = 0,
    failure: type[PropertyFailure] = WrongResults,
    reference: Tensor | None = None,
) -> None:
    """``torch.testing.assert_close`` at the dtype's tolerance, naming the first bad position;
    in half precision, the dtype's error budget against ``reference``, the float64 model's
    values at the same positions."""
    __tracebackhide__ = True
    if needs_reference(expected.dtype):
        if reference is None:
            raise TypeError(f"{what}: {expected.dtype} is judged against a float64 reference")
        assert_within_budget(
            actual,
            expected,
            reference,
            what=what,
            where=where,
            position_axis=position_axis,
            first_position=first_position,
            failure=failure,
        )
        return
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


def position_errors(actual: Tensor, expected: Tensor, position_axis: int) -> Tensor:
    """max |actual - expected| at each position along ``position_axis``, in float64."""
    gap = (actual.double() - expected.double()).abs().movedim(position_axis, 0)
    return gap.flatten(1).amax(dim=1)


def over_budget(
    actual: Tensor, expected: Tensor, reference: Tensor, position_axis: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Per position: whether ``actual`` is over the budget, its error and the budget (the
    float64 ``reference`` at the same positions is the truth; ``expected`` the uncached run
    in the same dtype)."""
    cached = position_errors(actual, reference, position_axis)
    uncached = position_errors(expected, reference, position_axis)
    scale = reference.double().abs().movedim(position_axis, 0).flatten(1).amax(dim=1)
    allowed = BUDGETS[expected.dtype].allowed(uncached, scale, expected.dtype)
    return ~(cached <= allowed), cached, allowed  # a nan is over any budget


def diverging_positions(
    actual: Tensor, expected: Tensor, position_axis: int, reference: Tensor | None = None
) -> list[int]:
    """Indices along ``position_axis`` where ``actual`` is not close to ``expected``: at the
    dtype's tolerance, or in half precision over its budget against ``reference``."""
    if needs_reference(expected.dtype):
        return (
            over_budget(actual, expected, reference, position_axis)[0].nonzero().flatten().tolist()
        )
    bad = ~torch.isclose(actual, expected, **TOLERANCES[expected.dtype])
    return bad.movedim(position_axis, 0).flatten(1).any(1).nonzero().flatten().tolist()


def assert_within_budget(
    actual: Tensor,
    expected: Tensor,
    reference: Tensor,
    *,
    what: str,
    where: str,
    position_axis: int,
    first_position: int = 0,
    failure: type[PropertyFailure] = WrongResults,
) -> None:
    """At every position, ``actual`` is no further from the float64 ``reference`` than the
    dtype's budget allows, given how far the uncached run in that dtype (``expected``) is."""
    __tracebackhide__ = True
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        raise failure(
            f"{what} differ\n  at {where}\n  got {tuple(actual.shape)} {actual.dtype}, expected "
            f"{tuple(expected.shape)} {expected.dtype}"
        )
    bad, cached, allowed = over_budget(actual, expected, reference, position_axis)
    positions = bad.nonzero().flatten().tolist()
    if not positions:
        return
    first = positions[0]
    uncached = position_errors(expected, reference, position_axis)[first].item()
    name = str(expected.dtype).removeprefix("torch.")
    raise failure(
        f"{what} differ beyond the {name} error budget\n  at {where}\n"
        f"  first diverging absolute position: {first_position + first} (index {first} below; "
        f"{len(positions)} of {bad.numel()} positions diverge); there max |cached - float64| "
        f"is {cached[first].item():.3g} against a budget of {allowed[first].item():.3g}, the "
        f"uncached {name} run being {uncached:.3g} from float64\n"
        f"  budget (kvcheck.asserts.BUDGETS): {BUDGETS[expected.dtype].describe(expected.dtype)}"
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


def read_back(cache, spec, *, seed: int = 0) -> None:
    """Append one valid row to the recorded ``cache`` through its recorder: ``cache.returned``
    is then every row it holds (or, with a window, a recent run of them) and the new one."""
    row = random_rows(spec, 1, seed=seed + cache.given_length)
    cache.append(row, -row)


def assert_unchanged(
    cache, spec, *, who: str, where: str, seed: int = 0, case=None, refused: bool = True
) -> None:
    """Same length as before a refused call (of ``case``, if given; ``refused`` False: one
    taken as a no-op), and a read-back append returns the rows held before, then the new one.
    An exception while reading the cache back is the call's doing: it left the cache
    unusable."""
    __tracebackhide__ = True
    if case is None:
        after = "after a refused call" if refused else "after a call taken as a no-op"
    else:
        after = f'after refusing "{case}"' if refused else f'after taking "{case}" as a no-op'
    try:
        length = cache.length
    except Exception as error:
        raise RefusalChangedState(
            f"{who}: {after}, reading its length raised "
            f"{type(error).__name__}: {error}\n  at {where}"
        ) from error
    if length != cache.given_length:
        raise RefusalChangedState(
            f"{who}: length is {length} after a refused call, was {cache.given_length}"
            f"\n  at {where}"
        )
    try:
        read_back(cache, spec, seed=seed)
    except Exception as error:
        raise RefusalChangedState(
            f"{who}: {after}, reading the cache back (an append of one valid "
            f"row) raised {type(error).__name__}: {error}\n  at {where}"
        ) from error
    try:
        assert_returned_rows(cache, who=who, where=f"reading back after a refused call, {where}")
    except DataLoss as error:
        raise RefusalChangedState(str(error)) from None
