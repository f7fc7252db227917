"""Feed by row (contract, section 8.1): row b of a batch with rows of their own gets its own
new tokens (none allowed), through ``append_rows``, laid out as the caches' ``padding`` says.

Each row is its own request: its new logits must equal the uncached model's on that row's
history alone, at batch 1, from that row's first position, whatever its neighbours hold. A
pad slot's keys and values are poison (``kvcheck.tensors.POISON_VALUES``), so a cache that
attends to one shows it. Before the logits, what ``append_rows`` marked valid for each row is
held to the rows given and to the uncached pass's keys and values at that row's positions: a
first position lost shows in the keys, not in the logits (RoPE is relative). After shifts
per row each row's oracle is the model over the rows its shifts left
(``kvcheck.session.shifted``), moved keys allowed their re-rotation's rounding. A refusal of
rows that each fit in ``max_length`` is a crash on valid input: capacity is per row.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import Tensor

from kvcheck import asserts as kvassert
from kvcheck import failures
from kvcheck import tensors as kvtensors
from kvcheck.session.checks import check_row_lengths
from kvcheck.session.compare import assert_logits, row_said
from kvcheck.session.events.base import Event, Session
from kvcheck.session.request import Request
from kvcheck.session.shifted import after_row_shift
from kvref.protocol import kept_rows, keys_stored, rows_needed
from kvref.rows import row_slots, rows_laid_out


@dataclass
class FeedRows(Event):
    """Row b of ``request`` is fed ``new[b]``, the pad slots full of ``pad``."""

    request: Request
    new: list[Tensor]
    pad: str = "nan"
    at: str = ""

    def before(self, engine: Session) -> None:
        request = self.request
        rows = request.own_rows()
        self.padding = getattr(request.caches[0], "padding", "right")
        self.laid, self.counts = rows_laid_out(self.new, self.padding, engine.model.device)
        self.lengths = [len(row) for row in rows]
        self.where = engine.where(
            f"{request.name}, its step #{request.steps}: rows bring {self.counts} new tokens "
            f"(held {self.lengths}, {self.padding} padding of {self.pad}){self.at}"
        )

    def apply(self, engine: Session) -> None:
        request, model = self.request, engine.model
        poison = kvtensors.poison_value(self.pad, model.dtype)
        try:
            self.logits = model.forward_rows(self.laid, self.counts, request.caches, pad=poison)
        except Exception as error:
            fits = all(
                n + c <= engine.max_length for n, c in zip(self.lengths, self.counts, strict=True)
            )
            if type(error) is ValueError and fits:  # capacity is per row (section 8.1)
                raise failures.RefusesValidInput(
                    f"{request.name}: append_rows refused rows that each fit in max_length "
                    f"{engine.max_length}, with ValueError: {error}\n  at {self.where}"
                ) from error
            error.add_note(f"  at {self.where}")
            raise

    def update(self, engine: Session) -> None:
        request = self.request
        fed = zip(request.rows, self.new, strict=True)
        request.rows = [torch.cat((row, tokens)) for row, tokens in fed]
        request.steps += 1
        # After shifts per row each row's oracle takes its new tokens; a row given none
        # stays as it is.
        self.shifted_answers = None
        if request.row_shifted is not None:
            self.shifted_answers = [
                after_row_shift(engine, request, b, tokens) if tokens.shape[0] else None
                for b, tokens in enumerate(self.new)
            ]

    def verify(self, engine: Session) -> None:
        for b, count in enumerate(self.counts):
            if self.shifted_answers is not None:  # each row against its own shifted rows
                self.check_shifted_row_held(b)
                if self.shifted_answers[b] is not None:
                    self.compare_shifted_row(b, self.new_logits(b))
            else:
                self.check_row(engine, b, count)
        check_row_lengths(engine, self.request, f"rows fed {self.counts}{self.at}")

    # --- a row of its own ------------------------------------------------------------------
    def new_logits(self, row: int) -> Tensor:
        """``row``'s logits at its new tokens' slots (batch 1)."""
        slots = row_slots(self.padding, self.laid.shape[1], self.counts[row])
        return self.logits[row : row + 1, slots]

    def check_row(self, engine: Session, row: int, count: int) -> None:
        """``row``'s held rows, then its new logits, against the uncached pass over its
        history alone at batch 1 (the oracle: nothing to keep between steps)."""
        request = self.request
        history = request.rows[row][None]
        if not history.shape[1]:  # an empty row: nothing to hold yet
            return
        first = request.row_firsts()[row]
        kept = {"start_position": first, "keys": keys_stored(request.caches[0])}
        uncached = engine.model.forward_with_kv(history, **kept)
        truth = functools.cache(
            functools.partial(engine.truth.forward_with_kv, history, **kept)
        )  # the float64 pass, where half precision is judged against it
        # The rows held first: a wrong row fails naming its layer, before the logits do.
        self.check_row_held(engine, row, uncached[1], truth, first)
        if count:
            expected = uncached[0][:, -count:]
            self.compare_row(self.new_logits(row), expected, truth, first, row)

    def check_row_held(self, engine: Session, row, uncached, truth, first) -> None:
        """What ``append_rows`` marked valid for ``row`` in every layer: bit for bit the most
        recent rows it was given, and the uncached pass's keys and values at that row's own
        positions (a first position lost shows in the keys, not in the logits: RoPE is
        relative)."""
        request, lengths, where = self.request, self.lengths, self.where
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
                    if kvassert.needs_reference(engine.model.dtype):
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

    def compare_row(self, logits, expected, truth, first, row) -> None:
        request, lengths = self.request, self.lengths
        new = logits.shape[1]
        start = first + lengths[row]  # the absolute position of the row's first new token
        where = (
            f"{row_said(row, first, lengths)}, its new positions {start}..{start + new - 1}, "
            f"against that row alone at batch 1\n  at {self.where}"
        )
        reference = lambda: truth()[0][:, -new:]  # noqa: E731
        assert_logits(
            logits, expected, reference, where=where, start=start, path=request.path,
            lossy=kvassert.coarsest(request.caches),
        )  # fmt: skip

    # --- a row after shifts per row ------------------------------------------------------
    def compare_shifted_row(self, row: int, logits: Tensor) -> None:
        """``row``'s new logits against the model's over its shifted rows at batch 1."""
        request, lengths = self.request, self.lengths
        expected, truth = self.shifted_answers[row]
        first, count = request.row_firsts()[row], len(self.new[row])
        start = first + lengths[row]
        assert_logits(
            logits, expected, lambda: truth, start=start, path=request.path,
            where=f"{row_said(row, first, lengths)}, its new positions {start}.."
            f"{start + count - 1}, after shifts per row\n  at {self.where}",
            what="cached logits and the model's over the rows the row's shifts left",
            lossy=kvassert.coarsest(request.caches), budgets=kvassert.SHIFTED_BUDGETS,
        )  # fmt: skip

    def check_shifted_row_held(self, row: int) -> None:
        """What ``append_rows`` marked valid for ``row`` after shifts per row: the rows given
        as the shifts left them, values and unmoved keys bit for bit, moved keys within
        their re-rotation's rounding (``kvcheck.asserts.shift_rounding``)."""
        request, lengths, where = self.request, self.lengths, self.where
        first = request.row_firsts()[row]
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
