"""Assertions with messages for a person at 2 a.m.: what differs, where, by how much.

Every message has one shape: ``{who}: {what went wrong}`` then a line ``  at {where}``,
where ``who`` names a layer (``layer 1``) or a cache (``cache B``) and ``where`` the step of
the plan. Each raises the ``kvcheck.failures`` class that says how serious the failure is.
"""

from __future__ import annotations

import dataclasses
import reprlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kvcheck import reach
from kvcheck.devices import dtype_name
from kvcheck.failures import (
    AcceptsBadInput,
    DataLoss,
    PropertyFailure,
    RefusalChangedState,
    UnclearError,
    WrongResults,
    set_root,
)
from kvcheck.tensors import as_values, random_rows
from kvref.checks import same_device
from kvref.protocol import rows_needed
from kvref.quantized import Quantized

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
        name = dtype_name(dtype)
        return (
            f"{self.factor:g} x the uncached {name} run's error + {self.floor:g} x "
            f"{torch.finfo(dtype).eps / 2:.3g} ({name}'s unit roundoff) x max(1, the largest "
            "|float64 value| at the position)"
        )


# Half precision is too coarse for any fixed tolerance (one that hides float64 bugs cries
# wolf here): a cached run must stay about as close to the float64 model as the uncached
# run in the same dtype. Measured on every built-in and independent cache
# (docs/half-precision.md): at most 1.73 x the uncached error, and 0.97 roundings above it.
BUDGETS = {
    torch.bfloat16: Budget(factor=2.0, floor=1.0),
    torch.float16: Budget(factor=2.0, floor=1.0),
}
# After a context shift (contract 8.4) the oracle's keys are re-rotated in float64 and
# rounded once, while a cache may re-rotate in its storage dtype, rounding each moved key up
# to 4 times (shift_rounding): its logits may stray as far again for each further rounding.
# Measured on the independent list cache that rotates in its dtype: up to 1.08 x the plain
# budget (head_dim 2, bfloat16), a false alarm; within this one over 10 seeds of the search.
SHIFTED_BUDGETS = {dtype: Budget(factor=4.0, floor=4.0) for dtype in BUDGETS}
# A latent cache's own attention (contract 10.2, ``attend_latent``) takes the absorbed query
# rounded to the storage dtype and rounds the weighted latents before the model's W_UV: two
# roundings per layer that neither the uncached pass nor the append path makes (both compute
# MLA in float64 and round once). Measured on the built-in latent cache, 1,000 models of
# the kit's MLA draws in bfloat16 and float16: up to 192 roundings past the plain budget
# (residuals 2 wide under RMSNorm), within 8 x the uncached error + 12.2 roundings; the
# floor here leaves 2.6 x that. The sharp check is ``latent attend``'s, in float32 and 64.
LATENT_ATTEND_BUDGETS = {dtype: Budget(factor=8.0, floor=32.0) for dtype in BUDGETS}


# A cache's own attend (contract 3.3) sums in float32 and rounds once, where the uncached
# pass sums in float64: where one sum rounds the other way, the flip travels through the
# later layers to the logits, a few roundings that no cache caused and that the uncached
# run's error does not bound. Found by the soak tier's sharded plans (2026-12-07): three
# correct caches' attends (sdpa, streaming, latent), equal to the uncached run bit for bit
# at 23 of a prefill's 24 positions, 1.8 roundings of the position's largest value beyond
# 2 x the uncached error at the last (float16, logits of magnitude 4.9). The measured tail
# before (docs/half-precision.md, on the attend path): 1.94 x the uncached error.
ATTEND_BUDGETS = {dtype: Budget(factor=2.0, floor=4.0) for dtype in BUDGETS}


def budgets_for(caches: Sequence) -> dict:
    """The half-precision budgets for the logits of a model over ``caches`` (recorded): a
    latent attend's where some cache computed MLA's absorbed attention itself, an attend's
    where some cache computed attention itself."""
    if any(getattr(cache, "attended_latent", False) for cache in caches):
        return LATENT_ATTEND_BUDGETS
    if any(getattr(cache, "attended", None) is not None for cache in caches):
        return ATTEND_BUDGETS
    return BUDGETS


# Lossy storage (contract, section 10.1): a number held in codes is off by up to half a step
# of its group, and the model carries that into its logits and into the keys and values of
# later layers. Those are held to LOSSY_FACTOR x the declared step (as a share of magnitude,
# the coarsest the caches declare) x max(1, the position's largest |value|), on top of the
# dtype's tolerance or budget. Measured on correct caches (docs/quantized.md): at most 6.6
# for int8 and 14.0 for int4 over 400 scenarios each, the tail from models with a residual 2
# wide, where half a step can flip a key's sign; 7.1 for float8 codes (their step: the
# format's eps) and 3.0 for KIVI's 2-bit keys per channel, 200 scenarios each. Loose on
# purpose: the sharp check is each row's own bound (rows_not_held); this one sees what the
# model makes of the rows.
LOSSY_FACTOR = 32.0


def coarser(*declared: Quantized | None) -> Quantized | None:
    """The lossiest of the storages ``declared`` (by its step), None where none is."""
    parts = [part for part in declared if part is not None]
    return max(parts, key=lambda part: part.relative_step, default=None)


def coarsest(caches: Sequence) -> Quantized | None:
    """The lossiest storage the (recorded) caches declare, None where all store as given."""
    carried = [getattr(cache, "carried", (None, None)) for cache in caches]  # rows moved in
    return coarser(*(part for cache, more in zip(caches, carried, strict=True)
                     for part in (*cache.storage, *more)))  # fmt: skip


def needs_reference(dtype: torch.dtype) -> bool:
    """Whether results in ``dtype`` are judged against the float64 model (an error budget)."""
    return dtype in BUDGETS


TORCH_HEADING = "Tensor-likes are not close!"


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
    lossy: Quantized | None = None,
    budgets: dict = BUDGETS,
) -> None:
    """``torch.testing.assert_close`` at the dtype's tolerance, naming the first bad position;
    in half precision, the dtype's error budget (of ``budgets``) against ``reference``, the
    float64 model's values at the same positions; with ``lossy`` storage, its budget on top."""
    __tracebackhide__ = True
    if lossy is not None or needs_reference(expected.dtype):
        if reference is None and needs_reference(expected.dtype):
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
            lossy=lossy,
            budgets=budgets,
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
        # assert_close's own report (elements mismatched, the greatest differences), indented
        # under ours; its heading says again what the first line says.
        report = [line for line in default.splitlines() if line and line != TORCH_HEADING]
        return "\n  ".join([f"{what} differ", f"at {where}", located, *report])

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


def allowed_errors(
    actual: Tensor,
    expected: Tensor,
    reference: Tensor | None,
    axis: int,
    lossy: Quantized | None = None,
    budgets: dict = BUDGETS,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per position along ``axis``: how far ``actual`` is from the truth (the float64
    ``reference`` in half precision, else ``expected``, the uncached run in the same dtype),
    how far it may be (the dtype's tolerance or budget, and with ``lossy`` storage its share,
    ``LOSSY_FACTOR``, on top), and max(1, the truth's largest magnitude) there."""
    truth = reference if needs_reference(expected.dtype) else expected
    error = position_errors(actual, truth, axis)
    scale = truth.double().abs().movedim(axis, 0).flatten(1).amax(dim=1)
    if truth is reference:
        uncached = position_errors(expected, truth, axis)
        allowed = budgets[expected.dtype].allowed(uncached, scale, expected.dtype)
    else:
        tolerance = TOLERANCES[expected.dtype]
        allowed = tolerance["atol"] + tolerance["rtol"] * scale
    if lossy is not None:
        allowed = allowed + LOSSY_FACTOR * lossy.relative_step * scale.clamp_min(1)
    return error, allowed, scale.clamp_min(1)


def over_budget(
    actual: Tensor,
    expected: Tensor,
    reference: Tensor | None,
    position_axis: int,
    lossy: Quantized | None = None,
    budgets: dict = BUDGETS,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per position: whether ``actual`` is over the budget, its error and the budget
    (``allowed_errors``)."""
    error, allowed, _ = allowed_errors(actual, expected, reference, position_axis, lossy, budgets)
    return ~(error <= allowed), error, allowed  # a nan is over any budget


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
    reference: Tensor | None,
    *,
    what: str,
    where: str,
    position_axis: int,
    first_position: int = 0,
    failure: type[PropertyFailure] = WrongResults,
    lossy: Quantized | None = None,
    budgets: dict = BUDGETS,
) -> None:
    """At every position, ``actual`` within its budget (``allowed_errors``): in half
    precision, no further from the float64 ``reference`` than the dtype allows, given how far
    the uncached run in that dtype (``expected``) is; with ``lossy`` storage declared, that or
    the dtype's tolerance and the storage's share on top."""
    __tracebackhide__ = True
    if actual.shape != expected.shape or (lossy is None and actual.dtype != expected.dtype):
        raise failure(
            f"{what} differ\n  at {where}\n  got {tuple(actual.shape)} {actual.dtype}, expected "
            f"{tuple(expected.shape)} {expected.dtype}"
        )
    bad, error, allowed = over_budget(actual, expected, reference, position_axis, lossy, budgets)
    positions = bad.nonzero().flatten().tolist()
    if not positions:
        return
    first = positions[0]
    located = (
        f"  first diverging absolute position: {first_position + first} (index {first} below; "
        f"{len(positions)} of {bad.numel()} positions diverge); there max "
    )
    if lossy is not None:
        raise failure(
            f"{what} differ beyond the declared {lossy.describe()} storage's budget\n  at "
            f"{where}\n{located}|diff| is {error[first].item():.3g} against "
            f"{allowed[first].item():.3g} allowed\n  budget (kvcheck.asserts.LOSSY_FACTOR): the "
            f"dtype's tolerance + {LOSSY_FACTOR:g} x {lossy.relative_step:.3g} (a step of the "
            f"codes) x max(1, the largest |value| there)"
        )
    uncached = position_errors(expected, reference, position_axis)[first].item()
    name = dtype_name(expected.dtype)
    tables = {
        id(BUDGETS): "BUDGETS",
        id(ATTEND_BUDGETS): "ATTEND_BUDGETS",
        id(LATENT_ATTEND_BUDGETS): "LATENT_ATTEND_BUDGETS",
    }
    table = tables.get(id(budgets), "SHIFTED_BUDGETS")
    raise failure(
        f"{what} differ beyond the {name} error budget\n  at {where}\n{located}"
        f"|cached - float64| is {error[first].item():.3g} against a budget of "
        f"{allowed[first].item():.3g}, the uncached {name} run being {uncached:.3g} from "
        f"float64\n  budget (kvcheck.asserts.{table}): "
        f"{budgets[expected.dtype].describe(expected.dtype)}"
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
            which = f"the last {count} of them"
            if cache.sinks and fewest != most:
                which = (
                    f"{fewest} to {most} of them, the first {cache.sinks} (its sinks) and then a "
                    f"recent run (window {cache.window})"
                )
            raise DataLoss(
                f"{who}: append returned {name} shaped {tuple(got.shape)}; a cache that was "
                f"given {most} rows since its reset, {cache.new_tokens} by this append, must "
                f"return {which}, shaped like {tuple(given.shape)}\n  at {where}"
            )
        kept = cache.kept(rows)  # the index since the reset of each row returned
        part = 0 if name == "keys" else 1
        bad, beyond = rows_not_held(cache, part, got, given, kept)
        if name == "keys" and cache.rerotated:  # a context shift's keys: within its rounding
            bad = [row for row in bad if not _rerotated_within(cache, got, given, kept, row)]
        if bad:
            moved = ""
            if name == "keys" and kept[bad[0]] in cache.rerotated:
                counts = cache.rerotated[kept[bad[0]]]
                budget = shift_rounding(got.dtype, counts)
                moved = (
                    f", moved down by context shifts of {list(counts)} positions and re-rotated "
                    f"beyond {budget:.2g} of its largest magnitude from the float64 re-rotation"
                )
            error = DataLoss(
                f"{who}: {name} row {kept[bad[0]]} returned by append is not the row appended "
                f"there{moved}{beyond} ({len(bad)} of {rows} rows returned differ: "
                f"{[kept[row] for row in bad[:8]]})\n  at {where}"
            )
            set_root(error, kept[bad[0]])
            raise error


def assert_exported(cache, rows, *, who: str, where: str) -> None:
    """What the recorded cache's ``export_rows`` gave (contract, section 11.2) is a
    ``kvref.CacheRows`` of its length and, bit for bit, the most recent rows it was given
    since its reset: all of them, or with a window at least the last W - 1."""
    __tracebackhide__ = True
    from kvref import CacheRows

    if not isinstance(rows, CacheRows):
        raise DataLoss(f"{who}: export_rows returned {type(rows).__name__}, not kvref.CacheRows")
    held = cache.given_length
    if rows.length != held:
        raise DataLoss(
            f"{who}: export_rows says length {rows.length}; the cache was given {held} tokens "
            f"since its reset\n  at {where}"
        )
    fewest = rows_needed(cache.window, held)
    for part, (name, got, given) in enumerate(
        zip(("keys", "values"), (rows.keys, rows.values), cache.given or (None, None), strict=True)
    ):
        count = got.shape[2] if isinstance(got, Tensor) and got.ndim == 4 else -1
        shape = None if given is None else given.shape[:2] + given.shape[3:]
        if (
            count < 0
            or (shape is not None and got.shape[:2] + got.shape[3:] != shape)
            or not (fewest <= count <= held)
        ):
            shown = tuple(got.shape) if isinstance(got, Tensor) else type(got).__name__
            raise DataLoss(
                f"{who}: export_rows gave {name} shaped {shown}; a cache given {held} rows "
                f"since its reset must give the last {fewest} to {held} of them, oldest first"
                f"\n  at {where}"
            )
        if not count:
            continue
        kept = list(range(held - count, held))
        bad, beyond = rows_not_held(cache, part, got, given, kept)
        if bad:
            raise DataLoss(
                f"{who}: {name} row {kept[bad[0]]} of export_rows is not the row appended there"
                f"{beyond} ({len(bad)} of {count} rows exported differ: "
                f"{[kept[row] for row in bad[:8]]})\n  at {where}"
            )


def rows_not_held(
    cache, part: int, got: Tensor, given: Tensor, kept: list[int], below: int | None = None
) -> tuple[list[int], str]:
    """Which rows of ``got`` (row i the one given at index ``kept[i]``) are not as the recorded
    cache holds keys (``part`` 0) or values (1): bit for bit, but for rows its declared storage
    may have put in codes (contract, section 10.1), which may be as far as the declaration's
    bound from the row given: those below ``below`` (by default the recorder's
    ``quantized_below``: a batch row of its own, a tree's nodes or a shard say theirs). Also,
    where the first bad row is one of those, how far."""
    want = given[:, :, kept]
    bad = differing_rows(got, want)
    # The cache's own storage, and that of rows moved in from another (section 11.2): a row
    # may be held to either, so to the larger bound of the two, number by number (one
    # storage's step is not coarser than another's everywhere: float8's is relative).
    declarations = [
        part_declared
        for part_declared in (cache.storage[part], getattr(cache, "carried", (None, None))[part])
        if part_declared is not None
    ]
    if not bad or not declarations:
        return bad, ""
    below = cache.quantized_below[part] if below is None else below
    lossy = [row for row in bad if kept[row] < below]
    if not lossy:
        return bad, ""
    got_rows, want_rows = got[:, :, lossy].double(), want[:, :, lossy]
    indices = [kept[row] for row in lossy]
    for declared in declarations:
        _note_lossy_edges(declared, given, indices)
    allowed = torch.stack([_allowed_for(d, given, indices, got.dtype) for d in declarations])
    allowed = allowed.amax(dim=0)
    declared = " or ".join(dict.fromkeys(d.describe() for d in declarations))
    gap = (got_rows - want_rows.double()).abs()
    beyond = ~((gap <= allowed) | allowed.isinf())  # a nan is beyond any finite bound
    over = set(torch.tensor(lossy)[beyond.movedim(2, 0).flatten(1).any(1)].tolist())
    bad = [row for row in bad if row not in lossy or row in over]
    if not bad or bad[0] not in over:
        return bad, ""
    at = lossy.index(bad[0])
    worst = (gap[:, :, at] - allowed[:, :, at]).flatten().nan_to_num(torch.inf).argmax()
    return bad, (
        f", beyond the declared {declared} bound: |diff| "
        f"{gap[:, :, at].flatten()[worst].item():.3g} against "
        f"{allowed[:, :, at].flatten()[worst].item():.3g} allowed"
    )


# What a cache's declared storage states beyond integer codes per token (section 10.1), as
# the capabilities ``kvcheck.kit.offered`` counts, so that an edge needing one is reachable
# only on a cache that declares it.
LOSSY_CAPABILITIES = {
    "lossy storage": "the cache declares no lossy storage (kv_storage, contract 10.1)",
    "codes along tokens": "the cache declares no groups along tokens (kv_storage, contract 10.1)",
    "a fixed scale": "the cache declares no fixed float8 scale (kv_storage, contract 10.1)",
    "a floor on the step": "the cache declares no floor on its step (kv_storage, contract 10.1)",
}


def lossy_capabilities(cache: object) -> set[str]:
    """Which of ``LOSSY_CAPABILITIES`` the storage ``cache`` declares (none where its
    declaration is bad: the kit's checks say so where they read it)."""
    from kvref.protocol import CacheContractError
    from kvref.quantized import storage

    try:
        parts = [part for part in storage(cache) if part is not None]
    except CacheContractError:
        return set()
    found = {
        "lossy storage": bool(parts),  # rows in codes wherever rows are compared
        "codes along tokens": any(part.along == "tokens" for part in parts),
        "a fixed scale": any(part.scale is not None for part in parts),
        "a floor on the step": any(part.min_step > 0 for part in parts),
    }
    return {name for name, declared in found.items() if declared}


def _note_lossy_edges(declared: Quantized, given: Tensor, indices: list[int]) -> None:
    """Note the edges of section 10.1's newer declarations that judging these rows reached."""
    if declared.along == "tokens":
        reach.note("a coded row judged by its group along tokens")
    if declared.scale is not None:
        top = torch.finfo(declared.codes).max * declared.scale
        if bool((given[:, :, indices].double().abs() > top).any()):
            reach.note("a coded number saturated at a fixed scale")
    if declared.min_step:
        rows, floorless = given[:, :, indices], dataclasses.replace(declared, min_step=0.0)
        dtype = rows.dtype
        floored = declared.allowed_error(rows, dtype) > floorless.allowed_error(rows, dtype)
        if bool(floored.any()):
            reach.note("a coded row under a floor on the step")


def _allowed_for(declared: Quantized, given: Tensor, indices: list[int], dtype) -> Tensor:
    """The declared bound of the rows given at ``indices`` (of ``given``, (B, H, T, D)): over
    each row's own groups of channels, or along tokens over the whole group of rows it
    belongs to (the group's G rows from the reset on, all in ``given``: a row is in codes
    only with its whole group, section 10.1)."""
    if declared.along == "channels":
        return declared.allowed_error(given[:, :, indices], dtype)
    whole = -(-(max(indices) + 1) // declared.group) * declared.group
    return declared.allowed_error(given[:, :, :whole], dtype)[:, :, indices]


def coded_bound(declared: Quantized | None, given: Tensor, dtype) -> Tensor:
    """The declared bound of every number of ``given`` ((B, H, L, D), the rows given since
    the reset), in float64: 0 where a row must come back as given (no storage declared, or
    one of the recent run), its bound where it may be in codes (section 10.1)."""
    bound = torch.zeros(given.shape, dtype=torch.float64, device=given.device)
    coded = 0 if declared is None else declared.coded_rows(given.shape[2])
    if coded:
        bound[:, :, :coded] = _allowed_for(declared, given, list(range(coded)), dtype)
    return bound


# A key a context shift moved is re-rotated by the cache, perhaps in its storage dtype: up to
# this many roundings of that dtype per shift (cosine, sine, the products, their sum), of the
# row's largest magnitude, from the float64 re-rotation of the key given (contract, 8.4).
SHIFT_ROUNDINGS = 4


def shift_rounding(dtype: torch.dtype, counts: tuple[int, ...]) -> float:
    """How far, relative to a key's largest magnitude, shifts by ``counts`` positions may
    leave it from the float64 re-rotation: per shift, ``SHIFT_ROUNDINGS`` roundings of its
    dtype, and the angle's own: count x inverse frequency rounds with the angle's size, so
    ``count`` roundings of float32 (llama.cpp's angle), or of float64 for float64 keys."""
    finfo = torch.finfo(dtype)
    angle = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps
    return sum(SHIFT_ROUNDINGS * finfo.eps + abs(count) * angle for count in counts)


def _rerotated_within(cache, got: Tensor, given: Tensor, kept: list[int], row: int) -> bool:
    """Whether returned key row ``row`` is one a shift re-rotated, within its rounding (and
    a subnormal's spacing: a row of tiny values rounds past a share of its magnitude)."""
    if kept[row] not in cache.rerotated or not got.dtype.is_floating_point:
        return False
    want, finfo = given[:, :, kept[row]].double(), torch.finfo(got.dtype)
    counts = cache.rerotated[kept[row]]  # the shifts that moved this key
    rounding = shift_rounding(got.dtype, counts)
    spacing = SHIFT_ROUNDINGS * len(counts) * finfo.tiny * finfo.eps
    allowed = rounding * want.abs().amax(dim=-1, keepdim=True) + spacing
    allowed = allowed + _moved_codes_bound(cache, given, kept[row], got.dtype)
    return bool(((got[:, :, row].double() - want).abs() <= allowed).all())


# A key in codes that a shift moved: its coding error rotated (each channel of a rotated
# pair mixes two coded numbers: up to sqrt 2 x the larger bound) and, where the cache codes
# the rotated key again (llama.cpp's quantized K), a second coding of a row up to sqrt 2 x as
# wide: 3 x the row's largest bound covers both (contract, 10.1 and 8.4).
MOVED_CODES = 3.0


def _moved_codes_bound(cache, given: Tensor, index: int, dtype) -> Tensor | float:
    """What a moved key given at ``index`` may carry from its codes, per (batch row, head):
    0 where its row is not one the cache may hold in codes."""

    parts = getattr(cache, "storage", (None, None))
    declared = coarser(parts[0], getattr(cache, "carried", (None, None))[0])
    if declared is None or index >= cache.quantized_below[0]:
        return 0.0
    bound = _allowed_for(declared, given, [index], dtype)[:, :, 0]
    return MOVED_CODES * bound.amax(dim=-1, keepdim=True)


# Public: the session engine checks the rows a shift per row moved with it (section 8.4).
rerotated_within = _rerotated_within


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
    """What ``call`` raised (None: it returned). A property failure found inside the call (a
    recorder seeing a cache take what it must refuse) is the verdict, not the cache's
    refusal: it goes on up."""
    try:
        call()
    except PropertyFailure:
        raise
    except Exception as error:  # which exception is what the callers check
        return error
    return None


def assert_refused(
    error: Exception | None,
    case,
    *,
    where: str,
    sent: tuple | None = None,
    method: str = "append",
    cache=None,
    spec=None,
) -> bool:
    """The call raised ``error`` (None: it returned). Returns False when ``case`` may be
    accepted and was (the caller then checks the cache is as the contract says); raises
    AcceptsBadInput when it may not. Check the cache is unchanged next, then the error.

    The message says what was sent when given the call's arguments (``sent``, to ``method``)
    and, given the recorded ``cache`` the call went past and its ``spec``, what the cache then
    did with it: its state read back against the rows it held before."""
    __tracebackhide__ = True
    if error is None and not case.may_be_accepted:
        lines = [f"{case}: accepted without an error", f"  at {where}"]
        if sent is not None:
            lines.append(f"  sent: {describe_call(method, sent, cache, spec)}")
        cause = None
        if cache is not None and spec is not None:
            facts, cause = what_it_did(cache, spec, method, sent)
            lines.append("  what the cache then did (read back by appending one valid row):")
            lines += [f"    {fact}" for fact in facts]
        raise AcceptsBadInput("\n".join(lines)) from cause
    return error is not None


# The argument names of the calls bad input is sent to, for the message.
ARGUMENTS = {
    "append": ("key", "value"),
    "truncate": ("length",),
    "reorder": ("indices",),
    "model": ("token ids", "caches"),
}
_SHORT = reprlib.Repr()
_SHORT.maxlist = _SHORT.maxtuple = 8
_SHORT.maxlevel = 4


def describe_argument(argument: object, *, values: bool = False) -> str:
    """A tensor's shape, dtype and device (and its values when ``values``); a sequence of
    objects by count and kind; anything else by its type and a short repr."""
    if isinstance(argument, Tensor):
        text = (
            f"a tensor shaped {tuple(argument.shape)}, {dtype_name(argument.dtype)} on "
            f"{argument.device}"
        )
        if values and argument.device.type != "meta":
            text += f", values {_SHORT.repr(argument.tolist())}"
        return text
    kind = type(argument).__name__
    if isinstance(argument, list | tuple) and any(
        not isinstance(item, int | float | list | tuple) for item in argument
    ):
        kinds = "/".join(sorted({type(item).__name__ for item in argument}))
        distinct = len({id(item) for item in argument})
        return f"{article(kind)} of {len(argument)} {kinds} ({distinct} distinct)"
    if isinstance(argument, list | tuple):
        try:
            numbers = torch.tensor(argument)
        except (TypeError, ValueError, RuntimeError):  # ragged, or not numbers
            numbers = None
        if numbers is not None and (numbers.is_floating_point() or numbers.numel() > 16):
            of = "floats" if numbers.is_floating_point() else "ints"
            return f"{article(kind)} of {of} nested as {tuple(numbers.shape)}"
    return f"{article(kind)} {_SHORT.repr(argument)}"


def article(word: str) -> str:
    return f"{'an' if word[:1].lower() in 'aeiou' else 'a'} {word}"


def positions(what: str, start: int, stop: int) -> str:
    """``row 3`` or ``rows 3..5``: the positions from ``start`` to before ``stop``."""
    return f"{what} {start}" if stop == start + 1 else f"{what}s {start}..{stop - 1}"


def describe_call(method: str, sent: tuple, cache=None, spec=None) -> str:
    """``method``'s call with the arguments ``sent``, and what the cache held and expects."""
    names = ARGUMENTS.get(method, tuple(f"argument {i}" for i in range(len(sent))))
    shown = ", ".join(
        f"{name}={describe_argument(argument, values=method == 'reorder')}"
        for name, argument in zip(names, sent, strict=False)
    )
    text = f"{method}({shown})"
    held = None if cache is None else cache.given_length
    if method == "truncate" and held is not None:
        text += f": asked for length {sent[0]!r}, the cache holding {held} tokens"
    elif held is not None:
        text += f" to a cache holding {held} tokens"
    if spec is not None and method == "reorder":
        text += (
            f"; valid indices are int64, shaped ({spec.batch},), on {spec.device}, with values "
            f"in [0, {spec.batch})"
        )
    elif spec is not None and method == "append":
        text += (
            f", built for (B, H_kv, D) = {(spec.batch, spec.kv_heads, spec.head_dim)}"
            f"{'' if spec.value_dim is None else f' (values {spec.value_dim} wide)'}, "
            f"{dtype_name(spec.dtype)} on {spec.device}"
        )
    return text


def what_it_did(cache, spec, method: str, sent: tuple | None) -> tuple[list[str], Exception | None]:
    """How the recorded ``cache``, after a call that went past its recorder, differs from the
    rows the recorder holds (what it held before): its length, then what one read-back append
    returns, row by row. Also the exception that stopped the reading, if one did."""
    before = cache.given_length
    held = cache.given  # the read-back makes new tensors: these stay the rows held before
    try:
        after = cache.length
    except Exception as error:
        return [f"reading its length then raised {type(error).__name__}: {error}"], error
    facts = [length_change(before, after)]
    try:
        read_back(cache, spec)
    except Exception as error:
        facts.append(
            f"reading it back (an append of one valid row) raised {type(error).__name__}: {error}"
        )
        return facts, error
    for which, name in enumerate(("keys", "values")):
        rows = None if sent is None or method != "append" else sent[which]
        facts += row_changes(
            name,
            cache.returned[which],
            None if held is None else held[which],
            cache.given[which][:, :, -1:],
            after,
            spec,
            rows,
        )
    if len(facts) == 1 and before == after:
        facts.append("every row held before comes back bit for bit: the call was taken as a no-op")
    return facts, None


def length_change(before: int, after) -> str:
    if after == before:
        return f"length is still {before}"
    if isinstance(after, int) and 0 <= after < before:
        return (
            f"length changed from {before} to {after} ({positions('position', after, before)} gone)"
        )
    return f"length changed from {before} to {after!r}"


def row_changes(
    name: str, got, held: Tensor | None, row: Tensor, after, spec, sent: object
) -> list[str]:
    """What the read-back returned as ``name`` (``got``) against the ``held`` rows and the
    read-back ``row``, the cache claiming ``after`` rows before it; ``sent`` the rows of an
    accepted append, if any."""
    if not isinstance(got, Tensor) or got.ndim != 4:
        return [f"{name}: returned {describe_argument(got)}, not a 4-D tensor"]
    width = spec.value_width if name == "values" else spec.head_dim
    bhd, want = got.shape[:2] + got.shape[3:], (spec.batch, spec.kv_heads, width)
    if tuple(bhd) != want or not same_device(got.device, torch.device(spec.device)):
        return [
            f"{name}: returned shaped {tuple(got.shape)} on {got.device}: (B, H_kv, D) "
            f"{tuple(bhd)}, was {want} on {spec.device}"
        ]
    facts = []
    if got.dtype != spec.dtype:
        facts.append(f"{name}: returned as {dtype_name(got.dtype)}, were {dtype_name(spec.dtype)}")
    count = got.shape[2]
    if count == 0:
        return [*facts, f"{name}: returned no rows, not even the one appended to read it back"]
    if not isinstance(after, int) or count > after + 1:
        facts.append(
            f"{name}: returned {count} rows, but length says {after!r} and one was appended"
        )
        after = count - 1  # trust the rows: the last is the one appended
    first = after + 1 - count  # the position of the first row returned
    if first > 0 and spec.window is None:
        facts.append(f"{name}: returned only the last {count} of its {after + 1} rows")
    before = 0 if held is None else held.shape[2]
    if changed := changed_rows(got[:, :, -1:], row, after):
        facts.append(f"{name}: the row appended to read it back comes back changed: {changed}")
    kept = range(max(first, 0), min(before, after))
    if kept and (
        changed := changed_rows(
            got[:, :, kept.start - first : kept.stop - first],
            held[:, :, kept.start : kept.stop],
            kept.start,
        )
    ):
        facts.append(f"{name}: held rows changed: {changed}; held rows must come back bit for bit")
    new = range(max(first, before), after)
    if new:
        rows = got[:, :, new.start - first : new.stop - first]
        facts.append(f"{name}: {claimed(rows, new.start, new.start - before, sent)}")
    return facts


def claimed(new: Tensor, start: int, skipped: int, sent: object) -> str:
    """The rows at positions ``start``.. that a cache claims after an accepted call, against
    the rows ``sent`` by it (an append's key or value, if any) from its ``skipped``-th on."""
    span = positions("row", start, start + new.shape[2])
    if sent is None:
        return f"{span} claimed, never written"
    if (
        not isinstance(sent, Tensor)
        or sent.ndim != 4
        or sent.shape[:2] + sent.shape[3:] != (new.shape[:2] + new.shape[3:])
    ):
        return f"{span} claimed, never written (no row of this shape was sent)"
    sent = sent[:, :, skipped:]
    if new.shape[2] > sent.shape[2]:
        return (
            f"{span} claimed: {new.shape[2]} rows, {sent.shape[2]} sent, so "
            f"{new.shape[2] - sent.shape[2]} never written"
        )
    converted = sent[:, :, : new.shape[2]].to(device=new.device, dtype=new.dtype)
    if changed := changed_rows(new, converted, start):
        return f"{span} claimed, not as sent: {changed}"
    text = f"{span} as sent"
    if new.shape[2] < sent.shape[2]:
        text += f": the first {new.shape[2]} of the {sent.shape[2]} rows sent, the rest not held"
    if sent.dtype != new.dtype:
        text += f", {dtype_name(sent.dtype)} stored as {dtype_name(new.dtype)}"
    return text


def changed_rows(got: Tensor, want: Tensor, start: int = 0) -> str:
    """Which rows of ``got`` differ from ``want`` (bit for bit in one dtype, else as float64),
    by absolute position from ``start``, and by how much; empty when none."""
    if got.dtype != want.dtype:
        got, want = got.double(), want.double()
    bad = differing_rows(got, want.to(got.device))
    if not bad:
        return ""
    gap = (got.double() - want.double()).abs().movedim(2, 0)[bad].max().item()
    shown = [start + row for row in bad[:8]] + (["..."] if len(bad) > 8 else [])
    return f"{len(bad)} of {got.shape[2]}, rows {shown}, max |diff| {gap:.3g}"


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
    cache.append(row, as_values(spec, row, -1))


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
    # The words of a refusal that changed the length, for a case or not, as they always were.
    changed = "after a refused call" if refused else after
    if length != cache.given_length:
        raise RefusalChangedState(
            f"{who}: length is {length} {changed}, was {cache.given_length}\n  at {where}"
        )
    try:
        read_back(cache, spec, seed=seed)
    except Exception as error:
        raise RefusalChangedState(
            f"{who}: {after}, reading the cache back (an append of one valid "
            f"row) raised {type(error).__name__}: {error}\n  at {where}"
        ) from error
    try:
        assert_returned_rows(cache, who=who, where=f"reading back {changed}, {where}")
    except DataLoss as error:
        changed = RefusalChangedState(str(error))
        changed.kv_root = getattr(error, "kv_root", None)  # the row it found wrong
        raise changed from None
