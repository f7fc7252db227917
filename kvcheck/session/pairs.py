"""The pair of events (``kvcheck.interplay``) each event the session engine runs completes
on its request, noted for the verdict (``kvcheck.reach``), whatever property's plan it is
of: the engine calls ``noted`` after every event."""

from __future__ import annotations

from kvcheck import reach
from kvcheck import sizes as kvsizes
from kvcheck.interplay import PREFIX, TREE, page_of, pair_name, state_of
from kvcheck.session.events import (
    feed,
    fork,
    move,
    offload,
    reorder,
    reset,
    shift,
    tree,
    truncate,
)


def noted(event, engine, result) -> None:
    """After the engine ran ``event`` (with ``result``): the pair it completes on its
    request, noted (``kvcheck.reach``); an event of no kind here ends the request's run of
    pairs, so that none is named across it."""
    request, kind = getattr(event, "request", None), None
    if isinstance(event, feed.Feed):
        count = event.end - event.start
        kind = "prefill" if event.start == 0 else "decode" if count == 1 else "chunk"
    elif isinstance(event, truncate.Truncate) and result is not False:  # False: refused
        kind = "truncate"
    elif isinstance(event, shift.Shift) and result is not False:
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
        _note(request, kind, engine)


def _note(request, kind: str | None, engine) -> None:
    if kind is None or request.rows is not None:  # rows of their own: another vocabulary
        request.last_event = None
        return
    page = page_of(kvsizes.current().page)
    state = state_of(request.held, engine.max_length, page)
    if (last := getattr(request, "last_event", None)) is not None:
        reach.note(PREFIX + pair_name(last[0], last[1], kind))
    request.last_event = (kind, state)
