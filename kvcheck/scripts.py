"""Plans as scripts: a list of events on one request and its forks, drawn (``events``) and
played through the session engine (``play``). The properties of distributed inference
(``sharded``, ``move``) share them; each event is a tuple:

- ("feed", request, tokens): that many new tokens, in one call;
- ("truncate", request, back): forget the last ``back`` positions (where offered);
- ("reorder", request, seed): batch rows permuted with repeats (where offered);
- ("fork", request): a new request with its history (the next index);
- ("reset", request): empty it, its caches kept;
- ("move", request, layout): its caches moved to the plan's next layout (section 11.2).

Request 0 is the first started, each fork the next. An event the caches do not offer is
skipped, so one script runs on every cache.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from hypothesis import strategies as st

from kvcheck import devices as kvdevices
from kvcheck import strategies as kvst
from kvcheck.session import Engine, Request


def said(event: tuple) -> str:
    """One event, for a message."""
    kind, request, *rest = event
    on = "request A" if request == 0 else f"fork {request}"
    if kind == "feed":
        return f"feed {rest[0]} to {on}"
    if kind == "truncate":
        return f"truncate {on} by {rest[0]}"
    if kind == "move":
        return f"move {on} to layout {rest[0]}"
    return f"{kind} {on}"


@st.composite
def events(draw, kinds: tuple[str, ...], most_tokens: int, moves: int = 0) -> tuple[tuple, ...]:
    """A script of up to 7 events of ``kinds`` (beside feeds), holding at most
    ``most_tokens`` tokens per request, a decode after the first feed at least, and then
    exactly ``moves`` moves of request A (the only request of a plan that moves), each
    after the first feed, to layouts 1, 2, ... in turn."""
    script, held = [], [0]
    for _ in range(draw(st.integers(1, 7), label="events")):
        request = draw(st.integers(0, len(held) - 1), label="on request")
        kind = draw(st.sampled_from(kinds), label="event") if held[request] else "feed"
        if kind == "feed":
            room = most_tokens - held[request]
            if room < 1:
                continue
            tokens = draw(st.integers(1, min(room, 2 * kvst.EDGE + 1)), label="tokens")
            script.append(("feed", request, tokens))
            held[request] += tokens
        elif kind == "truncate":
            back = draw(st.integers(1, held[request]), label="truncate by")
            script.append(("truncate", request, back))
            held[request] -= back
        elif kind == "reorder":
            script.append(("reorder", request, draw(st.integers(0, 2**16), label="seed")))
        elif kind == "fork":
            script.append(("fork", request))
            held.append(held[request])
        elif kind == "reset":
            script.append(("reset", request))
            held[request] = 0
    if not any(event[0] == "feed" for event in script[1:]):
        script.append(("feed", 0, 1))
    at = sorted(draw(st.integers(1, len(script)), label="move at") for _ in range(moves))
    for layout, index in reversed(list(enumerate(at, start=1))):
        script.insert(index, ("move", 0, layout))
    return tuple(script)


def play(
    engine: Engine,
    script: tuple[tuple, ...],
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
    requests = [engine.start("request A", batch)]
    for step, event in enumerate(script):
        kind, index, *rest = event
        request, what = requests[index], f"event #{step}: {said(event)}"
        if progress is not None:
            progress(what)
        at = f" ({what})"
        if kind == "feed" and request.held + rest[0] <= engine.max_length:
            new = torch.randint(0, vocab, (batch, rest[0]), generator=generator)
            engine.feed(request, new.to(kvdevices.current()), at=at)
        elif kind == "truncate" and "truncate" in request.offered:
            engine.truncate(request, request.held - rest[0], at=at)
        elif kind == "reorder" and "reorder" in request.offered:
            order = torch.Generator().manual_seed(rest[0])
            indices = torch.randint(0, batch, (batch,), generator=order)
            engine.reorder(request, indices.to(kvdevices.current()), at=at)
        elif kind == "fork":
            requests.append(engine.fork(request, f"fork {len(requests)}", at=at))
        elif kind == "reset":
            engine.reset(request)
        elif kind == "move" and move is not None and "move" in request.offered:
            move(request, rest[0], at)
        else:  # not offered, or a feed past max_length after a truncate a window refused
            continue
        engine.check(what)
    engine.finish(blocks_back=False)
