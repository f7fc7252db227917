"""Plans as scripts: a list of events on one request and its forks, drawn (``events``) and
played through the session engine (``play``). The properties of distributed inference
(``sharded``, ``move``) share them. The events are the plans' own (``kvcheck.plan_events``):

- ``Feed(request, size)``: that many new tokens, in one call;
- ``Truncate(request, back)``: forget the last ``back`` positions (where offered);
- ``Reorder(request, indices)``: batch rows gathered by ``indices``, repeats too (where
  offered);
- ``Fork(parent, child)``: a new request with the parent's history (the next number);
- ``Reset(request)``: empty it, its caches kept;
- ``Move(request, layout)``: its caches moved to the plan's layout ``layout`` (section 11.2).

Request ``r0`` is the first started, each fork the next. An event the caches do not offer is
skipped, so one script runs on every cache.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from hypothesis import strategies as st

from kvcheck import devices as kvdevices
from kvcheck import strategies as kvst
from kvcheck.plan_events import (
    Feed,
    Fork,
    Move,
    Reorder,
    Reset,
    Truncate,
    reorder_indices,
    truncate_backs,
)
from kvcheck.session import Engine, Request

Event = Feed | Truncate | Reorder | Fork | Reset | Move
# The name of each event's kind: what a property draws by, and the capability it needs.
KINDS = {
    Feed: "feed",
    Truncate: "truncate",
    Reorder: "reorder",
    Fork: "fork",
    Reset: "reset",
    Move: "move",
}


def kind_of(event: Event) -> str:
    """The kind of ``event``: "feed", "truncate", "reorder", "fork", "reset" or "move"."""
    return KINDS[type(event)]


def fed(script: tuple[Event, ...]) -> int:
    """The tokens a script feeds, over all its requests."""
    return sum(event.size for event in script if isinstance(event, Feed))


@st.composite
def events(
    draw, kinds: tuple[str, ...], most_tokens: int, batch: int, moves: int = 0
) -> tuple[Event, ...]:
    """A script of up to 7 events of ``kinds`` (beside feeds) on a request of ``batch``
    rows, holding at most ``most_tokens`` tokens per request, a decode after the first feed
    at least, and then exactly ``moves`` moves of r0 (the only request of a plan that
    moves), each after the first feed, to layouts 1, 2, ... in turn."""
    script: list[Event] = []
    held = [0]
    for _ in range(draw(st.integers(1, 7), label="events")):
        request = draw(st.integers(0, len(held) - 1), label="on request")
        kind = draw(st.sampled_from(kinds), label="event") if held[request] else "feed"
        if kind == "feed":
            room = most_tokens - held[request]
            if room < 1:
                continue
            tokens = draw(st.integers(1, min(room, 2 * kvst.EDGE + 1)), label="tokens")
            script.append(Feed(request, tokens))
            held[request] += tokens
        elif kind == "truncate":
            back = draw(truncate_backs(held[request]), label="truncate by")
            script.append(Truncate(request, back))
            held[request] -= back
        elif kind == "reorder":
            script.append(Reorder(request, draw(reorder_indices(batch), label="indices")))
        elif kind == "fork":
            script.append(Fork(request, len(held)))
            held.append(held[request])
        elif kind == "reset":
            script.append(Reset(request))
            held[request] = 0
    if not any(isinstance(event, Feed) for event in script[1:]):
        script.append(Feed(0, 1))
    at = sorted(draw(st.integers(1, len(script)), label="move at") for _ in range(moves))
    for layout, index in reversed(list(enumerate(at, start=1))):
        script.insert(index, Move(0, layout))
    return tuple(script)


def play(
    engine: Engine,
    script: tuple[Event, ...],
    batch: int,
    token_seed: int,
    *,
    move: Callable[[Request, int, str], None] | None = None,
    progress: Callable[[str], None] | None = None,
) -> None:
    """Every event of ``script`` through ``engine`` on a request of ``batch`` rows, tokens
    from ``token_seed``; ``move(request, layout, at)`` moves a request; ``progress(said)``
    hears of each event before it runs. The engine checks what holds after each."""
    vocab = engine.model.config.vocab_size
    generator = torch.Generator().manual_seed(token_seed)
    requests = [engine.start("r0", batch)]
    for step, event in enumerate(script):
        on = event.parent if isinstance(event, Fork) else event.request
        request, what = requests[on], f"event #{step}: {event.describe()}"
        if progress is not None:
            progress(what)
        at = f" ({what})"
        if isinstance(event, Fork) and event.child != len(requests):
            raise ValueError(f"{event.describe()}: a script's forks are r1, r2, ... in turn")
        if isinstance(event, Move):
            if move is None or "move" not in request.offered:
                continue
            move(request, event.layout, at)
        elif isinstance(event, Feed):
            if request.held + event.size > engine.max_length:
                continue  # past max_length after a truncate a window refused
            new = torch.randint(0, vocab, (batch, event.size), generator=generator)
            engine.play(request, event, new=new.to(kvdevices.current()), at=at)
        elif engine.offers(request, event):
            engine.play(request, event, at=at)  # done, or refused as a window may
        else:
            continue  # not offered
        if isinstance(event, Fork):
            requests.append(engine.live[f"r{event.child}"])
        engine.check(what)
    engine.finish(blocks_back=False)
