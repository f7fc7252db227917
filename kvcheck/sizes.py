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

Those fields aim; ``supports`` (a ``Domain``, or a dict of its fields) bounds. A cache built
for part of the space only (a fused kernel's dtypes and head widths) declares it there::

    kv_sizes = {"supports": {"dtypes": ("float16", "bfloat16"), "head_dims": (64, 128)}}

and every draw then stays inside it (the helpers below read it while a search runs,
``aiming_at``), its edges hit on purpose (``edge``): each declared value, the largest batch,
the largest max_length. ``kvcheck.harness.build`` never builds a cache outside it
(``OutsideDomain``). The rules are in docs/contract.md, section 7.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from kvcheck import devices as kvdevices
from kvcheck import profiles
from kvcheck.devices import dtype_name
from kvcheck.failures import OutsideDomain
from kvref import CacheSpec


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Sizes.{name} must be a positive int, got {value!r}")
    return value


def _positives(name: str, values: object) -> tuple[int, ...]:
    if isinstance(values, int):  # Sizes(head_dims=128) means (128,)
        values = (values,)
    return tuple(_positive(name, value) for value in values)


def _even(name: str, values: tuple[int, ...]) -> None:
    if odd := [d for d in values if d % 2]:
        raise ValueError(f"{name} must be even (RoPE pairs channels), got {odd}")


def _read(cls: type, declared: object, what: str, name: str):
    """A ``cls`` from a declaration: one already, a mapping of its fields, or None (all
    unset), refusing a field ``cls`` does not have (a ``what``) by name."""
    if declared is None:
        return cls()
    if isinstance(declared, cls):
        return declared
    if not isinstance(declared, Mapping):
        raise TypeError(
            f"{name} must be a kvcheck.{cls.__name__} or a dict, got {type(declared).__name__}"
        )
    unknown = set(declared) - {field.name for field in dataclasses.fields(cls)}
    if unknown:
        known = ", ".join(field.name for field in dataclasses.fields(cls))
        raise ValueError(
            f"unknown {what} {', '.join(sorted(map(str, unknown)))}; a declaration may give {known}"
        )
    return cls(**declared)


def _dtype(value: object) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    dtype = getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"supports.dtypes: {value!r} is not a floating torch dtype")
    return dtype


# The kit needs this much room in a cache: an exhausted pool's plan needs up to 169 rows.
LEAST_MAX_LENGTH = 256
# Caches are built at the domain's largest max_length up to this; past it, a cache's rows
# and a model's allocation cost more than the edge is worth, and the verdict says so.
LARGEST_BUILT = 4096


@dataclass(frozen=True)
class Domain:
    """What a cache can be built for (``supports``): nothing is drawn outside it. Every
    field is optional; None (the default) is everything the kit draws."""

    dtypes: tuple[torch.dtype, ...] | None = None
    head_dims: tuple[int, ...] | None = None
    kv_heads: tuple[int, ...] | None = None
    groups: tuple[int, ...] | None = None  # query heads per kv head
    pages: tuple[int, ...] | None = None  # rows per page or block it runs with
    max_batch: int | None = None
    max_length: int | None = None
    windows: bool | None = None  # False: sliding windows are not supported
    devices: tuple[str, ...] | None = None  # device types: "cpu", "cuda", "mps"
    # Attention sinks (contract, section 8.5): the sink counts it takes beside a window (0: a
    # plain window). Unlike the fields above, None is "none": the kit draws sinks only for a
    # cache that lists them, in the property ``attention sinks``.
    sinks: tuple[int, ...] | None = None
    # Latent (MLA) layers (contract, section 10.2): values of another width than the keys.
    # Like sinks, None is "no": the kit draws MLA models and value_dim only for True.
    latent: bool | None = None
    # The latent widths d_c and rope widths d_r of the latent layers it takes (section 10.2;
    # a kernel such as FlashMLA is built for 512 and 64): None is any the kit draws.
    latent_dims: tuple[int, ...] | None = None
    rope_dims: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        def put(name, value):
            object.__setattr__(self, name, value)

        if self.dtypes is not None:
            names = (self.dtypes,) if isinstance(self.dtypes, str | torch.dtype) else self.dtypes
            put("dtypes", tuple(dict.fromkeys(_dtype(value) for value in names)))
        for name in ("head_dims", "kv_heads", "groups", "pages"):
            if getattr(self, name) is not None:
                put(name, tuple(sorted(set(_positives(f"supports.{name}", getattr(self, name))))))
        if self.head_dims is not None:
            _even("supports.head_dims", self.head_dims)
        if self.max_batch is not None:
            _positive("supports.max_batch", self.max_batch)
        if self.max_length is not None:
            _positive("supports.max_length", self.max_length)
            if self.max_length < LEAST_MAX_LENGTH:
                raise ValueError(
                    f"supports.max_length {self.max_length}: the kit's plans need a max_length "
                    f"of at least {LEAST_MAX_LENGTH}"
                )
        if self.windows is not None and not isinstance(self.windows, bool):
            raise ValueError(f"supports.windows must be True or False, got {self.windows!r}")
        if self.windows:
            put("windows", None)  # windows supported: what the kit draws anyway
        if self.devices is not None:
            devices = (self.devices,) if isinstance(self.devices, str) else self.devices
            put("devices", tuple(torch.device(str(d)).type for d in devices))
        if self.sinks is not None:
            sinks = (self.sinks,) if isinstance(self.sinks, int) else self.sinks
            if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in sinks):
                raise ValueError(f"supports.sinks must be ints >= 0, got {self.sinks!r}")
            put("sinks", tuple(sorted(set(sinks))))
            if self.sinks and 0 not in self.sinks:
                raise ValueError(
                    f"supports.sinks {self.sinks} lacks 0: the kit's other properties draw "
                    "plain windows (a window with 0 sinks), which every sink cache takes"
                )
            if self.windows is False and any(self.sinks):
                raise ValueError("supports.sinks: sinks sit beside a window, and windows is False")
        if self.latent is not None and not isinstance(self.latent, bool):
            raise ValueError(f"supports.latent must be True or False, got {self.latent!r}")
        self._check_latent_widths(put)
        for name in ("dtypes", "head_dims", "kv_heads", "groups", "pages", "devices", "sinks"):
            if getattr(self, name) == ():
                raise ValueError(f"supports.{name} is empty: the cache supports nothing")

    def _check_latent_widths(self, put) -> None:
        """``latent_dims`` and ``rope_dims``: positive ints (the rope widths even), not
        empty, and only beside ``latent: True``."""
        for name in ("latent_dims", "rope_dims"):
            if (values := getattr(self, name)) is None:
                continue
            if not self.latent:
                raise ValueError(
                    f"supports.{name} {values!r} without latent: True: latent widths are of "
                    "latent (MLA) layers, which the cache does not declare"
                )
            if values == ():
                raise ValueError(f"supports.{name} is empty: the cache supports nothing")
            put(name, tuple(sorted(set(_positives(f"supports.{name}", values)))))
        if self.rope_dims is not None:
            _even("supports.rope_dims", self.rope_dims)

    @classmethod
    def of(cls, declared: object) -> Domain:
        """A ``Domain`` from a declaration: a Domain, a mapping of its fields, or None."""
        return _read(cls, declared, "supports field", "supports")

    def over(self, other: Domain) -> Domain:
        """This domain, with ``other``'s for the fields this leaves unset."""
        return Domain(**{f.name: _first_set(self, other, f.name) for f in dataclasses.fields(self)})

    @property
    def declared(self) -> bool:
        return self != ANY

    def refuses(self, spec: CacheSpec) -> str | None:
        """What puts ``spec`` outside this domain, or None."""
        latent = spec.value_dim is not None
        checks = (
            (self.dtypes, spec.dtype, "dtype"),
            *self._width_checks(spec),
            (self.kv_heads, spec.kv_heads, "kv_heads"),
            (self.devices, torch.device(spec.device).type, "device"),
        )
        for supported, value, name in checks:
            if supported is not None and value not in supported:
                return f"{name} {_shown(value)} (supports {', '.join(map(_shown, supported))})"
        for bound, value, name in (
            (self.max_batch, spec.batch, "batch"),
            (self.max_length, spec.max_length, "max_length"),
        ):
            if bound is not None and value > bound:
                return f"{name} {value} (supports up to {bound})"
        if self.windows is False and spec.window is not None:
            return f"window {spec.window} (supports no windows)"
        if spec.sinks not in self.sink_counts:
            takes = ", ".join(map(str, self.sink_counts))
            return f"{spec.sinks} attention sinks (supports {takes})"
        if latent and not self.latent:
            return f"value_dim {spec.value_dim} (supports values as wide as the keys only)"
        return None

    def _width_checks(self, spec: CacheSpec) -> tuple:
        """(supported, value, name) for the widths of ``spec``: an ordinary layer's head_dim,
        or a latent layer's latent and rope widths where they are declared (the rope width
        against head_dims where rope_dims is not, as before they could be)."""
        if spec.value_dim is None:
            return ((self.head_dims, spec.head_dim, "head_dim"),)
        rope = (self.rope_dims, spec.head_dim, "rope width (head_dim)")
        if self.rope_dims is None:
            rope = (self.head_dims, spec.head_dim, "head_dim")
        return (rope, (self.latent_dims, spec.value_dim, "latent width (value_dim)"))

    @property
    def sink_counts(self) -> tuple[int, ...]:
        """The sink counts a window spec may carry: the declared ones, or 0 alone."""
        return (0,) if self.sinks is None else self.sinks

    @property
    def offers_sinks(self) -> bool:
        """Whether it takes a window with sinks (the property ``attention sinks``)."""
        return any(self.sink_counts)

    @property
    def fewest_group(self) -> int:
        """The fewest query heads per kv head the domain supports (1 where it says nothing)."""
        return 1 if self.groups is None else self.groups[0]

    def refuses_group(self, group: int) -> str | None:
        if self.groups is not None and group not in self.groups:
            supported = ", ".join(map(str, self.groups))
            return f"{group} query heads per kv head (supports {supported})"
        return None

    @property
    def dtype_names(self) -> list[str]:
        """The supported dtypes by name, sorted ([] where any dtype is)."""
        return sorted(map(dtype_name, self.dtypes or ()))

    def tested(self) -> list[str]:
        """What the draws cover, field by field: "dtypes: bfloat16, float16", ..."""
        parts = [f"dtypes: {', '.join(self.dtype_names)}"] if self.dtypes is not None else []
        for field, label, _ in _LISTED:
            if (values := getattr(self, field)) is not None:
                parts.append(f"{label}: {', '.join(map(str, values))}")
        if self.max_batch is not None:
            parts.append(f"batch: up to {self.max_batch}")
        if self.max_length is not None:
            parts.append(f"max_length: up to {min(self.max_length, LARGEST_BUILT)}")
        if self.windows is False:
            parts.append("windows: none")
        if self.sinks is not None:
            parts.append(f"sinks: {', '.join(map(str, self.sinks))}")
        if self.latent:
            parts.append("latent (MLA) layers")
        return parts

    def left_out(self) -> list[str]:
        """What the kit would draw and this domain leaves out: "float32", "other head widths"."""
        out = []
        if self.dtypes is not None:
            out += sorted(dtype_name(d) for d in kvdevices.ALL_DTYPES if d not in self.dtypes)
        out += [others for field, _, others in _LISTED if getattr(self, field) is not None]
        if self.max_batch is not None:
            out.append(f"batches past {self.max_batch}")
        if self.max_length is not None:
            if self.max_length > LARGEST_BUILT:  # supported, but past what the kit builds
                out.append(f"max_length {LARGEST_BUILT + 1} to {self.max_length}")
            out.append(f"max_length past {self.max_length}")
        if self.windows is False:
            out.append("sliding windows")
        return out

    def describe(self) -> str:
        """ "dtypes: bfloat16, float16; head_dim: 64, 128; not tested: float32, float64, ..."."""
        if not self.declared:
            return "everything the kit draws"
        left_out = self.left_out()
        tail = [f"not tested: {', '.join(left_out)}"] if left_out else []
        return "; ".join([*self.tested(), *tail])

    def as_json(self) -> dict:
        fields = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None
        }
        if self.dtypes is not None:
            fields["dtypes"] = self.dtype_names
        return {
            "supports": fields,
            "tested": self.tested(),
            "not tested": self.left_out(),
            "described": self.describe(),
        }


# The listed fields as the verdict names them: (field, what was tested, what was left out).
_LISTED = (
    ("head_dims", "head_dim", "other head widths"),
    ("kv_heads", "kv_heads", "other kv-head counts"),
    ("groups", "query heads per kv head", "other query heads per kv head"),
    ("pages", "pages", "other pages"),
    ("devices", "devices", "other devices"),
    ("latent_dims", "latent widths", "other latent widths"),
    ("rope_dims", "rope widths", "other rope widths"),
)


def _shown(value: object) -> str:
    return dtype_name(value) if isinstance(value, torch.dtype) else str(value)


def _first_set(mine: object, other: object, name: str):
    value = getattr(mine, name)
    return value if value not in (None, ()) else getattr(other, name)


ANY = Domain()


@dataclass(frozen=True)
class Sizes:
    """What a cache declares about sizes: where the draws aim (``page``, ``head_dims``,
    ``kv_heads``, ``max_batch``: extra draws there) and what it supports (``supports``, a
    ``Domain``: nothing is drawn outside it). Every field is optional."""

    page: int | None = None  # rows per page, block or chunk: boundaries to hit on purpose
    head_dims: tuple[int, ...] = ()  # head widths the cache has a path for (even: RoPE)
    kv_heads: tuple[int, ...] = ()  # kv head counts it is built for
    max_batch: int | None = None  # the largest batch it serves
    supports: Domain = ANY  # what it can be built for

    def __post_init__(self) -> None:
        if self.page is not None:
            _positive("page", self.page)
        if self.max_batch is not None:
            _positive("max_batch", self.max_batch)
        for name in ("head_dims", "kv_heads"):
            object.__setattr__(self, name, _positives(name, getattr(self, name)))
        _even("Sizes.head_dims", self.head_dims)
        object.__setattr__(self, "supports", Domain.of(self.supports))
        if why := self.aims_outside():
            raise ValueError(f"the sizes aim outside what they support: {why}")

    def aims_outside(self) -> str | None:
        domain = self.supports
        for aimed, supported, name in (
            (self.head_dims, domain.head_dims, "head_dims"),
            (self.kv_heads, domain.kv_heads, "kv_heads"),
            ((self.page,) if self.page else (), domain.pages, "page"),
        ):
            if supported is not None and (outside := [v for v in aimed if v not in supported]):
                return f"{name} {outside} (supports {', '.join(map(str, supported))})"
        if domain.max_batch is not None and (self.max_batch or 0) > domain.max_batch:
            return f"max_batch {self.max_batch} (supports up to {domain.max_batch})"
        return None

    @classmethod
    def of(cls, declared: object) -> Sizes:
        """A ``Sizes`` from a declaration: a Sizes, a mapping of its fields, or None."""
        return _read(cls, declared, "size", "kv_sizes")

    def over(self, other: Sizes) -> Sizes:
        """These sizes, with ``other``'s for the fields these leave unset."""
        fields = {
            f.name: _first_set(self, other, f.name)
            for f in dataclasses.fields(self)
            if f.name != "supports"
        }
        return Sizes(**fields, supports=self.supports.over(other.supports))

    @property
    def aimed(self) -> bool:
        """Whether these sizes aim anywhere (page, head_dims, kv_heads or max_batch)."""
        return bool(self.page or self.head_dims or self.kv_heads or self.max_batch)

    def pages(self) -> tuple[int, ...]:
        """The pages whose boundaries the draws hit: the aimed one, else the supported."""
        return (self.page,) if self.page else self.supports.pages or ()

    def describe(self) -> str:
        """Where the draws aim ("page 128, head dims 64/128"); ``supports.describe()`` says
        what they are bounded to."""
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
    """The factory's own ``kv_sizes`` (looked up through functools.partial); a function of
    the kit's device (``kv_sizes(device)``) is called with it."""
    own = getattr(factory, "kv_sizes", None)
    if own is None and isinstance(factory, functools.partial):
        own = getattr(factory.func, "kv_sizes", None)
    if callable(own) and not isinstance(own, Sizes | Mapping):
        own = own(kvdevices.current())
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


def domain() -> Domain:
    """What the cache under test supports right now (everything outside ``aiming_at``)."""
    return current().supports


def edge(draw, label: str) -> bool:
    """A coin that lands one time in four: hit an edge of the domain (its largest batch,
    its largest max_length) on purpose."""
    return draw(st.integers(0, 3), label=f"{label} at the domain's edge?") == 3


def longest(limit: int) -> int:
    """``limit``, or the domain's largest max_length where that is smaller."""
    bound = domain().max_length
    return limit if bound is None else min(limit, bound)


def boundary_lengths(limit: int, low: int = 1) -> st.SearchStrategy[int]:
    """Lengths k x page - 1, k x page and k x page + 1 within [low, limit], for a declared
    page (half the time) or one of the usual page sizes."""
    if (page_sizes := pages(limit)) is None:
        return st.integers(low, limit)
    return _boundary_lengths(page_sizes, low, limit)


def pages(limit: int) -> st.SearchStrategy[int] | None:
    """A page of at most ``limit`` + 1 rows: a declared one half the time, else a usual one;
    None where none fits."""
    fitting = tuple(p for p in PAGES if p - 1 <= limit)
    declared = tuple(p for p in current().pages() if p - 1 <= limit)
    if not fitting and not declared:
        return None
    return declared_first(declared, fitting or declared)


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


def _supported(draw, supported: tuple[int, ...], aimed: tuple[int, ...], room, label: str):
    """One of the domain's values, each as often (the narrowest where none fits ``room``:
    inside the domain comes before the cost budget), an aimed one half the time."""
    fitting = tuple(_within(room, supported)) or supported[:1]
    return draw(declared_first(tuple(v for v in aimed if v in fitting), fitting), label=label)


@st.composite
def head_dims(
    draw, small=(2, 4, 6, 8), *, room: int | None = None, wide_one_in: int | None = None
) -> int:
    """A head width: mostly one of ``small``; with a coin (one in ``wide_one_in``, else the
    profile's share), a real one (a declared one first). None wider than ``room`` (but
    always the narrowest small one). Where the cache declares the widths it supports, one of
    those."""
    if (supported := domain().head_dims) is not None:
        return _supported(draw, supported, current().head_dims, room, "head_dim")
    declared = tuple(_within(room, current().head_dims))
    wide = tuple(_within(room, LARGE_HEAD_DIMS))
    if (wide or declared) and large(draw, "head_dim", wide_one_in):
        return draw(declared_first(declared, wide or declared), label="head_dim")
    return draw(st.sampled_from(_within(room, small) or small[:1]), label="head_dim")


@st.composite
def kv_head_counts(draw, small_max: int = 3, *, room: int | None = None) -> int:
    """Kv heads: mostly 1 to ``small_max``; with a coin, 4 to 8 or a declared count; the
    supported counts only, where the cache declares them."""
    if (supported := domain().kv_heads) is not None:
        return _supported(draw, supported, current().kv_heads, room, "kv_heads")
    declared = tuple(_within(room, current().kv_heads))
    wide = tuple(_within(room, LARGE_KV_HEADS))
    if (wide or declared) and large(draw, "kv_heads"):
        return draw(declared_first(declared, wide or declared), label="kv_heads")
    return draw(st.integers(1, _at_most(small_max, room)), label="kv_heads")


@st.composite
def groups(draw, *, room: int | None = None) -> int:
    """Query heads per kv head: mostly 1 (plain multi-head attention) to 3; with a coin,
    up to 8; the supported ones only, where the cache declares them."""
    if (supported := domain().groups) is not None:
        return _supported(draw, supported, (), room, "heads per kv head")
    wide = _within(room, LARGE_GROUPS)
    if wide and large(draw, "heads per kv head"):
        return draw(st.sampled_from(wide), label="heads per kv head")
    return draw(st.integers(1, _at_most(3, room)), label="heads per kv head")


@st.composite
def batches(draw, low: int = 1, small_max: int = 4, *, room: int | None = None) -> int:
    """A batch: mostly ``low`` to ``small_max``; with a coin, up to 8 or the declared
    largest, that largest itself often. Never above ``room`` unless ``low`` is, nor above
    the domain's largest batch, which a quarter of the draws hit."""
    bound = domain().max_batch
    if bound is not None and low > bound:
        raise OutsideDomain(f"a plan needs batch {low} or more; the cache supports up to {bound}")
    most = max(current().max_batch or LARGE_BATCH, small_max)
    if bound is not None:
        most = min(current().max_batch or bound, bound)  # an aimed largest, within the bound
        if low < bound and edge(draw, "batch"):
            return max(low, bound if room is None else min(bound, room))
    most = max(low, min(most, room)) if room is not None else most
    if most > small_max and large(draw, "batch"):
        return draw(st.one_of(st.just(most), st.integers(small_max + 1, most)), label="batch")
    return draw(st.integers(low, max(low, min(small_max, most))), label="batch")
