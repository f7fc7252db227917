"""What a failed property means: the exception a check raises says how serious it is.

Every check in the kit raises a subclass of ``PropertyFailure`` (itself an
``AssertionError``, so pytest and Hypothesis treat it as a test failure). Its class is the
severity the verdict reports. Anything else escaping a property means something else:

- ``kvref.CacheContractError``: the reference model refused what the cache handed it (rows
  of the wrong count, layers of different lengths, one object for two layers): the cache
  broke the protocol, reported as data loss or corruption;
- ``OutsideDomain``: the kit was about to build a cache outside the domain the cache
  declares: a bug of the kit, never counted against the cache ("kit error");
- any other exception: the cache (or a user's override) crashed on valid input.
"""

from __future__ import annotations

import sys

# The severities, most serious first; the verdict shows the worst one of a property.
WRONG_RESULTS = "wrong results"
DATA_LOSS = "data loss or corruption"
CRASH = "crash"
REFUSAL_CHANGED_STATE = "refusal changed state"
ACCEPTS_BAD_INPUT = "accepts bad input"
UNCLEAR_ERROR = "unclear error"
KIT_ERROR = "kit error"  # the kit's own fault: shown after anything the cache did
SEVERITIES = (
    WRONG_RESULTS,
    DATA_LOSS,
    CRASH,
    REFUSAL_CHANGED_STATE,
    ACCEPTS_BAD_INPUT,
    UNCLEAR_ERROR,
    KIT_ERROR,
)


class PropertyFailure(AssertionError):
    """A property does not hold; subclasses say how serious that is."""

    severity = WRONG_RESULTS


class WrongResults(PropertyFailure):
    severity = WRONG_RESULTS


class DataLoss(PropertyFailure):
    severity = DATA_LOSS


class RefusalChangedState(PropertyFailure):
    severity = REFUSAL_CHANGED_STATE


class AcceptsBadInput(PropertyFailure):
    severity = ACCEPTS_BAD_INPUT


class UnclearError(PropertyFailure):
    severity = UNCLEAR_ERROR


class RefusesValidInput(PropertyFailure):
    """A call the contract says a cache must take was refused: a crash the kit recognised."""

    severity = CRASH


class OutsideDomain(Exception):
    """The kit was about to build a cache outside the domain it declares: a bug of the kit's
    draws (a pinned input or a hand-picked edge outside the domain is left out instead)."""

    def __init__(self, what: str) -> None:
        self.what = what
        super().__init__(
            f"the kit drew outside the domain the cache declares (a bug of the kit, not of "
            f"the cache): {what}"
        )


class NotOffered(OutsideDomain):
    """An enumerated plan calls what the cache does not offer (a walk of the interactions'
    exhaustive mode enumerates every event of the grammar): counted apart, as a plan outside
    the domain is, neither held nor failed."""

    def __init__(self, what: str) -> None:
        self.what = what
        Exception.__init__(self, f"the plan calls what the cache does not offer: {what}")


def set_root(error: BaseException, row: int) -> None:
    """Say that ``error`` follows from the first row a cache got wrong: the row at index
    ``row`` since its reset. The verdict groups a cache's failures of one root: one bug, seen
    by several properties."""
    error.kv_root = f"row {row} since a reset came back wrong"


def root_of(error: BaseException) -> str | None:
    """The root ``set_root`` gave ``error`` (or the exception it was raised from), or None."""
    while error is not None:
        if root := getattr(error, "kv_root", None):
            return root
        error = error.__cause__
    return None


def worst(error: BaseException, default: str) -> tuple[str, BaseException]:
    """The severity of ``error`` escaping a property whose plain assertions mean ``default``,
    and the exception it comes from (the worst one, when Hypothesis found several)."""
    if isinstance(error, BaseExceptionGroup):
        return min((worst(e, default) for e in error.exceptions), key=_rank)
    if isinstance(error, PropertyFailure):
        return error.severity, error
    if isinstance(error, OutsideDomain):
        return KIT_ERROR, error
    if is_contract_error(error):
        return DATA_LOSS, error
    if isinstance(error, AssertionError):  # e.g. a check a user overrode with plain asserts
        return default, error
    return CRASH, error


def is_contract_error(error: BaseException) -> bool:
    """Whether ``error`` is a ``kvref.CacheContractError``, without importing kvref (and
    torch) where nothing has: a verdict's controller under xdist only reads reports."""
    protocol = sys.modules.get("kvref.protocol")
    return protocol is not None and isinstance(error, protocol.CacheContractError)


def _rank(found: tuple[str, BaseException]) -> int:
    return SEVERITIES.index(found[0]) if found[0] in SEVERITIES else len(SEVERITIES)


def first_line(error: BaseException) -> str:
    """The one line a verdict shows for ``error``."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = lines[0] if lines else "(no message)"
    if not isinstance(error, PropertyFailure):
        text = f"{type(error).__name__}: {text}"
    return text


def whole_message(error: BaseException) -> str:
    """Everything ``error`` says: its type, message and notes (where it diverged, the plan,
    the diagnosis, the falsifying example), as the report's JSON keeps it."""
    import traceback

    return "".join(traceback.format_exception_only(error)).rstrip("\n")
