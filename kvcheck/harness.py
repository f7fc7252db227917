"""A cache under watch: the recorder between the model (or a check) and the cache.

``Recorder`` wraps a cache without changing what it does and keeps its own copy of every
row given since the last reset, so any check can compare what the cache returns with what
it was given. It runs one of two paths, as the reference model would call the cache:

- ``"append"``: the model appends and attends over the rows returned (``attend`` hidden);
- ``"attend"``: the model calls the cache's own ``attend`` (where it has one), as paged and
  chunked engines decode; the rows it keeps are then seen only through attention, and each
  call's query and output are kept for the diagnosis.

A check on a correct cache passes on both paths; the kit runs the core properties on each
path a cache offers (``PATHS``), so a verdict never says "pass" for a path it did not run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
from torch import Tensor

from kvcheck import asserts as kvassert
from kvcheck import failures
from kvcheck import sizes as kvsizes
from kvcheck.asserts import (
    assert_returned_rows,
    coarser,
    differing_rows,
    needs_reference,
)
from kvcheck.strategies import DTYPES, CachePlan, supported_dtypes
from kvcheck.tensors import extremes_allowed, rows_of_kind
from kvref import (
    CacheContractError,
    CacheFactory,
    CacheSpec,
    LayerCache,
    ModelConfig,
    attention,
    capabilities,
)
from kvref.checks import is_row_shift
from kvref.protocol import kept_rows, keys_stored, rows_needed
from kvref.quantized import Quantized, storage
from kvref.rows import row_slots
from kvref.shift_oracle import shifted_rows

PATHS = ("append", "attend")


def offers_attend(cache: object) -> bool:
    """Whether the model may take the attend path through ``cache``: it computes attention
    itself, per head (``attend``) or over latents (``attend_latent``, section 10.2)."""
    return bool({"attend", "attend_latent"} & capabilities(cache))


def build(factory: CacheFactory, spec: CacheSpec) -> LayerCache:
    """``factory(spec)``: the one way the kit builds a cache. Never outside the domain the
    cache declares (``kvsizes.OutsideDomain``); inside a declared one, a refusal blames the
    declaration; with none declared, the error says how to declare one."""
    if getattr(factory, "builds_through_kit", False):  # its own caches come through here
        return factory(spec)
    domain = kvsizes.domain()
    if why := domain.refuses(spec):
        raise kvsizes.OutsideDomain(f"a cache for {spec}: {why}")
    try:
        return factory(spec)
    except Exception as error:
        if not domain.declared:
            error.add_note(
                f"(the factory refused {spec}; if the cache is not built for this, declare what "
                "it supports: kv_sizes = {'supports': {...}}, docs/contract.md section 7)"
            )
            raise
        raise failures.RefusesValidInput(
            f"the factory refused to build a cache for {spec}, which is inside the domain the "
            f"cache declares ({domain.describe()}): the declaration is wider than what the "
            f"cache supports, or the cache has a bug there\n  {type(error).__name__}: {error}"
        ) from error


def builder(factory: CacheFactory):
    """``factory``, built through ``build`` (for ``ReferenceTransformer.new_caches``)."""
    return lambda spec: build(factory, spec)


class Recorder:
    """A cache passed through unchanged and watched.

    ``given`` is the rows appended since the last reset (None while there are none),
    ``returned`` what the last append returned (copied: a cache's views are valid only until
    its next call), ``views`` the tensors themselves (read again later, while the contract
    says they are still valid), and ``new_tokens`` how many rows the last call brought. A
    cache built with a ``window`` may return only a recent run of ``given``.
    """

    def __init__(
        self,
        cache: LayerCache,
        window: int | None = None,
        path: str = "append",
        sinks: int = 0,
        rope_base: float = 10_000.0,
    ):
        if path == "attend" and not offers_attend(cache):
            # The kit chose the path from a probe whose cache had attend(): a cache must offer
            # a capability for every spec or for none, or the attend path would not be run.
            raise CacheContractError(
                f"the cache built for {getattr(cache, 'spec', 'this spec')} has no attend(), "
                "though the one built for the kit's probe has: offer it for every spec or none"
            )
        self.cache = cache
        self.window = window
        self.sinks = sinks  # attention sinks beside the window (contract, section 8.5)
        # Context shifts (section 8.4): the keys given are re-rotated as the cache's must be,
        # in float64; ``rerotated`` maps the index of each key a shift moved to the counts of
        # the shifts that moved it, the rounding a cache may add (asserts.shift_rounding).
        self.rope_base = rope_base
        self.rerotated: dict[int, tuple[int, ...]] = {}
        self.path = path
        self.given: tuple[Tensor, Tensor] | None = None
        self.returned: tuple[Tensor, Tensor] | None = None
        self.views: tuple[Tensor, Tensor] | None = None
        self.attended: tuple[Tensor, Tensor] | None = None  # the last attend's query, output
        self.latent_scale: float | None = None  # the last attend_latent's scale, if it was one
        self.attended_latent = False  # whether attend_latent was ever called
        self.new_tokens = 0
        self.resets = 0
        self.lent: tuple[Tensor, ...] = ()
        # Rows of their own (contract, section 8.1): per batch row, the (keys, values) it was
        # given since its reset, (H_kv, rows, D) each; and what append_rows last returned.
        self.rows_given: list[tuple[Tensor, Tensor]] | None = None
        self.rows_returned: tuple[Tensor, Tensor, Tensor] | None = None
        # After shifts per row (section 8.4): per row, the index of each key they moved to
        # the counts that moved it, as ``rerotated`` is for the whole batch.
        self.rows_rerotated: list[dict[int, tuple[int, ...]]] | None = None
        # Lossy storage (contract, section 10.1): what the cache declares for keys and values,
        # and for each, how many of the first rows given since the reset may be in codes (a
        # row may be from the moment it leaves the declared recent rows: a truncate that brings
        # the window back over it does not bring its precision back).
        self.storage = storage(cache)
        self.quantized_below = [0, 0]
        # Rows carried in from another cache (a move, section 11.2) keep the error its
        # storage gave them: its declaration, the coarser per part where two cross.
        self.carried: list[Quantized | None] = [None, None]
        # Rows of their own: per batch row, [keys, values] below which its rows may be in
        # codes, each row's recent run its own (section 10.1).
        self.rows_below: list[list[int]] | None = None

    def __getattr__(self, name: str):
        if name in ("attend", "attend_latent"):
            if self.path == "attend" and name in capabilities(self.cache):
                return self._attend if name == "attend" else self._attend_latent
            # Hidden: the model appends through the recorder, and every row returned is
            # checked against the rows given.
            raise AttributeError(name)
        return getattr(self.cache, name)  # e.g. the optional `spec` the model looks for

    @property
    def length(self) -> int:
        return self.cache.length

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes

    @property
    def given_length(self) -> int:
        return 0 if self.given is None else self.given[0].shape[2]

    def _lend(self, *tensors: Tensor) -> tuple[Tensor, ...]:
        # The cache gets copies that are scribbled over at the next call, as by an engine
        # that reuses its input buffers: a cache that keeps the caller's tensors instead of
        # copying them then shows nan where earlier keys and values should be.
        for tensor in self.lent:
            tensor.fill_(float("nan"))
        self.lent = tuple(tensor.clone() for tensor in tensors)
        return self.lent

    def _record(self, key: Tensor, value: Tensor) -> None:
        if (
            self.given is not None
            and key.shape[:2] + key.shape[3:] != self.given[0].shape[:2] + self.given[0].shape[3:]
        ):
            from kvcheck.failures import AcceptsBadInput

            raise AcceptsBadInput(
                f"the cache took rows shaped {tuple(key.shape)} after rows shaped "
                f"{tuple(self.given[0].shape)}: an append of another batch, number of kv heads "
                f"or head_dim than its spec's must be refused"
            )
        new = (key.clone(), value.clone())
        if self.given is not None:
            new = tuple(
                torch.cat((old, rows), dim=2) for old, rows in zip(self.given, new, strict=True)
            )
        self.given = new
        self.new_tokens = key.shape[2]
        self.quantized_below = self.coded_below(self.quantized_below, self.given_length)

    def coded_below(self, below: list[int], length: int) -> list[int]:
        """For keys and values, the rows that may be in codes once ``length`` rows were given,
        ``below`` of them before: every row past the declared recent run, and those already
        (a row's precision never comes back; rows carried in keep theirs). Along tokens, only
        whole groups (``Quantized.coded_rows``)."""
        return [
            max(held, declared.coded_rows(length)) if declared else held
            for held, declared in zip(below, self.storage, strict=True)
        ]

    def hold_given(self, given: tuple[Tensor, Tensor] | None, in_codes: int | None = None):
        """Hold ``given`` as the rows given since the reset (a prefix hit's, an import's, a
        commit's): the first ``in_codes`` of them may be in codes, by default all but the
        declared recent run."""
        self.given = given
        if in_codes is None:
            self.quantized_below = self.coded_below([0, 0], self.given_length)
        else:
            self.quantized_below = [in_codes if part else 0 for part in self.storage]

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        # Valid until this cache's next call, whatever that call does.
        self.views = self.rows_returned = None
        # A refusal records nothing.
        all_keys, all_values = self.cache.append(*self._lend(key, value))
        self._record(key, value)
        self.views = (all_keys, all_values)
        self.returned = (all_keys.clone(), all_values.clone())
        self.attended = None
        return all_keys, all_values

    def _attend(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        group = query.shape[1] // max(1, key.shape[1])
        # The kit's own wrappers (tensor-parallel shards) hold caches of other groups.
        kits = getattr(self.cache, "builds_through_kit", False)
        if not kits and (why := kvsizes.domain().refuses_group(group)):
            raise kvsizes.OutsideDomain(f"an attend of {why}")
        self.views = self.returned = None
        lent_query, *lent = self._lend(query, key, value)
        output = self.cache.attend(lent_query, *lent)
        self._record(key, value)
        self.views = self.returned = None
        copied = output.clone() if isinstance(output, Tensor) else output
        self.attended, self.latent_scale = (query.clone(), copied), None
        return output

    def _attend_latent(self, query: Tensor, key: Tensor, value: Tensor, scale: float) -> Tensor:
        self.views = self.returned = None
        lent_query, *lent = self._lend(query, key, value)
        output = self.cache.attend_latent(lent_query, *lent, scale)
        self._record(key, value)
        copied = output.clone() if isinstance(output, Tensor) else output
        self.attended, self.latent_scale = (query.clone(), copied), scale
        self.attended_latent = True  # its logits are held to kvassert.LATENT_ATTEND_BUDGETS
        return output

    def fewest_rows(self) -> int:
        """The fewest rows the last append may return: all without a window, else the last
        W - 1 before the new ones and the new ones."""
        return rows_needed(self.window, self.given_length, self.new_tokens, self.sinks)

    def kept(self, held: int) -> list[int]:
        """Which rows given since the reset ``held`` returned rows are: the sinks, then the
        most recent run (``kvref.protocol.kept_rows``)."""
        return kept_rows(self.sinks, held, self.given_length)

    def views_changed(self) -> list[int] | None:
        """Rows (positions from the first returned) at which the views the last append (or
        append_rows: rule 2 holds for its keys and values too) returned no longer hold what
        they held then; None when there is nothing to read."""
        copies = self.returned if self.rows_returned is None else self.rows_returned
        if self.views is None or copies is None:
            return None

        changed: set[int] = set()
        for view, copy in zip(self.views, copies[:2], strict=True):
            changed.update(differing_rows(view, copy))
        return sorted(changed)

    def reset(self) -> None:
        self.views = None
        self.cache.reset()
        self._forget()
        self.resets += 1  # a message may say that rows came back from before one

    def _forget(self) -> None:
        self.given = self.returned = self.attended = None
        self.rows_given = self.rows_returned = self.rows_rerotated = None
        self.rerotated = {}
        self.quantized_below = [0, 0]
        self.carried = [None, None]
        self.rows_below = None

    # --- rows of their own: passed through, and recorded row by row -----------------------
    def append_rows(self, key: Tensor, value: Tensor, counts) -> tuple[Tensor, Tensor, Tensor]:
        self.views = self.returned = self.rows_returned = None
        returned = self.cache.append_rows(*self._lend(key, value), counts)
        rows = len(counts)
        given = self.rows_given or [
            (key[b, :, :0].clone(), value[b, :, :0].clone()) for b in range(rows)
        ]
        padding = getattr(self.cache, "padding", "right")
        for b, count in enumerate(counts):
            slots = row_slots(padding, key.shape[2], count)
            given[b] = tuple(
                torch.cat((old, new[b, :, slots]), dim=1)
                for old, new in zip(given[b], (key, value), strict=True)
            )
        self.rows_given = given
        before = self.rows_below or [[0, 0] for _ in given]
        self.rows_below = [
            self.coded_below(below, keys.shape[1])
            for below, (keys, _) in zip(before, given, strict=True)
        ]
        # Any three tensors the model unpacks (a list too), so that none escapes the check of
        # the rows held; anything else the model's guard refuses.
        if isinstance(returned, (tuple, list)) and all(isinstance(t, Tensor) for t in returned):
            self.rows_returned = tuple(t.clone() for t in returned)
            self.views = tuple(returned[:2])
        return returned

    def truncate_rows(self, lengths) -> None:
        self.views = self.rows_returned = None
        self.cache.truncate_rows(lengths)
        if self.rows_given is not None:
            self.rows_given = [
                (k[:, :n], v[:, :n]) for (k, v), n in zip(self.rows_given, lengths, strict=True)
            ]
        if self.rows_below is not None:
            self.rows_below = [
                [min(part, n) for part in below]
                for below, n in zip(self.rows_below, lengths, strict=True)
            ]
        if self.rows_rerotated is not None:  # each row keeps the moves of the rows it keeps
            self.rows_rerotated = [
                {i: moved for i, moved in row.items() if i < n}
                for row, n in zip(self.rows_rerotated, lengths, strict=True)
            ]

    def select_rows(self, indices: Tensor) -> None:
        self.views = self.rows_returned = None
        self.cache.select_rows(indices)
        if self.rows_given is not None:
            self.rows_given = [self.rows_given[b] for b in indices.tolist()]
        if self.rows_below is not None:
            self.rows_below = [self.rows_below[b] for b in indices.tolist()]
        if self.rows_rerotated is not None:
            self.rows_rerotated = [self.rows_rerotated[b] for b in indices.tolist()]

    def join(self, other: Recorder) -> None:
        self.views = self.rows_returned = None
        like = (self.rows_given or other.rows_given or [None])[0]
        mine, theirs = self._given_by_row(like), other._given_by_row(like)
        below = [*self._rows_below_or_none(), *other._rows_below_or_none()]
        moved = None  # each row's keys a shift per row re-rotated, where either side has some
        if self.rows_rerotated is not None or other.rows_rerotated is not None:
            moved = [*(self.rows_rerotated or [{}] * len(mine))]
            moved += other.rows_rerotated or [{}] * len(theirs)
        self.cache.join(other.cache)
        self.rows_below, self.rows_rerotated = below, moved
        self.rows_given = None if like is None else [*mine, *theirs]

    def _given_by_row(self, like: tuple[Tensor, Tensor] | None) -> list[tuple[Tensor, Tensor]]:
        """``rows_given``; where nothing was given since the reset, an empty row shaped as
        ``like`` for each row the cache holds (its ``row_lengths``: rows may have left
        before any was fed)."""
        if self.rows_given is not None or like is None:
            return self.rows_given or []
        return [(like[0][:, :0], like[1][:, :0])] * len(self.cache.row_lengths)

    def _rows_below_or_none(self) -> list[list[int]]:
        """``rows_below``, or none in codes for each row given (each row held, where none
        was given)."""
        return self.rows_below or [[0, 0] for _ in self.rows_given or self.cache.row_lengths]

    def reset_at(self, first_position) -> None:
        self.views = None
        self.cache.reset_at(first_position)
        self._forget()

    def shift(self, start, count) -> None:
        self.views = self.returned = None
        self.cache.shift(start, count)
        if is_row_shift(start, count):  # a shift per row: the record follows each row's own
            self.rows_returned = None
            self._shift_rows_given(start, count)
            return
        if self.given is not None:
            stored = keys_stored(self.cache)
            self.given = shifted_rows(*self.given, start, count, self.rope_base, stored)
            # Moved rows are re-rotated, and re-quantized: any of them may be in codes now.
            self.quantized_below = [self.given_length if part else 0 for part in self.storage]
            if stored == "rotated":  # else the keys are moved as they are: bit for bit
                moved = range(start + count, self.given_length + count)  # indices before it
                kept = {i: counts for i, counts in self.rerotated.items() if i < start}
                for i in moved:
                    kept[i - count] = (*self.rerotated.get(i, ()), count)
                self.rerotated = kept

    def _shift_rows_given(self, starts, counts) -> None:
        """Each row's given rows as the per-row shift left them (re-rotated in float64 where
        keys are stored rotated), and which of its keys each shift moved."""
        if self.rows_given is None:
            return
        stored = keys_stored(self.cache)
        moved_rows = self.rows_rerotated or [{} for _ in self.rows_given]
        for row, (start, count) in enumerate(zip(starts, counts, strict=True)):
            if not count:
                continue
            keys, values = (part[None] for part in self.rows_given[row])
            keys, values = shifted_rows(keys, values, start, count, self.rope_base, stored)
            self.rows_given[row] = (keys[0], values[0])
            if self.rows_below is not None:  # moved rows re-coded: any may be in codes now
                self.rows_below[row] = [keys.shape[2] if part else 0 for part in self.storage]
            if stored == "rotated":
                moved_rows[row] = moved_down(moved_rows[row], start, count, keys.shape[2])
        self.rows_rerotated = moved_rows

    # The optional capabilities, passed through; the record follows only a call that returns.
    def truncate(self, length: int) -> None:
        self.views = self.returned = None
        self.cache.truncate(length)
        if self.given is not None:
            self.given = tuple(rows[:, :, :length] for rows in self.given)
            self.rerotated = {i: c for i, c in self.rerotated.items() if i < length}
            self.quantized_below = [min(below, length) for below in self.quantized_below]

    def reorder(self, indices: Tensor) -> None:
        self.views = self.returned = None
        self.cache.reorder(indices)
        if self.given is not None:
            self.given = tuple(rows[indices.to(rows.device)] for rows in self.given)

    def fork(self) -> Recorder:
        self.views = None
        twin = Recorder(self.cache.fork(), self.window, self.path, self.sinks, self.rope_base)
        twin.take_history(self)
        return twin

    def take_history(self, other: Recorder) -> None:
        """Hold what ``other`` was given since its reset: its fork, or where its rows moved."""
        self.given, self.rerotated = other.given, dict(other.rerotated)
        self.quantized_below = list(other.quantized_below)
        self.carried = [coarser(*parts) for parts in zip(other.storage, other.carried, strict=True)]

    def attended_and_reference(self) -> tuple[object, Tensor]:
        """What the last attend returned, and the reference attention of its query over the
        rows given since the reset (masked by absolute position, as the model masks)."""
        query, got = self.attended
        keys, values = self.given
        positions = torch.arange(self.given_length, device=query.device)
        new = positions[self.given_length - self.new_tokens :]
        scale = self.latent_scale
        if scale is not None:  # attend_latent: over [latent ; rope key], the latents as values
            keys = torch.cat((values, keys), dim=-1)
        return got, attention(
            query, keys, values, new, positions, self.window, sink_end=self.sinks, scale=scale
        )


def moved_down(
    rerotated: dict[int, tuple[int, ...]], start: int, count: int, held: int
) -> dict[int, tuple[int, ...]]:
    """``rerotated`` (index -> the counts of the shifts that moved that key) after a shift of
    ``count`` from ``start`` that leaves ``held`` rows: the keys after the span move down."""
    kept = {i: counts for i, counts in rerotated.items() if i < start}
    for i in range(start + count, held + count):  # indices before the shift
        kept[i - count] = (*rerotated.get(i, ()), count)
    return kept


def record(caches: Iterable[LayerCache], config: ModelConfig, path: str = "append"):
    """One recorder per distinct cache object (each knowing its layer's window), so that a
    factory that hands the same object to every layer still meets the model's guard; None
    for a layer that reads another's cache (``ModelConfig.kv_sources``)."""
    recorders: dict[int, Recorder] = {}
    return [
        None
        if cache is None
        else recorders.setdefault(
            id(cache),
            Recorder(
                cache,
                config.layer_window(layer),
                path,
                config.layer_sinks(layer),
                config.rope_base,
            ),
        )
        for layer, cache in enumerate(caches)
    ]


def recorded(factory: CacheFactory, spec: CacheSpec, path: str = "append") -> Recorder:
    """A recorded cache from ``factory`` for ``spec``."""
    return Recorder(build(factory, spec), spec.window, path, spec.sinks, spec.rope_base)


# What the cache-level properties' specs must reach (kvcheck.reach), noted by note_spec.
SPEC_EDGES = ("a window cache", "a batch of 2 or more", "2 or more kv heads", "half precision")


def note_spec(spec: CacheSpec) -> None:
    """Note which of ``SPEC_EDGES`` a cache built for ``spec`` reaches."""
    from kvcheck import reach
    from kvcheck.strategies import HALF_DTYPES

    reached = (spec.window is not None, spec.batch >= 2, spec.kv_heads >= 2)
    for name, hit in zip(SPEC_EDGES, (*reached, spec.dtype in HALF_DTYPES), strict=True):
        if hit:
            reach.note(name)


def warm(factory: CacheFactory, plan: CachePlan) -> Recorder:
    """A recorded cache from ``factory`` after the plan's appends of rows of its kind, each
    append's rows and the length after it checked: a cache that goes wrong while warming up
    is reported as that, before any call the property is about."""

    cache = recorded(factory, plan.spec)
    kind = rows_written(plan, cache)
    where = f"while warming the cache up, before any call under test: {plan.describe()}"
    for step, rows in enumerate(plan.chunks):
        keys = rows_of_kind(kind, plan.spec, rows, seed=step)
        cache.append(keys, rows_of_kind(kind, plan.spec, rows, seed=100 + step, values=True))
        who = f"warm-up append #{step}"
        assert_returned_rows(cache, who=who, where=where)
        kvassert.assert_length(cache, cache.given_length, who=who, where=where)
    return cache


def rows_written(plan: CachePlan, cache: Recorder) -> str:
    """The kind of rows ``plan`` writes into ``cache``: its own, but noise in place of
    extremes where the cache may not be given them (``kvcheck.tensors.extremes_allowed``)."""
    if plan.rows == "extremes" and not extremes_allowed(kvassert.coarsest([cache]), cache.sinks):
        return "random"
    return plan.rows


def give(cache: Recorder, key: Tensor, value: Tensor, seed: int) -> None:
    """``key`` and ``value`` to a recorded cache on its path: appended, or attended by a
    query from ``seed`` of the fewest query heads per kv head the cache supports (one)."""
    if cache.path == "append":
        cache.append(key, value)
        return
    cache.attend(random_query(key, seed), key, value)


def random_query(key: Tensor, seed: int) -> Tensor:
    """A query for ``key``'s rows: normal noise from ``seed``, of the fewest query heads per
    kv head the cache's domain supports (one where it says nothing)."""
    batch, kv_heads, rows, head_dim = key.shape
    shape = (batch, kv_heads * kvsizes.domain().fewest_group, rows, head_dim)
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(shape, generator=generator, dtype=torch.float64)
    return query.to(device=key.device, dtype=key.dtype)


def assert_served(cache: Recorder, *, who: str, where: str) -> None:
    """What the last call returned is right for the rows given since the reset: on the
    append path exactly those rows; on the attend path the reference attention over them
    (at the dtype's tolerance: the cache-level attend path draws float64 and float32)."""
    __tracebackhide__ = True
    from kvcheck.failures import DataLoss

    if cache.path == "append":
        kvassert.assert_returned_rows(cache, who=who, where=where)
        return
    got, want = cache.attended_and_reference()
    if not isinstance(got, Tensor):
        raise DataLoss(f"{who}: attend returned a {type(got).__name__}, not a tensor\n  at {where}")
    kvassert.assert_close_at(
        got,
        want,
        what=f"{who}'s attend and the reference attention over the rows it was given",
        where=where,
        position_axis=2,
        first_position=cache.given_length - cache.new_tokens,
        failure=DataLoss,
        lossy=kvassert.coarsest([cache]),  # rows in codes: their budget (contract, 10.1)
    )


def spec_on_path(spec: CacheSpec, path: str) -> CacheSpec:
    """The spec a cache-level plan runs at on ``path``: the attend path is judged at the
    dtype's tolerance, so a half-precision spec runs in float32 there (half precision is held
    to its budget through the model, by ``logits`` and ``reset``); and it takes values as
    wide as the keys (``attend`` returns one row shaped like the query; a latent layer's own
    attention, ``attend_latent``, is the property ``latent attend``'s, contract 10.2)."""

    if path != "attend":
        return spec
    if spec.value_dim is not None:
        spec = dataclasses.replace(spec, value_dim=None)
    if needs_reference(spec.dtype):
        exact = supported_dtypes(DTYPES[::-1], DTYPES)  # float32 first, within the domain
        return dataclasses.replace(spec, dtype=exact[0])
    return spec


def assert_views_kept(caches: dict[str, Recorder], *, where: str) -> None:
    """The views each cache's last append returned still hold what they held then: a view
    lives until that cache's own next call, whatever other caches were called since."""
    __tracebackhide__ = True
    from kvcheck.failures import DataLoss

    for who, cache in caches.items():
        if changed := cache.views_changed():
            raise DataLoss(
                f"{who}: the rows its last append (or append_rows) returned changed at rows "
                f"{changed[:8]} "
                f"before its own next call (other caches of the factory were called since): "
                f"a returned view must stay valid until that cache's next call\n  at {where}"
            )
