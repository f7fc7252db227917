"""What holds after an event, whatever the event: the checks several events share.

Each compares the caches with the engine's books (``kvcheck.session.request``), never the
other way round: a cache's own claim (its length, its first position) is what is under test.
The refusals at the end are the plans the oracle cannot follow; they are bugs in a plan, so
they raise ``TypeError``, never a property failure.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcheck import asserts as kvassert
from kvcheck import failures
from kvcheck.session.events.base import Session
from kvref import CacheContractError, ReferenceTransformer

if TYPE_CHECKING:
    from kvcheck.session.request import Request


def check_lengths(engine: Session, request: Request, what: str) -> None:
    """Every layer holds as many tokens as the history (and the poisoned rows past it)."""
    where = engine.where(f"{request.name}, after {what}")
    for layer, cache in enumerate(request.caches):
        who = f"{request.name}'s layer {layer}"
        try:
            kvassert.assert_length(cache, request.held + request.poisoned, who=who, where=where)
        except failures.PropertyFailure as error:  # raised reading it (the kit's shards)
            if where not in str(error):
                error.add_note(f"  at {where}")
            raise


def check_row_lengths(engine: Session, request: Request, what: str) -> None:
    """Every layer's ``row_lengths`` are the rows' own histories' lengths (section 8.1)."""
    want = tuple(len(row) for row in request.rows)
    for layer, cache in enumerate(request.caches):
        got = cache.row_lengths
        if tuple(got) != want:
            raise failures.DataLoss(
                f"{request.name}'s layer {layer}: row_lengths {tuple(got)} after {what}; "
                f"the rows hold {want}\n  at {engine.where(what)}"
            )


def check_firsts(engine: Session, request: Request, what: str) -> None:
    """Where the caches say where their rows start, it is where the plan put them: a
    shift, say, changes no first position (a stale one hides from the logits of a cache
    whose keys the model rotates: RoPE is relative)."""
    want = tuple(request.row_firsts())
    for layer, recorder in enumerate(request.caches):
        said = getattr(recorder.cache, "first_position", None)
        if said is None:
            continue
        got = (said,) * len(want) if isinstance(said, int) else tuple(said)
        if got != want:
            raise failures.DataLoss(
                f"{request.name}'s layer {layer}: first_position {said!r} after {what}; "
                f"its rows start at {list(want)}\n  at {engine.where(what)}"
            )


def check_returned(request: Request, end: int, where: str) -> None:
    """Every layer holds ``end`` tokens and, on the append path, returned the rows given."""
    for layer, cache in enumerate(request.caches):
        who = f"{request.name}'s layer {layer}"
        kvassert.assert_length(cache, end, who=who, where=where)
        if cache.path == "append":
            kvassert.assert_returned_rows(cache, who=who, where=where)


# --- refusals a window may make (contract, section 4) ------------------------------------
def windows(model: ReferenceTransformer) -> list[int | None]:
    """Each layer's window (None: a global layer)."""
    return [model.config.layer_window(layer) for layer in range(model.config.num_layers)]


def refused_by_a_cache(error: Exception) -> bool:
    """A cache's ``ValueError``, the only refusal the contract allows, and not the model's
    guard (``CacheContractError``), which speaks for no cache."""
    return isinstance(error, ValueError) and not isinstance(error, CacheContractError)


def refusal_allowed(
    engine: Session, request: Request, error: Exception, may_refuse: bool, what: str
) -> None:
    """A refusal of ``what`` by the model's caches: allowed where the contract lets a
    window refuse (``may_refuse``) and it is a cache's ``ValueError`` (not the model's
    guard), the history then left as it was; any other is a crash on valid input."""
    if refused_by_a_cache(error) and may_refuse:
        check_lengths(engine, request, f"a refused {what}")
        return
    raise failures.RefusesValidInput(
        f"{request.name}: {what} of {request.held} tokens refused with "
        f"{type(error).__name__}: {error}; no layer may refuse it: every position the next "
        f"query needs is among those a window cache must keep\n  at {engine.where(what)}"
    ) from error


# --- the plans the oracle follows ---------------------------------------------------------
def not_row_shifted(request: Request, call: str) -> None:
    # Each row's oracle after a shift per row follows the events on rows of their own only
    # (feeds, truncates, selections and joins by row, further shifts per row): a batch
    # event on rows of their own is no plan's.
    if request.row_shifted is not None:
        raise TypeError(f"{call} of {request.name} after a shift per row: no plan does so")
