"""``kvref.held_nbytes``, the upper bound the memory property holds a lossy cache's nbytes to
(contract, section 10.1): it must find rows wherever a cache's attributes lead, or a correct
cache fails as over-reporting, and say "unknown" where it cannot see, or the bound passes a
cache it never measured."""

import dataclasses
import functools
import threading
from collections import deque
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from kvref import CacheSpec, Quantized, min_nbytes
from kvref.memory import held_nbytes


def rows(count: int) -> torch.Tensor:
    return torch.zeros(count, dtype=torch.uint8)


class Plain:
    pass


class Slotted:
    __slots__ = "codes"  # a string, not a tuple: one slot


class SlottedChild(Slotted):
    __slots__ = ("scales",)


@dataclass(slots=True)
class SlotsDataclass:
    codes: torch.Tensor


class SharedArena:
    arena: ClassVar[dict] = {"codes": rows(500)}  # every instance's rows in one class's dict


def holding(**attributes) -> Plain:
    plain = Plain()
    vars(plain).update(attributes)
    return plain


def linked(depth: int) -> Plain:
    """A linked list of ``depth`` chunks of 100 bytes each."""
    head = None
    for _ in range(depth):
        head = holding(rows=rows(100), next=head)
    return head


def test_each_storage_counts_once_and_whole():
    codes = rows(100)
    view = codes[10:20]
    assert held_nbytes(holding(a=codes, b=view, c=[codes, (view,)], d={"x": codes})) == 100


@pytest.mark.parametrize(
    ("made", "expected"),
    [
        (lambda: holding(codes=rows(100), lock=threading.Lock(), log=deque([rows(7)])), 107),
        (lambda: SlottedChild(), 0),
        (lambda: SlotsDataclass(rows(110)), 110),
        (lambda: SharedArena(), 500),
        (lambda: linked(20), 2000),
        (lambda: holding(read=holding(pool=[rows(300)]).__dict__.get), 300),
        (lambda: holding(read=functools.partial(print, rows(64))), 64),
        (lambda: holding(module=torch.nn.Linear(2, 3, bias=False)), 6 * 4),
        (lambda: holding(generator=torch.Generator(), name="x", size=torch.Size([2]), n=3), 0),
    ],
    ids=[
        "locks and deques",
        "empty slots",
        "a slots dataclass",
        "a class-level arena",
        "a long linked list",
        "a bound method of a dict",
        "a partial",
        "a module's parameters",
        "things that hold no rows",
    ],
)
def test_rows_are_found_wherever_the_attributes_lead(made, expected):
    assert held_nbytes(made()) == expected


def test_inherited_and_string_slots_are_read():
    child = SlottedChild()
    child.codes, child.scales = rows(100), rows(10)
    assert held_nbytes(child) == 110


def test_a_closure_is_read_and_a_bound_method_leads_to_its_object():
    pool = holding(codes=rows(40))
    closure = holding(read=(lambda: pool))
    bound = holding(read=holding(codes=rows(30)).__repr__)
    assert (held_nbytes(closure), held_nbytes(bound)) == (40, 30)


def test_what_it_cannot_see_into_is_unknown():
    sparse = torch.zeros(4, 4).to_sparse()
    assert held_nbytes(holding(codes=sparse)) is None
    assert held_nbytes(holding(handle=iter(range(3)))) is None  # an iterator: what is left?


def test_the_least_a_cache_holds_counts_rows_that_may_be_in_codes_as_given_where_less():
    # A correct cache may keep a row its declaration lets it code as given: for 2 numbers,
    # int8 codes with a scale and a zero point take 6 bytes, the row in bfloat16 4. Found by
    # a random soak seed on two independent caches of head_dim 2, whose nbytes (the rows as
    # given) the old bound, which counted every such row in codes, called too few.
    narrow = CacheSpec(1, 1, 2, 4, torch.bfloat16, torch.device("cpu"))  # B, H_kv, D, L
    per_token = Quantized(bits=8)
    assert min_nbytes(narrow, 4, (per_token, per_token), (1, 1)) == 2 * 4 * 4
    wide = dataclasses.replace(narrow, head_dim=64)
    coded = per_token.nbytes(1, 64)  # 64 codes + a scale and a zero point: 68 of 128 bytes
    assert min_nbytes(wide, 4, (per_token, per_token), (1, 1)) == 2 * (3 * 128 + coded)
    # Along tokens, a scale per channel for each whole group: a group's rows but one in codes
    # and that one as given can take less than all of them either way.
    kivi = Quantized(bits=2, group=4, along="tokens")
    rows = [kivi.nbytes(k, 2) + (4 - k) * 2 * 2 for k in range(5)]
    assert min_nbytes(narrow, 4, (kivi, None), (4, 0)) == min(rows) + 4 * 4
    assert min(rows) < min(rows[0], rows[4])
