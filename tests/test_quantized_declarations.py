"""``kvref.Quantized``'s float codes, groups along tokens and floor (contract, section 10.1):
bad declarations refused naming the field, each bound held by a correct coding and broken by
a wrong one, and the older declarations meaning exactly what they did."""

import math

import pytest
import torch

from kvref import CacheSpec, min_nbytes
from kvref.quantized import QUANTIZED_ROUNDINGS, Quantized

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@pytest.mark.parametrize(
    ("declared", "problem"),
    [
        (dict(bits=4, codes=E4M3, symmetric=True), "declare bits=8, symmetric=True"),
        (dict(bits=8, codes=E4M3), "declare bits=8, symmetric=True"),
        (dict(bits=8, codes=torch.float16, symmetric=True), "codes must be None"),
        (dict(bits=2, along="tokens"), "declare group as that number of tokens"),
        (dict(bits=2, group=4, along="rows"), "along must be one of"),
        (dict(bits=8, scale=0.5), "for float8 codes"),
        (dict(bits=8, group=8, codes=E4M3, symmetric=True, scale=0.5), "group=None"),
        (dict(bits=8, codes=E4M3, symmetric=True, scale=0.0), "scale must be a finite float > 0"),
        (dict(bits=8, codes=E4M3, symmetric=True, scale=math.inf), "finite float > 0"),
        (dict(bits=4, min_step=-1e-3), "min_step must be a finite float >= 0"),
        (dict(bits=4, min_step=True), "min_step must be"),
        (dict(bits=8, codes=E5M2, symmetric=True, min_step=1e-3), "floors the step of integer"),
    ],
)
def test_a_bad_declaration_is_refused_naming_the_field(declared, problem):
    with pytest.raises(ValueError, match=problem):
        Quantized(**declared)


def test_older_declarations_mean_what_they_did():
    rows = torch.randn(2, 3, 5, 12, dtype=torch.float64)
    for declared in (Quantized(8), Quantized(4, group=4, symmetric=True, recent=3)):
        size = declared.group_size(12)
        grouped = rows.unflatten(-1, (-1, size))
        top, bottom = grouped.amax(-1), grouped.amin(-1)
        magnitude = torch.maximum(top.abs(), bottom.abs())
        levels = 2**declared.bits - (2 if declared.symmetric else 1)
        step = 2 * magnitude / levels if declared.symmetric else (top - bottom) / levels
        unit = torch.finfo(torch.float32).eps / 2
        expected = step / 2 + QUANTIZED_ROUNDINGS * unit * (magnitude + top - bottom)
        expected = expected.repeat_interleave(size, -1)[..., :12]
        torch.testing.assert_close(declared.allowed_error(rows, torch.float32), expected)
        assert declared.coded_rows(10) == 10 - declared.recent
    assert Quantized(8).describe() == "int8 per token, with zero point"
    assert Quantized(4, group=32, symmetric=True, recent=8).describe() == (
        "int4 per group of 32, symmetric, the last 8 rows as given"
    )
    assert Quantized(8).nbytes(3, 16) == 3 * (16 + 4)


def _fp8_round_trip(rows, codes, scale):
    top = torch.finfo(codes).max
    return (rows / scale).clamp(-top, top).to(codes).double() * scale


@pytest.mark.parametrize("codes", [E4M3, E5M2])
def test_float_codes_are_held_to_half_an_ulp_and_saturation(codes):
    rows = torch.randn(1, 2, 6, 16, dtype=torch.float64) * torch.logspace(-3, 1, 16).double()
    per_token = Quantized(8, codes=codes, symmetric=True)
    scale = rows.abs().amax(-1, keepdim=True) / torch.finfo(codes).max
    gap = (_fp8_round_trip(rows, codes, scale) - rows).abs()
    assert bool((gap <= per_token.allowed_error(rows, torch.float64)).all())
    # The relative bound is far finer than a uniform step for the small channels.
    uniform = rows.abs().amax(-1, keepdim=True) * torch.finfo(codes).eps / 2
    assert bool((per_token.allowed_error(rows, torch.float64)[..., :4] < uniform / 10).all())

    fixed = Quantized(8, codes=codes, symmetric=True, scale=2.0**-8)
    big = rows * 1e4  # beyond max x scale: saturated by the clamp
    gap = (_fp8_round_trip(big, codes, 2.0**-8) - big).abs()
    assert bool((gap <= fixed.allowed_error(big, torch.float64)).all())
    if codes == E5M2:  # torch's cast to e4m3fn saturates by itself; to e5m2 it overflows
        unclamped = (big / 2.0**-8).to(codes).double() * 2.0**-8
        allowed = fixed.allowed_error(big, torch.float64)
        assert not bool(((unclamped - big).abs() <= allowed).all())  # inf: beyond any bound


def test_groups_along_tokens_are_bounded_over_the_group_per_channel():
    declared = Quantized(2, group=4, along="tokens")
    rows = torch.randn(1, 1, 8, 6, dtype=torch.float64)
    rows[..., 0] *= 50  # an outlier channel, as a key's are
    grouped = rows.unflatten(2, (2, 4))
    low, high = grouped.amin(3, keepdim=True), grouped.amax(3, keepdim=True)
    step = (high - low) / 3
    coded = (low + ((grouped - low) / step).round() * step).flatten(2, 3)
    assert bool(((coded - rows).abs() <= declared.allowed_error(rows, torch.float64)).all())
    per_token_low, per_token_high = rows.amin(-1, keepdim=True), rows.amax(-1, keepdim=True)
    per_token_step = (per_token_high - per_token_low) / 3
    wrong = per_token_low + ((rows - per_token_low) / per_token_step).round() * per_token_step
    assert not bool(((wrong - rows).abs() <= declared.allowed_error(rows, torch.float64)).all())
    assert [declared.coded_rows(n) for n in (3, 4, 7, 9)] == [0, 4, 4, 8]
    assert Quantized(2, group=4, along="tokens", recent=2).coded_rows(9) == 4


def test_the_floor_bounds_a_narrow_group_by_half_the_floor():
    floored = Quantized(4, min_step=2.0**-4)
    rows = 1 + torch.tensor([[0.0, 0.01, 0.02, 0.04]], dtype=torch.float64)
    step = torch.tensor(2.0**-4)  # the floor: the range's own step (0.04 / 15) is finer
    coded = rows.amin() + ((rows - rows.amin()) / step).round() * step
    assert bool(((coded - rows).abs() <= floored.allowed_error(rows, torch.float64)).all())
    assert not bool(((coded - rows).abs() <= Quantized(4).allowed_error(rows, torch.float64)).all())


def test_min_nbytes_counts_a_float_code_a_byte_and_a_group_along_tokens_per_channel():
    spec = CacheSpec(1, 1, 16, 64, torch.float32, torch.device("cpu"))
    exact = min_nbytes(spec, 16)
    fp8 = Quantized(8, codes=E4M3, symmetric=True)
    assert min_nbytes(spec, 16, (fp8, fp8), (16, 16)) == 2 * 16 * (16 + 2)
    fixed = Quantized(8, codes=E5M2, symmetric=True, scale=0.5)
    assert min_nbytes(spec, 16, (fixed, None), (16, 0)) == 16 * 16 + exact // 2
    kivi = Quantized(2, group=8, along="tokens")
    assert kivi.nbytes(16, 16) == 16 * 4 + 2 * 16 * 4
