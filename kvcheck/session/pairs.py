"""The pair of events (``kvcheck.interplay``) each event the session engine runs completes
on its request, noted for the verdict (``kvcheck.reach``), whatever property's plan it is
of: the engine calls ``noted`` after every event. A batch whose rows are requests of their
own (contract, section 8) makes pairs of its own events, in the states of its rows'
lengths."""

from __future__ import annotations

from kvcheck import reach
from kvcheck import sizes as kvsizes
from kvcheck.interplay import BY_NAME, PREFIX, TREE, page_of, pair_name, rows_state, state_of
from kvcheck.session.events import (
    feed,
    feed_rows,
    fork,
    move,
    offload,
    reorder,
    reset,
    rows,
    shift,
    tree,
    truncate,
)

# The events on rows of their own (contract, section 8), by the kind of pair they make.
ROW_EVENTS = {
    feed_rows.FeedRows: "feed rows",
    rows.TruncateRows: "truncate rows",
    rows.SelectRows: "select rows",
    rows.Join: "join",
    shift.ShiftRows: "shift rows",
}


def noted(event, engine, result) -> None:
    """After the engine ran ``event`` (with ``result``): the pair it completes on its
    request, noted (``kvcheck.reach``); an event of no kind here ends the request's run of
    pairs, so that none is named across it, as does a refusal (a truncate or a shift that a
    window refused as it may returns False: nothing changed)."""
    request, kind = getattr(event, "request", None), ROW_EVENTS.get(type(event))
    if isinstance(event, rows.ResetAt) and event.by_row:
        kind = "reset rows"
    elif isinstance(event, feed.Feed):
        count = event.end - event.start
        kind = "prefill" if event.start == 0 else "decode" if count == 1 else "chunk"
    elif isinstance(event, truncate.Truncate):
        kind = "truncate"
    elif isinstance(event, shift.Shift):
        kind = "shift"
    elif isinstance(event, tree.DraftTree):
        return  # its pair is the commit's
    elif isinstance(event, tree.CommitTree):
        kind = TREE
    elif isinstance(event, reorder.Reorder):
        kind = "reorder"
    elif isinstance(event, reset.Reset):
        kind = "reset"
    elif isinstance(event, fork.Fork):
        request, kind = event.parent, "fork"
        if result is not None:  # the fork's own next event meets the fork too
            _note(result, kind, engine)
    elif isinstance(event, offload.Offload):
        return  # its pair is the restore's
    elif isinstance(event, offload.Restore):
        kind = "offload and restore"
    elif isinstance(event, move.Move):
        kind = "move"
    if request is not None:
        _note(request, None if result is False else kind, engine)


def _note(request, kind: str | None, engine) -> None:
    """``kind`` ran on ``request``: the pair it completes with the one before, if both are
    of one vocabulary (the batch's, or rows of their own's; a batch event on rows of their
    own ends the run)."""
    by_row = request.rows is not None
    if kind is None or by_row != BY_NAME[kind].rows:
        request.last_event = None
        return
    if by_row:
        state = rows_state(tuple(request.row_lengths()), engine.max_length)
    else:
        state = state_of(request.held, engine.max_length, page_of(kvsizes.current().page))
    last = getattr(request, "last_event", None)
    if last is not None and BY_NAME[last[0]].rows == by_row:
        reach.note(PREFIX + pair_name(last[0], last[1], kind))
    request.last_event = (kind, state)
