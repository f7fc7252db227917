"""The sizes a cache is built around, and how the suite draws sizes to reach them.

Most bugs of a real cache live where it runs: a kernel for head_dim 128, eight kv heads,
batch 8, pages of 128 or 256 rows, chunked prefills of hundreds of tokens onto a warm cache,
an object reset dozens of times. The suite draws mostly small examples (fast, and they
shrink well) and a share of large ones in every profile: each dimension goes large on its
own coin (``LARGE_ONE_IN``), lengths land at and around powers of two, and the attention
cost of an example is bounded (``ATTENTION_BUDGET``), so that an example is large in one or
two dimensions at once, never in all.

A cache's author can say where its own edges are with ``Sizes``, next to the factory::

    class MyPagedCache:
        kv_sizes = kvcheck.Sizes(page=128, head_dims=(64, 128), max_batch=8)

(a plain dict with the same keys works too, so that a cache library need not import the
kit), or on a test class (``sizes = Sizes(...)``), or on the command line (``--kv-page``,
``--kv-head-dim``, ``--kv-heads``, ``--kv-max-batch``; these win, field by field). The
draws then hit lengths k x page - 1, k x page and k x page + 1, chunks that straddle pages,
the declared head widths and kv heads, and batches up to the declared largest.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from hypothesis import strategies as st

from kvcheck import profiles


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Sizes.{name} must be a positive int, got {value!r}")
    return value


@dataclass(frozen=True)
class Sizes:
    """The sizes a cache is designed around; every field is optional."""

    page: int | None = None  # rows per page, block or chunk: boundaries to hit on purpose
    head_dims: tuple[int, ...] = ()  # head widths the cache has a path for (even: RoPE)
    kv_heads: tuple[int, ...] = ()  # kv head counts it is built for
    max_batch: int | None = None  # the largest batch it serves

    def __post_init__(self) -> None:
        if self.page is not None:
            _positive("page", self.page)
        if self.max_batch is not None:
            _positive("max_batch", self.max_batch)
        for name in ("head_dims", "kv_heads"):
            values = getattr(self, name)
            if isinstance(values, int):  # Sizes(head_dims=128) means (128,)
                values = (values,)
            values = tuple(_positive(name, value) for value in values)
            object.__setattr__(self, name, values)
        if odd := [d for d in self.head_dims if d % 2]:
            raise ValueError(f"Sizes.head_dims must be even (RoPE pairs channels), got {odd}")

    @classmethod
    def of(cls, declared: object) -> Sizes:
        """A ``Sizes`` from a declaration: a Sizes, a mapping of its fields, or None."""
        if declared is None:
            return cls()
        if isinstance(declared, Sizes):
            return declared
        if isinstance(declared, Mapping):
            unknown = set(declared) - {field.name for field in dataclasses.fields(cls)}
            if unknown:
                raise ValueError(
                    f"unknown size {', '.join(sorted(map(str, unknown)))}; a declaration may "
                    "give page, head_dims, kv_heads and max_batch"
                )
            return cls(**declared)
        raise TypeError(
            f"kv_sizes must be a kvcheck.Sizes or a dict, got {type(declared).__name__}"
        )

    def over(self, other: Sizes) -> Sizes:
        """These sizes, with ``other``'s for the fields these leave unset."""
        return Sizes(
            **{
                field.name: getattr(self, field.name) or getattr(other, field.name)
                for field in dataclasses.fields(self)
            }
        )

    def describe(self) -> str:
        parts = []
        if self.page:
            parts.append(f"page {self.page}")
        if self.head_dims:
            parts.append(f"head dims {'/'.join(map(str, self.head_dims))}")
        if self.kv_heads:
            parts.append(f"kv heads {'/'.join(map(str, self.kv_heads))}")
        if self.max_batch:
            parts.append(f"batch up to {self.max_batch}")
        return ", ".join(parts) or "none declared"


NONE = Sizes()
_in_force: ContextVar[Sizes] = ContextVar("kvcheck_sizes", default=NONE)
_from_options: list[Sizes] = [NONE]  # set once per run by the plugin


def choose_options(sizes: Sizes) -> None:
    """The sizes given on the command line, for every cache of the run."""
    _from_options[:] = [sizes]


def from_options() -> Sizes:
    return _from_options[0]


def declared_on(factory: object) -> Sizes:
    """The factory's own ``kv_sizes`` (looked up through functools.partial)."""
    own = getattr(factory, "kv_sizes", None)
    if own is None and isinstance(factory, functools.partial):
        own = getattr(factory.func, "kv_sizes", None)
    return Sizes.of(own)


def declared_by(factory: object, test_class: type | None = None) -> Sizes:
    """The sizes in force for ``factory``: the command line's, then the test class's
    ``sizes``, then the factory's own ``kv_sizes``, field by field."""
    by_class = Sizes.of(getattr(test_class, "sizes", None))
    return from_options().over(by_class.over(declared_on(factory)))


def current() -> Sizes:
    """The sizes the draws aim at right now (none declared outside ``aiming_at``)."""
    return _in_force.get()


@contextmanager
def aiming_at(sizes: Sizes) -> Iterator[None]:
    """Draw for ``sizes`` while the block runs (the kit wraps each search in it)."""
    token = _in_force.set(sizes)
    try:
        yield
    finally:
        _in_force.reset(token)


# --- The draws --------------------------------------------------------------------------

# Each dimension goes large on its own coin: one in LARGE_ONE_IN, so about half of all
# examples are small in every dimension and shrinking (to index 0: small) stays easy. The
# thorough profile, a long run, spends more of its examples large: one in THOROUGH_ONE_IN.
LARGE_ONE_IN = 10
THOROUGH_ONE_IN = 4
# Where no model runs (cache-level properties), length and lifetime cost little: oftener.
LONG_ONE_IN = 4
# Batch x query heads x length^2 x (head_dim + SCORE_COST) of an example's attention: past
# it, a large draw falls back to a small one. 2**24 is a few ms on one core. Each score
# also costs a mask, a fill and a softmax, whatever the head's width: SCORE_COST.
ATTENTION_BUDGET = 2**24
SCORE_COST = 16
# Head widths of real models: 64 and 128 most often, then the rest (80, 96 and 112 have a
# tail past a multiple of 32 or 64, where vectorised paths keep a scalar loop).
LARGE_HEAD_DIMS = (64, 128, 64, 128, 256, 80, 96, 112, 160, 192, 32)
LARGE_KV_HEADS = (8, 4, 6, 5, 7)
LARGE_GROUPS = (8, 4, 6, 2, 7)  # query heads per kv head
LARGE_BATCH = 8
# Page and block sizes of real caches: lengths are drawn at and around their multiples.
PAGES = (16, 32, 64, 128, 256, 512, 1024)
LONG = 1100  # long sessions reach past 1,024 tokens
LONG_LIVED = 24  # rounds of poisoned rows and resets one cache goes through (no model)
# Numbers in one key tensor of a cache-level example (batch x kv heads x rows x head_dim):
# no model runs there, so they go long and wide at once, within this.
ROWS_BUDGET = 2**16


def large(draw, label: str, one_in: int | None = None) -> bool:
    """One coin: whether a dimension goes large in this example (index 0, where shrinking
    goes, is small); one in ``one_in``, by default the profile's share."""
    if one_in is None:
        thorough = profiles.current_name() == "thorough"
        one_in = THOROUGH_ONE_IN if thorough else LARGE_ONE_IN
    return draw(st.integers(0, one_in - 1), label=f"{label} large?") == one_in - 1


def declared_first(declared: tuple[int, ...], usual: tuple[int, ...]) -> st.SearchStrategy:
    """Half the time one of the declared sizes (when there are any), else a usual one."""
    usual_ones = st.sampled_from(usual)
    return st.one_of(st.sampled_from(declared), usual_ones) if declared else usual_ones


def boundary_lengths(limit: int, low: int = 1) -> st.SearchStrategy[int]:
    """Lengths k x page - 1, k x page and k x page + 1 within [low, limit], for the declared
    page (half the time) or one of the usual page sizes."""
    page = current().page
    fitting = tuple(p for p in PAGES if p - 1 <= limit)
    declared = (page,) if page and page - 1 <= limit else ()
    if not fitting and not declared:
        return st.integers(low, limit)
    return _boundary_lengths(declared_first(declared, fitting or declared), low, limit)


@st.composite
def _boundary_lengths(draw, pages: st.SearchStrategy[int], low: int, limit: int) -> int:
    page = draw(pages, label="page")
    k = draw(st.integers(1, max(1, (limit + 1) // page)), label="pages")
    near = [n for n in (k * page, k * page - 1, k * page + 1) if low <= n <= limit]
    return draw(st.sampled_from(near), label="length") if near else low


def _within(room: int | None, values) -> list[int]:
    return [v for v in values if room is None or v <= room]


def _at_most(most: int, room: int | None) -> int:
    """``most``, or less to fit ``room`` (None: no limit), but at least 1."""
    return max(1, most if room is None else min(most, room))


@st.composite
def head_dims(draw, small=(2, 4, 6, 8), *, room: int | None = None) -> int:
    """A head width: mostly one of ``small``; with a coin, a real one (a declared one
    first). None wider than ``room`` (but always the narrowest small one)."""
    declared = tuple(_within(room, current().head_dims))
    wide = tuple(_within(room, LARGE_HEAD_DIMS))
    if (wide or declared) and large(draw, "head_dim"):
        return draw(declared_first(declared, wide or declared), label="head_dim")
    return draw(st.sampled_from(_within(room, small) or small[:1]), label="head_dim")


@st.composite
def kv_head_counts(draw, small_max: int = 3, *, room: int | None = None) -> int:
    """Kv heads: mostly 1 to ``small_max``; with a coin, 4 to 8 or a declared count."""
    declared = tuple(_within(room, current().kv_heads))
    wide = tuple(_within(room, LARGE_KV_HEADS))
    if (wide or declared) and large(draw, "kv_heads"):
        return draw(declared_first(declared, wide or declared), label="kv_heads")
    return draw(st.integers(1, _at_most(small_max, room)), label="kv_heads")


@st.composite
def groups(draw, *, room: int | None = None) -> int:
    """Query heads per kv head: mostly 1 (plain multi-head attention) to 3; with a coin,
    up to 8."""
    wide = _within(room, LARGE_GROUPS)
    if wide and large(draw, "heads per kv head"):
        return draw(st.sampled_from(wide), label="heads per kv head")
    return draw(st.integers(1, _at_most(3, room)), label="heads per kv head")


@st.composite
def batches(draw, low: int = 1, small_max: int = 4, *, room: int | None = None) -> int:
    """A batch: mostly ``low`` to ``small_max``; with a coin, up to 8 or the declared
    largest, that largest itself often. Never above ``room`` unless ``low`` is."""
    most = max(current().max_batch or LARGE_BATCH, small_max)
    most = max(low, min(most, room)) if room is not None else most
    if most > small_max and large(draw, "batch"):
        return draw(st.one_of(st.just(most), st.integers(small_max + 1, most)), label="batch")
    return draw(st.integers(low, max(low, min(small_max, most))), label="batch")
