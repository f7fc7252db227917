"""The session engine: every property that runs the model drives its caches through it.

An ``Engine`` holds one reference model, the factory under test and the requests alive on
it. A ``Request`` is one history (token ids, one row per batch row) and one recorded cache
per layer. Events are the calls an engine makes: ``start`` (fresh caches, or the reset ones
of a finished request), ``feed``, ``truncate``, ``reorder``, ``fork``, ``reset``, ``drop``
and ``poison``; on a serving pool (contract, section 9) ``lookup`` (a prefix hit, held to
the rows written there: ``kvcheck.prefix_books``), ``declare``, ``offload`` and ``restore``.
After each, the engine checks what the contract says holds whatever the plan: every layer's
length is the history's, and

- ``feed`` compares each new position's logits with the uncached model over the request's
  whole history (the oracle), and on the append path what ``append`` returned with the rows
  given; on failure it names the first layer whose cache went wrong (``first_wrong_layer``);
- a truncate a window layer refuses is allowed only where the contract allows it
  (``kvref.may_refuse_truncate``); then the history stays;
- the rows every live cache last returned are read again after the others were called,
  since a returned view lives until that cache's own next call (``check_views``);
- where the factory is a ``kvref.BlockPool``, its books are audited (``kvcheck.pool_books``).

A property builds its plan out of these events; nothing else calls a cache in a session.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from torch import Tensor

from kvcheck import asserts as kvassert
from kvcheck import devices as kvdevices
from kvcheck import failures, pool_books
from kvcheck import strategies as kvst
from kvcheck.harness import Recorder, assert_views_kept, builder, record
from kvcheck.prefix_books import PrefixBooks
from kvref import (
    BlockPool,
    CacheContractError,
    CacheFactory,
    CacheRows,
    PrefixCaching,
    ReferenceTransformer,
    capabilities,
    may_refuse_shift,
    may_refuse_truncate,
)
from kvref.protocol import is_count, kept_rows, keys_stored, rows_needed
from kvref.quantized import Quantized
from kvref.rows import row_slots, rows_laid_out
from kvref.shift_oracle import HeldRows, shifted_rows


@dataclass
class Request:
    """One history on one set of caches (one recorder per layer)."""

    name: str
    caches: list[Recorder] | None
    history: Tensor  # (batch, tokens fed since the caches' reset)
    steps: int = 0
    offered: frozenset[str] = field(default_factory=frozenset)  # its caches' capabilities
    # Rows of their own (contract, section 8.1): each row's history, once fed by row, and
    # the position of each row's first token (section 8.3), as the plan set them.
    rows: list[Tensor] | None = None
    firsts: list[int] | None = None
    # After a context shift (section 8.4): what each layer should hold, (keys, values), in the
    # model's dtype and in float64 (the truth half precision is judged by); no uncached pass
    # over the tokens left computes it, so every later step runs the model over these rows.
    shifted: tuple[list[tuple[Tensor, Tensor]], list[tuple[Tensor, Tensor]]] | None = None
    # After a shift per row (section 8.4): for each row, alone at batch 1, what each layer
    # should hold, in the model's dtype and in float64, as ``shifted`` is for the batch.
    row_shifted: list[tuple[list[tuple[Tensor, Tensor]], list[tuple[Tensor, Tensor]]]] | None = None
    salt: object = None  # its tenant, for a prefix-caching pool (section 9.1)
    looked_up: int = 0  # the tokens its last prefix lookup declared

    @property
    def held(self) -> int:
        """The tokens its caches hold: the longest row's, where rows have their own."""
        if self.rows is not None:
            return max((len(row) for row in self.rows), default=0)
        return self.history.shape[1]

    @property
    def path(self) -> str:
        return self.caches[0].path if self.caches else "append"

    @property
    def batch(self) -> int:
        return self.history.shape[0] if self.rows is None else len(self.rows)


class Engine:
    """One model and the requests alive on caches from one factory."""

    def __init__(
        self,
        factory: CacheFactory,
        model: ReferenceTransformer,
        *,
        max_length: int,
        path: str = "append",
        blocks: int = 4096,
        block_hash: Callable | None = None,
        describe: Callable[[], str] = lambda: "",
    ) -> None:
        self.model = model
        self.max_length = max_length
        self.path = path
        self.describe = describe  # the plan so far, for every message
        self.live: dict[str, Request] = {}
        self.blocks = blocks
        # False on every rank of a sharded run but one: their logits are the same numbers.
        self.judges_logits = True
        self._use(factory, block_hash)

    def _use(self, factory: CacheFactory, block_hash: Callable | None = None) -> None:
        """Build every later cache from ``factory``: on a pool of its own, so that the books
        can be audited against this engine's caches (keyed by ``block_hash`` where given: a
        prefix-caching pool, section 9.1)."""
        blocks = self.blocks
        self.factory = pool_books.fresh_pool(factory, blocks, block_hash)
        self.pool = self.factory if isinstance(self.factory, BlockPool) else None
        # What each block was last written with, where a pool shares blocks by content.
        prefix = isinstance(self.factory, PrefixCaching)
        self.prefix = PrefixBooks(self.factory.block_size) if prefix else None
        # A fresh pool holds nothing yet; the books compare what this engine's caches hold
        # against what was there before, and its room must be what was asked for.
        self.pool_before = self._pool_counts()
        if self.pool is not None and sum(self.pool_before) != blocks:
            raise failures.DataLoss(
                f"the pool: with_blocks({blocks}) gave a pool with blocks_in_use "
                f"{self.pool_before[0]} + blocks_free {self.pool_before[1]}, not room for "
                f"{blocks} blocks\n  {self.where('before the plan')}"
            )

    # --- the oracle -------------------------------------------------------------------
    @functools.cached_property
    def truth(self) -> ReferenceTransformer:
        """The float64 model: what a half-precision run, or a full-precision run on the
        attend path, is measured against."""
        return kvst.build_model(self.model.config, torch.float64)

    def where(self, text: str) -> str:
        plan = self.describe()
        path = f"the model's {self.path} path through the caches"
        return f"{text}\n  {plan}\n  on {path}" if plan else f"{text}\n  on {path}"

    # --- events ---------------------------------------------------------------------------
    def start(self, name: str, batch: int, reuse: Request | None = None) -> Request:
        """A request on fresh caches from the factory, or on the reset caches of ``reuse``."""
        if reuse is None:
            built = self.model.new_caches(
                builder(self.factory), batch=batch, max_length=self.max_length
            )
            caches = record(built, self.model.config, self.path)
        else:
            caches, reuse.caches = reuse.caches, None
            self.live.pop(reuse.name, None)
        kvassert.fail_if_not_empty(caches, self.where(f"{name} starts"))
        history = torch.empty(batch, 0, dtype=torch.long, device=kvdevices.current())
        offered = frozenset(capabilities(caches[0].cache))
        request = Request(name, caches, history, offered=offered)
        self.live[name] = request
        return request

    def feed(self, request: Request, new: Tensor, *, compare: bool = True, at: str = "") -> Tensor:
        """Feed ``new`` tokens to ``request``. With ``compare``, each new position's logits
        must equal the uncached model's over the request's whole history (``assert_logits``),
        and on the append path every layer must return exactly the rows given; without, the
        caller compares (the core properties hold one uncached pass over a whole session).
        Returns the cached logits."""
        self._not_row_shifted(request, "feed (the batch as one)")
        start, end = request.held, request.held + new.shape[1]
        first = self._first(request)
        kind = "prefill" if start == 0 else "decode"
        where = self.where(
            f"{request.name}, its step #{request.steps}: {kind} of {new.shape[1]} token"
            f"{'s' * (new.shape[1] > 1)} at absolute positions {first + start}..{first + end - 1}"
            f"{at}"
        )
        try:
            logits = self.model(new, caches=request.caches)
        except Exception as error:
            error.add_note(f"  at {where}")
            raise
        request.history = torch.cat((request.history, new), dim=1)
        if self.prefix is not None and request.looked_up:  # its blocks may be published
            self.prefix.wrote(request, start, end)
        if request.rows is not None:  # rows of their own, fed as one batch this time
            fed = zip(request.rows, new, strict=True)
            request.rows = [torch.cat((row, tokens)) for row, tokens in fed]
        request.steps += 1
        if request.shifted is not None:  # the oracle moves on with every step, compared or not
            expected, reference = self._after_shift(request, new)
            if compare:  # the rows first: a key a shift moved wrongly names its layer and row
                self._check_returned(request, end, where)
                assert_logits(
                    logits,
                    expected,
                    reference,
                    where=where,
                    start=first + start,
                    path=request.path,
                    what="cached logits and the model's over the rows the shifts left",
                    lossy=kvassert.coarsest(request.caches),
                    budgets=kvassert.SHIFTED_BUDGETS,
                )
            return logits
        if compare:
            if self.judges_logits:
                self._compare(request, logits, start, where)
            self._check_returned(request, end, where)
        return logits

    def _check_returned(self, request: Request, end: int, where: str) -> None:
        """Every layer holds ``end`` tokens and, on the append path, returned the rows given."""
        for layer, cache in enumerate(request.caches):
            who = f"{request.name}'s layer {layer}"
            kvassert.assert_length(cache, end, who=who, where=where)
            if cache.path == "append":
                kvassert.assert_returned_rows(cache, who=who, where=where)

    # --- rows of their own (contract, section 8.1) ----------------------------------------
    def feed_rows(
        self, request: Request, new: list[Tensor], *, pad: str = "nan", at: str = ""
    ) -> None:
        """Feed row b of ``request`` the tokens ``new[b]`` (none allowed), laid out as its
        caches' ``padding`` says, through ``append_rows``, the pad slots' keys and values
        full of ``pad`` (``kvcheck.strategies.POISON_VALUES``); each row's new logits must
        equal the uncached model's on that row's history alone, at batch 1."""
        rows = self._rows(request)
        padding = getattr(request.caches[0], "padding", "right")
        laid, counts = rows_laid_out(new, padding, self.model.device)
        width = laid.shape[1]
        lengths = [len(row) for row in rows]
        where = self.where(
            f"{request.name}, its step #{request.steps}: rows bring {counts} new tokens "
            f"(held {lengths}, {padding} padding of {pad}){at}"
        )
        poison = kvst.poison_value(pad, self.model.dtype)
        try:
            logits = self.model.forward_rows(laid, counts, request.caches, pad=poison)
        except Exception as error:
            fits = all(n + c <= self.max_length for n, c in zip(lengths, counts, strict=True))
            if type(error) is ValueError and fits:  # capacity is per row (section 8.1)
                raise failures.RefusesValidInput(
                    f"{request.name}: append_rows refused rows that each fit in max_length "
                    f"{self.max_length}, with ValueError: {error}\n  at {where}"
                ) from error
            error.add_note(f"  at {where}")
            raise
        request.rows = [torch.cat((row, tokens)) for row, tokens in zip(rows, new, strict=True)]
        request.steps += 1
        firsts = self._firsts(request)
        if request.row_shifted is not None:  # each row against its own shifted rows
            for b, count in enumerate(counts):
                self._check_shifted_row_held(request, b, lengths, where)
                got = logits[b : b + 1, row_slots(padding, width, count)]
                self._compare_shifted_row(request, b, new[b], got, lengths, where)
            self._check_row_lengths(request, f"rows fed {counts}{at}")
            return
        for b, count in enumerate(counts):
            history = request.rows[b][None]
            if not history.shape[1]:  # an empty row: nothing to hold yet
                continue
            kept = {"start_position": firsts[b], "keys": keys_stored(request.caches[0])}
            uncached = self.model.forward_with_kv(history, **kept)
            truth = functools.cache(
                functools.partial(self.truth.forward_with_kv, history, **kept)
            )  # the float64 pass, where half precision is judged against it
            # The rows held first: a wrong row fails naming its layer, before the logits do.
            self._check_row_held(request, b, uncached[1], truth, firsts[b], lengths, where)
            if count:
                got = logits[b : b + 1, row_slots(padding, width, count)]
                expected = uncached[0][:, -count:]
                self._compare_row(request, got, expected, truth, firsts[b], b, lengths, where)
        self._check_row_lengths(request, f"rows fed {counts}{at}")

    def _check_row_held(self, request, row, uncached, truth, first, lengths, where) -> None:
        """What ``append_rows`` marked valid for ``row`` in every layer: bit for bit the most
        recent rows it was given, and the uncached pass's keys and values at that row's own
        positions (a first position lost shows in the keys, not in the logits: RoPE is
        relative)."""
        for layer, cache in enumerate(request.caches):
            if cache.rows_returned is None:
                continue
            keys, values, valid = cache.rows_returned
            mask = valid[row]
            held = int(mask.sum())
            who = f"{request.name}'s layer {layer}, {row_said(row, first, lengths)}"
            for which, (name, got) in enumerate((("keys", keys), ("values", values))):
                rows = got[row][:, mask][None]  # (1, H_kv, held, D)
                given = cache.rows_given[row][which][None]
                kept = kept_rows(cache.sinks, held, given.shape[2])  # each one's index
                below = cache.rows_below[row][which]  # its own recent run (section 10.1)
                bad, beyond = kvassert.rows_not_held(cache, which, rows, given, kept, below)
                if bad:
                    raise failures.DataLoss(
                        f"{who}: {name} row {kept[bad[0]]} that append_rows marked "
                        f"valid is not the row given there{beyond} ({len(bad)} of {held} "
                        f"differ)\n  at {where}"
                    )
                # The sinks and the recent run, each a run of positions the message can name.
                sinks = min(cache.sinks, held)
                for low, high in ((0, sinks), (sinks, held)):
                    if low == high:
                        continue
                    at = slice(kept[low], kept[low] + high - low)
                    reference = None
                    if kvassert.needs_reference(self.model.dtype):
                        reference = truth()[1][layer][which][:, :, at]
                    kvassert.assert_close_at(
                        rows[:, :, low:high],
                        uncached[layer][which][:, :, at],
                        what=f"{who}: the {name} it holds and the uncached pass's at its positions",
                        where=where,
                        position_axis=2,
                        first_position=first + at.start,
                        failure=failures.DataLoss,
                        reference=reference,
                        lossy=kvassert.coarsest([cache]),
                    )

    def _compare_row(self, request, logits, expected, truth, first, row, lengths, where):
        new = logits.shape[1]
        start = first + lengths[row]  # the absolute position of the row's first new token
        where = (
            f"{row_said(row, first, lengths)}, its new positions {start}..{start + new - 1}, "
            f"against that row alone at batch 1\n  at {where}"
        )
        reference = lambda: truth()[0][:, -new:]  # noqa: E731
        assert_logits(
            logits, expected, reference, where=where, start=start, path=request.path,
            lossy=kvassert.coarsest(request.caches),
        )  # fmt: skip

    def truncate_rows(self, request: Request, keep: list[int], *, at: str = "") -> bool:
        """Row b keeps its first ``keep[b]`` tokens (speculative acceptance per row); the
        widest window first, as ``ReferenceTransformer.truncate`` asks. True when done, False
        when a window layer refused as section 4 allows for some row (nothing changed)."""
        self._not_row_shifted(request, "truncate_rows")
        rows = self._rows(request)
        windows = self._windows()
        what = f"truncate_rows to {keep}{at}"
        for done, layer in enumerate(self.model.widest_window_first()):
            error = kvassert.raised_by(lambda i=layer: request.caches[i].truncate_rows(tuple(keep)))
            if error is None:
                continue
            allowed = isinstance(error, ValueError) and not isinstance(error, CacheContractError)
            if (
                done == 0
                and allowed
                and any(
                    may_refuse_truncate(windows, len(row), n)
                    for row, n in zip(rows, keep, strict=True)
                )
            ):
                self._check_row_lengths(request, f"a refused {what}")
                return False
            raise failures.RefusesValidInput(
                f"{request.name}'s layer {layer}: {what} refused with {type(error).__name__}: "
                f"{error}; no layer may refuse it{' after another took it' if done else ''}: "
                f"every position a row's next query needs is among those a window keeps\n  at "
                f"{self.where(what)}"
            ) from error
        request.rows = [row[:n] for row, n in zip(rows, keep, strict=True)]
        self._check_row_lengths(request, what)
        return True

    def select_rows(self, request: Request, indices: list[int], *, at: str = "") -> None:
        """The batch becomes rows ``indices``: the others finished and leave."""
        self._not_row_shifted(request, "select_rows")
        rows = self._rows(request)
        chosen = torch.tensor(indices, dtype=torch.long, device=self.model.device)
        for cache in request.caches:
            cache.select_rows(chosen)
        firsts = self._firsts(request)
        request.rows, request.firsts = [rows[b] for b in indices], [firsts[b] for b in indices]
        self._check_row_lengths(request, f"select_rows {indices}{at}")

    def join(self, request: Request, other: Request, *, at: str = "") -> None:
        """The rows of ``other`` (its own caches, fed alone) join ``request`` after its last."""
        self._not_row_shifted(request, "join")
        self._not_row_shifted(other, "join")
        rows, theirs = self._rows(request), self._rows(other)
        firsts = [*self._firsts(request), *self._firsts(other)]
        for cache, joining in zip(request.caches, other.caches, strict=True):
            cache.join(joining)
        self.live.pop(other.name, None)
        other.caches = None
        request.rows, request.firsts = [*rows, *theirs], firsts
        self._check_row_lengths(request, f"{other.name} joins{at}")

    def reset_at(self, request: Request, firsts: list[int], *, at: str = "") -> None:
        """Every layer empty, row b's next token at position ``firsts[b]`` (section 8.3): a
        tuple for a cache with rows of their own, else the one int all rows share."""
        rows = "append_rows" in request.offered
        for cache in request.caches:
            cache.reset_at(tuple(firsts) if rows else firsts[0])
        request.history = request.history[:, :0]
        request.firsts, request.steps, request.shifted = list(firsts), 0, None
        request.row_shifted = None
        request.rows = [request.history[0]] * len(firsts) if rows else None
        if rows:
            self._check_row_lengths(request, f"reset_at {firsts}{at}")
        else:
            self._check_lengths(request, f"reset_at {firsts[0]}{at}")
        self._check_firsts(request, f"reset_at {firsts}{at}")

    def _rows(self, request: Request) -> list[Tensor]:
        if request.rows is None:  # fed as one batch so far: every row has that history
            request.rows = list(request.history)
        return request.rows

    def _firsts(self, request: Request) -> list[int]:
        """Each row's first position as the plan set it (never the cache's own claim)."""
        return request.firsts or [0] * len(self._rows(request))

    def _check_row_lengths(self, request: Request, what: str) -> None:
        want = tuple(len(row) for row in request.rows)
        for layer, cache in enumerate(request.caches):
            got = cache.row_lengths
            if tuple(got) != want:
                raise failures.DataLoss(
                    f"{request.name}'s layer {layer}: row_lengths {tuple(got)} after {what}; "
                    f"the rows hold {want}\n  at {self.where(what)}"
                )

    def _compare(self, request: Request, logits: Tensor, start: int, where: str) -> None:
        first = self._first(request)
        expected = self.model(request.history, start_position=first)[:, start:]
        history = request.history
        reference = lambda: self.truth(history, start_position=first)[:, start:]  # noqa: E731
        try:
            assert_logits(
                logits, expected, reference, where=where, start=first + start, path=request.path,
                lossy=kvassert.coarsest(request.caches),
                budgets=kvassert.budgets_for(request.caches),
            )  # fmt: skip
        except failures.WrongResults as error:
            diagnose(error, self.model, request, first)
            raise

    def _first(self, request: Request) -> int:
        """The position of the first token, for a batch fed as one (its rows share it)."""
        firsts = set(self._firsts(request)) if request.firsts else {0}
        if len(firsts) > 1:
            raise TypeError(f"{request.name}'s rows start at {sorted(firsts)}: feed it by row")
        return firsts.pop()

    # --- context shift (contract, section 8.4) --------------------------------------------
    def shift(self, request: Request, start: int, count: int, *, at: str = "") -> bool:
        """Discard the tokens of indices ``start`` to ``start + count - 1`` and move the rest
        down (``ReferenceTransformer.shift``); the oracle's rows do the same in float64. True
        when done, False when a window layer refused as ``kvref.may_refuse_shift`` allows
        (nothing changed)."""
        self._not_row_shifted(request, "a whole-batch shift")
        held, what = request.held, f"shift({start}, {count}){at}"
        error = kvassert.raised_by(lambda: self.model.shift(request.caches, start, count))
        if error is not None:
            may_refuse = may_refuse_shift(self._windows(), held, start, count)
            self._refusal_allowed(request, error, may_refuse, what)
            return False
        stored = keys_stored(request.caches[0])
        if request.shifted is None:  # the uncached pass's rows: what the caches held so far
            first = self._first(request)
            kept = {"start_position": first, "keys": stored}
            _, rows = self.model.forward_with_kv(request.history, **kept)
            _, truth = self.truth.forward_with_kv(request.history, **kept)
            request.shifted = (rows, truth)
        base = self.model.config.rope_base
        request.shifted = tuple(
            [shifted_rows(keys, values, start, count, base, stored) for keys, values in rows]
            for rows in request.shifted
        )
        kept = [*range(start), *range(start + count, held)]
        request.history = request.history[:, kept]
        if request.rows is not None:
            request.rows = [row[kept] for row in request.rows]
        self._check_lengths(request, what)
        self._check_firsts(request, what)
        return True

    def shift_rows(self, request: Request, starts: list[int], counts: list[int], *, at="") -> bool:
        """Row b discards its tokens of indices ``starts[b]`` to ``starts[b] + counts[b] - 1``
        and moves the rest down (a shift per row, ``ReferenceTransformer.shift`` with tuples);
        each row's oracle, alone at batch 1, does the same in float64. True when done, False
        when a window layer refused as ``kvref.may_refuse_shift`` allows for some row."""
        rows, what = self._rows(request), f"shift({tuple(starts)}, {tuple(counts)}){at}"
        if request.shifted is not None:
            raise TypeError(f"a shift per row of {request.name} after a whole-batch shift")
        error = kvassert.raised_by(
            lambda: self.model.shift(request.caches, tuple(starts), tuple(counts))
        )
        if error is not None:
            spans = zip(rows, starts, counts, strict=True)
            may_refuse = any(
                may_refuse_shift(self._windows(), len(row), start, count)
                for row, start, count in spans
                if count
            )
            self._refusal_allowed(request, error, may_refuse, what)
            return False
        if request.row_shifted is None:
            request.row_shifted = [self._row_rows(request, b) for b in range(len(rows))]
        stored, base = keys_stored(request.caches[0]), self.model.config.rope_base
        for b, (start, count) in enumerate(zip(starts, counts, strict=True)):
            if not count:
                continue
            request.row_shifted[b] = tuple(
                [shifted_rows(keys, values, start, count, base, stored) for keys, values in held]
                for held in request.row_shifted[b]
            )
            request.rows[b] = torch.cat((rows[b][:start], rows[b][start + count :]))
        self._check_row_lengths(request, what)
        self._check_firsts(request, what)
        return True

    def _row_rows(self, request: Request, row: int):
        """What every layer holds for ``row`` so far, at batch 1, in the model's dtype and in
        float64: the uncached pass over its history at its positions (none for an empty row)."""
        history = request.rows[row][None]
        kept = {
            "start_position": self._firsts(request)[row],
            "keys": keys_stored(request.caches[0]),
        }
        if history.shape[1]:
            rows = [model.forward_with_kv(history, **kept)[1] for model in self._oracles()]
            return rows[0], rows[-1]
        return tuple(
            [
                tuple(part[None, :, :0].to(dtype) for part in cache.rows_given[row])
                for cache in request.caches
            ]
            for dtype in (self.model.dtype, torch.float64)
        )

    def _oracles(self) -> tuple[ReferenceTransformer, ...]:
        """The models a row's oracle runs: the float64 one beside the model only where it
        judges (half precision, ``kvcheck.asserts.needs_reference``)."""
        if kvassert.needs_reference(self.model.dtype):
            return self.model, self.truth
        return (self.model,)

    def _compare_shifted_row(self, request, row, tokens, logits, lengths, where) -> None:
        """``row``'s new logits against the model's over its shifted rows at batch 1 (both of
        its oracles take the new rows)."""
        first, stored = self._firsts(request)[row], keys_stored(request.caches[0])
        if not tokens.shape[0]:
            return
        answers = []
        for model, rows in zip(self._oracles(), request.row_shifted[row], strict=False):
            held = [HeldRows(keys, values, first, stored) for keys, values in rows]
            answers.append((model(tokens[None], caches=held), [(c.keys, c.values) for c in held]))
        (expected, rows), (truth, truth_rows) = answers[0], answers[-1]
        request.row_shifted[row] = (rows, truth_rows)
        start = first + lengths[row]
        assert_logits(
            logits, expected, lambda: truth, start=start, path=request.path,
            where=f"{row_said(row, first, lengths)}, its new positions {start}.."
            f"{start + len(tokens) - 1}, after shifts per row\n  at {where}",
            what="cached logits and the model's over the rows the row's shifts left",
            lossy=kvassert.coarsest(request.caches), budgets=kvassert.SHIFTED_BUDGETS,
        )  # fmt: skip

    def _check_shifted_row_held(self, request, row, lengths, where) -> None:
        """What ``append_rows`` marked valid for ``row`` after shifts per row: the rows given
        as the shifts left them, values and unmoved keys bit for bit, moved keys within
        their re-rotation's rounding (``kvcheck.asserts.shift_rounding``)."""
        first = self._firsts(request)[row]
        for layer, cache in enumerate(request.caches):
            if cache.rows_returned is None:
                continue
            keys, values, valid = cache.rows_returned
            mask, given_rows = valid[row], cache.rows_given[row]
            held, total = int(mask.sum()), given_rows[0].shape[1]
            who = f"{request.name}'s layer {layer}, {row_said(row, first, lengths)}"
            if not rows_needed(cache.window, total) <= held <= total:
                raise failures.DataLoss(
                    f"{who}: append_rows marked {held} slots valid; the row holds {total} "
                    f"tokens after its shifts\n  at {where}"
                )
            kept = kept_rows(cache.sinks, held, total)
            rows_below = cache.rows_below[row] if cache.rows_below else [0, 0]
            moved = SimpleNamespace(  # the row's own record, as rerotated_within reads one
                rerotated=(cache.rows_rerotated or {row: {}})[row],
                storage=cache.storage,
                carried=getattr(cache, "carried", (None, None)),
                quantized_below=rows_below,
            )
            for which, (name, got) in enumerate((("keys", keys), ("values", values))):
                rows, given = got[row][:, mask][None], given_rows[which][None]
                # Under a declared storage, the rows this row may hold in codes (its own count:
                # a shift of it may have re-coded all it moved, contract 10.1) to their bound.
                below = rows_below[which]
                bad, beyond = kvassert.rows_not_held(cache, which, rows, given, kept, below=below)
                if which == 0:  # a key a shift moved: within its rounding
                    first_bad = bad[:1]
                    bad = [
                        i for i in bad if not kvassert.rerotated_within(moved, rows, given, kept, i)
                    ]
                    beyond = beyond if bad[:1] == first_bad else ""  # it spoke of another row
                if bad:
                    counts = moved.rerotated.get(kept[bad[0]], ()) if which == 0 else ()
                    said = f", moved by shifts of {list(counts)}" if counts else ""
                    raise failures.DataLoss(
                        f"{who}: {name} row {kept[bad[0]]} that append_rows marked valid is not "
                        f"the row given there{said}{beyond} ({len(bad)} of {held} differ: "
                        f"{[kept[i] for i in bad[:8]]})\n  at {where}"
                    )

    def _check_firsts(self, request: Request, what: str) -> None:
        """Where the caches say where their rows start, it is where the plan put them: a
        shift, say, changes no first position (a stale one hides from the logits of a cache
        whose keys the model rotates: RoPE is relative)."""
        want = tuple(self._firsts(request))
        for layer, recorder in enumerate(request.caches):
            said = getattr(recorder.cache, "first_position", None)
            if said is None:
                continue
            got = (said,) * len(want) if isinstance(said, int) else tuple(said)
            if got != want:
                raise failures.DataLoss(
                    f"{request.name}'s layer {layer}: first_position {said!r} after {what}; "
                    f"its rows start at {list(want)}\n  at {self.where(what)}"
                )

    def _after_shift(self, request: Request, new: Tensor) -> tuple[Tensor, Callable[[], Tensor]]:
        """The model's logits for ``new`` over the rows the oracle holds, and the float64
        model's over its own; both oracles take the new rows."""
        first, stored = self._first(request), keys_stored(request.caches[0])
        answers = []
        for model, rows in zip((self.model, self.truth), request.shifted, strict=True):
            held = [HeldRows(keys, values, first, stored) for keys, values in rows]
            answers.append((model(new, caches=held), [(c.keys, c.values) for c in held]))
        (expected, rows), (truth, truth_rows) = answers
        request.shifted = (rows, truth_rows)
        return expected, lambda: truth

    def truncate(self, request: Request, target: int, *, at: str = "") -> bool:
        """Forget every position from ``target`` on; True when done, False when a window
        layer refused as the contract allows (the history then stays). Any other refusal
        is a crash on valid input."""
        self._not_shifted(request, "truncate")
        held = request.held
        error = kvassert.raised_by(lambda: self.model.truncate(request.caches, target))
        if error is None:
            request.history = request.history[:, :target]
            self._check_lengths(request, f"truncate to {target}{at}")
            return True
        may_refuse = may_refuse_truncate(self._windows(), held, target)
        self._refusal_allowed(request, error, may_refuse, f"truncate to {target}{at}")
        return False

    def _windows(self) -> list[int | None]:
        """Each layer's window (None: a global layer)."""
        return [
            self.model.config.layer_window(layer) for layer in range(self.model.config.num_layers)
        ]

    def _refusal_allowed(self, request: Request, error: Exception, may_refuse: bool, what: str):
        """A refusal of ``what`` by the model's caches: allowed where the contract lets a
        window refuse (``may_refuse``) and it is a cache's ``ValueError`` (not the model's
        guard), the history then left as it was; any other is a crash on valid input."""
        allowed = isinstance(error, ValueError) and not isinstance(error, CacheContractError)
        if allowed and may_refuse:
            self._check_lengths(request, f"a refused {what}")
            return
        raise failures.RefusesValidInput(
            f"{request.name}: {what} of {request.held} tokens refused with "
            f"{type(error).__name__}: {error}; no layer may refuse it: every position the next "
            f"query needs is among those a window cache must keep\n  at {self.where(what)}"
        ) from error

    def reorder(self, request: Request, indices: Tensor, *, at: str = "") -> None:
        """Batch row b becomes the old row ``indices[b]`` in every layer."""
        self._not_shifted(request, "reorder")
        indices = indices.to(self.model.device)
        self.model.reorder(request.caches, indices)
        request.history = request.history[indices]
        self._check_lengths(request, f"reorder by {indices.tolist()}{at}")

    def fork(self, parent: Request, name: str, *, at: str = "") -> Request:
        """A new request with the parent's history: every layer's ``fork()``; where the
        caches offer none, fresh caches fed the parent's history as one prompt (an engine
        without prefix sharing)."""
        self._not_shifted(parent, "fork")
        if "fork" not in parent.offered:
            child = self.start(name, parent.batch)
            if parent.held:
                self.feed(child, parent.history, at=f" (a fork of {parent.name}){at}")
            return child
        if name in self.live:  # drop() goes by name: a second one would lose the first
            raise TypeError(f"fork named {name!r}, the name of a live request: no plan does so")
        caches = [cache.fork() for cache in parent.caches]
        child = Request(name, caches, parent.history.clone(), offered=parent.offered)
        child.salt, child.looked_up = parent.salt, parent.looked_up
        self.live[name] = child
        self._check_lengths(child, f"{name} = fork of {parent.name}{at}")
        if self.prefix is not None and child.looked_up:  # blocks a fork copied hold twins
            self.prefix.wrote(child, 0, child.held, count=False)
        return child

    @staticmethod
    def _not_shifted(request: Request, call: str) -> None:
        # The oracle after a shift follows feeds only; a plan that edits a shifted history
        # otherwise would be compared against stale rows.
        if request.shifted is not None or request.row_shifted is not None:
            raise TypeError(f"{call} of {request.name} after a context shift: no plan does so")

    @staticmethod
    def _not_row_shifted(request: Request, call: str) -> None:
        # Each row's oracle after a shift per row follows feeds by row and further shifts per
        # row only (no plan does more).
        if request.row_shifted is not None:
            raise TypeError(f"{call} of {request.name} after a shift per row: no plan does so")

    def poison(self, request: Request, kind: str, rows: int) -> None:
        """Leave ``rows`` rows of nan, inf, -inf or huge values behind in every layer (what
        the next reset must shed); the history is over."""
        spec = self.model.cache_spec(request.batch, self.max_length)
        bad = kvst.poison_rows(spec, rows, kind)
        for cache in request.caches:
            cache.append(bad, kvst.as_values(spec, bad))

    def reset(self, request: Request) -> None:
        """Empty every layer of ``request``, kept for a later ``start(reuse=...)``."""
        for cache in request.caches:
            cache.reset()
        request.history = request.history[:, :0]
        request.steps, request.shifted, request.looked_up = 0, None, 0

    def drop(self, request: Request) -> None:
        """The request ends and its caches go: the last reference, then a collection, so
        that a pool gets their blocks back."""
        self.live.pop(request.name, None)
        request.caches = None
        if self.pool is not None:
            gc.collect()

    # --- serving pools (contract, section 9) ---------------------------------------------
    def lookup(self, request: Request, tokens: Tensor, *, at: str = "") -> int:
        """Declare ``tokens`` to ``request``'s empty caches and take the longest prefix the
        pool has of them: its blocks must hold what was written there, for this request's
        salt and tokens, and at least the blocks of it a live request holds (section 9.1)."""
        where = self.where(
            f"{request.name} looks up its first {tokens.shape[1]} tokens (salt "
            f"{request.salt!r}){at}"
        )
        least, holder = self.prefix.least_hit(self, request, tokens)
        raw = [recorder.cache for recorder in request.caches]
        hit = self.pool.lookup_prefix(raw, tokens, salt=request.salt)
        size = self.pool.block_size
        if not is_count(hit) or hit > tokens.shape[1] or hit % size:
            raise failures.DataLoss(
                f"lookup_prefix returned {hit!r}: a number of tokens from 0 to "
                f"{tokens.shape[1]}, in whole blocks of {size}, was due\n  {where}"
            )
        for layer, cache in enumerate(request.caches):
            who = f"{request.name}'s layer {layer}"
            kvassert.assert_length(cache, hit, who=who, where=where)
        self.prefix.check_hit(request, tokens, hit, where)
        if hit < least:
            raise failures.DataLoss(
                f"lookup_prefix found {hit} tokens, but {holder} holds the first {least} "
                f"(salt {request.salt!r}) in full blocks written once each, which the pool "
                f"must have published and cannot have evicted: the index lost them (or keys "
                f"them by something that changes)\n  {where}"
            )
        request.history = tokens[:, :hit].clone()
        request.looked_up = tokens.shape[1]
        return hit

    def declare(self, request: Request, tokens: Tensor) -> None:
        """The tokens ``request`` is to be fed next, declared to every layer before."""
        for recorder in request.caches:
            recorder.views = recorder.rows_returned = None  # a call: its views may go
            recorder.cache.declare_tokens(tokens)

    def offload(self, request: Request, *, at: str = "") -> None:
        """Move ``request``'s rows out of the pool (preemption by swapping, section 9.3)."""
        for layer, recorder in enumerate(request.caches):
            recorder.views = recorder.rows_returned = None
            recorder.cache.offload()
            if not recorder.cache.offloaded:
                raise failures.DataLoss(
                    f"{request.name}'s layer {layer}: offloaded is False after offload()\n"
                    f"  {self.where(f'{request.name} is swapped out{at}')}"
                )

    def restore(self, request: Request, *, at: str = "") -> None:
        """Bring ``request``'s rows back; its next feed reads them back bit for bit."""
        for recorder in request.caches:
            recorder.cache.restore()
        self._check_lengths(request, f"its restore{at}")
        if self.prefix is not None and request.looked_up:  # in other blocks now: not new writes
            self.prefix.wrote(request, 0, request.held, count=False)

    # --- moves between layouts (contract, section 11.2) ----------------------------------
    def move(
        self,
        request: Request,
        factory: CacheFactory,
        *,
        path: str,
        carry: Callable[[CacheRows], CacheRows] = lambda rows: rows,
        at: str = "",
    ) -> None:
        """Every layer's rows out of ``request``'s caches (``export_rows``, held to the rows
        given) and into fresh caches from ``factory`` taking ``path`` (``import_rows``), where
        the request goes on; every later cache comes from ``factory`` too. The request must
        be the only one alive: the blocks of a pool it leaves must all come back. ``carry``
        takes each layer's rows on their way (through another device, say)."""
        if set(self.live) != {request.name}:
            raise TypeError(f"a move of {request.name} beside other requests: no plan does so")
        what = f"{request.name}, its move{at}"
        exported = self._exported(request, self.where(what))
        left, before = self.pool, self.pool_before
        self.path = path
        self._use(factory)
        built = self.model.new_caches(
            builder(self.factory), batch=request.batch, max_length=self.max_length
        )
        caches = record(built, self.model.config, path)
        for recorder, rows, old in zip(caches, exported, request.caches, strict=True):
            recorder.cache.import_rows(carry(rows))
            recorder.take_history(old)
            if callable(getattr(recorder.cache, "take_history", None)):  # the kit's shards
                recorder.cache.take_history(old.cache)
        request.caches = caches
        request.offered = frozenset(capabilities(caches[0].cache))
        self._check_lengths(request, f"its move{at}")
        if left is not None and left is not self.pool:  # the caches it left: collected
            del old, recorder, built
            gc.collect()
            pool_books.all_back(left, before, where=self.where(what))

    @staticmethod
    def _exported(request: Request, where: str) -> list:
        """Every layer's ``export_rows()``, each held to the rows that layer was given."""
        exported = []
        for layer, recorder in enumerate(request.caches):
            recorder.views = recorder.returned = None  # a call: its views may go
            rows = recorder.cache.export_rows()
            kvassert.assert_exported(recorder, rows, who=f"layer {layer}", where=where)
            exported.append(rows)
        return exported

    # --- what holds after every event -----------------------------------------------------
    def _check_lengths(self, request: Request, what: str) -> None:
        where = self.where(f"{request.name}, after {what}")
        for layer, cache in enumerate(request.caches):
            who = f"{request.name}'s layer {layer}"
            try:
                kvassert.assert_length(cache, request.held, who=who, where=where)
            except failures.PropertyFailure as error:  # raised reading it (the kit's shards)
                if where not in str(error):
                    error.add_note(f"  at {where}")
                raise

    def check(self, event: str) -> None:
        """After an event: every layer of every live request holds its history, the views
        every live cache returned still hold their rows, and the pool's books are right."""
        for request in self.live.values():
            if request.caches is not None:
                self._check_lengths(request, event)
        where = self.where(f"after {event}")
        assert_views_kept(
            {
                f"{request.name}'s layer {layer}": cache
                for request in self.live.values()
                for layer, cache in enumerate(request.caches or ())
            },
            where=where,
        )
        if self.pool is not None:
            pool_books.audit(self.pool, self, where=where)

    def _pool_counts(self) -> tuple[int, int] | None:
        return None if self.pool is None else (self.pool.blocks_in_use, self.pool.blocks_free)

    def finish(self, *, blocks_back: bool = True) -> None:
        """Every request dropped: a pool must then have every block back (``blocks_back``;
        off where the caller may still hold a recorder, as a check looping over steps)."""
        for request in list(self.live.values()):
            self.drop(request)
        if self.pool is not None and blocks_back:
            gc.collect()
            pool_books.all_back(self.pool, self.pool_before, where=self.where("at the end"))


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
) -> None:
    """Cached ``logits`` against the uncached model's ``expected``: at the dtype's tolerance
    (in half precision, its error budget against the float64 model's logits, ``reference()``);
    on the attend path, a gap past the tolerance is allowed where the uncached run is itself
    as far from the float64 model (``ATTEND_PATH_FACTOR``); with ``lossy`` storage declared,
    its budget on top (``kvcheck.asserts.LOSSY_FACTOR``)."""
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


@contextmanager
def young_objects_only() -> Iterator[None]:
    """Collections inside look only at objects made inside: a full collection of a test
    process's heap takes some 200 ms, and a plan drops caches many times."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


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


def _loose(tensor: Tensor) -> dict[str, float]:
    # A diagnosis, not a verdict: half precision at a few roundings.
    return kvassert.TOLERANCES.get(tensor.dtype, {"rtol": 2e-2, "atol": 2e-2})
