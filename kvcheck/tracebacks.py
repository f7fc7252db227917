"""A kit test's failure as a person reads it at 2 a.m.: the kit's message first (where it
diverged, by how much, the plan, the diagnosis, the falsifying example), then the frames of
the cache's own code that the failure passed through, innermost last. The frames of the kit,
its reference model, torch, Hypothesis and pytest are left out: they are the same in every
failure and push the message off the first screen (``--tb=long``, ``--full-trace`` or
``--showlocals`` gives pytest's own report, every frame).

A crash of the kit's own machinery (an exception raised in the kit that is no verdict on the
cache) keeps pytest's whole traceback: there the kit's frames are the point.
"""

from __future__ import annotations

import functools
import os
import sys
import traceback
from types import TracebackType

# Whose frames a failure leaves out: the packages' files (by file, not by the frame's module:
# Hypothesis runs a test's function under globals of its own).
HIDDEN = ("kvcheck", "kvref", "torch", "hypothesis", "_pytest", "pytest", "pluggy")
# pytest's --tb styles a kit failure is shown in this way; any other (long, native, line,
# no) is pytest's own.
STYLES = frozenset({"auto", "short"})


def readable(error: BaseException, root: str) -> str | None:
    """The text of ``error``'s report, paths relative to ``root``; None where pytest's own
    traceback serves better (a crash of the kit, an exception group)."""
    if isinstance(error, BaseExceptionGroup) or _kit_crash(error):
        return None
    lines = _message(error)
    if own := _own_frames(error.__traceback__, root):
        lines += ["", "through your code (innermost last; --tb=long shows every frame):", *own]
    seen = {id(error)}
    cause = _cause(error)
    while cause is not None and id(cause) not in seen:  # the whole chain, down to its root
        seen.add(id(cause))
        own = _own_frames(cause.__traceback__, root)
        lines += ["", "raised from this, which your code raised:" if own else "raised from this:"]
        lines += [*own, *(f"  {line}" for line in _message(cause))]
        cause = _cause(cause)
    return "\n".join(lines)


def _cause(error: BaseException) -> BaseException | None:
    return error.__cause__ or (None if error.__suppress_context__ else error.__context__)


def _message(error: BaseException) -> list[str]:
    """The exception's type, message and notes (Hypothesis's falsifying example among them)."""
    return "".join(traceback.format_exception_only(error)).rstrip("\n").splitlines()


def _own_frames(tb: TracebackType | None, root: str) -> list[str]:
    shown = []
    for frame, line in traceback.walk_tb(tb):
        if _within(frame.f_code.co_filename, HIDDEN):
            continue
        summary = traceback.FrameSummary(
            frame.f_code.co_filename, line, frame.f_code.co_name, lookup_line=True
        )
        shown.append(f"  {_relative(summary.filename, root)}:{line} in {summary.name}")
        if summary.line:
            shown.append(f"      {summary.line}")
    return shown


def _kit_crash(error: BaseException) -> bool:
    """An exception the kit raised in its own code that is no verdict on the cache: not a
    property failure, and no frame of the user's on its way (a cache that calls a helper of
    the kit, ``kvref.check_append`` say, and fails in it, crashed in the user's code)."""
    if isinstance(error, AssertionError) or _is_contract_error(error):
        return False
    frames = [frame.f_code.co_filename for frame, _ in traceback.walk_tb(error.__traceback__)]
    return bool(frames) and all(_within(path, HIDDEN) for path in frames)


def _is_contract_error(error: BaseException) -> bool:
    from kvcheck import failures

    return failures.is_contract_error(error)


def _within(path: str, packages: tuple[str, ...]) -> bool:
    """Whether the file ``path`` is one of ``packages``' (those imported)."""
    return any(path.startswith(folder) for folder in _folders(packages))


@functools.cache
def _folders(packages: tuple[str, ...]) -> tuple[str, ...]:
    folders = []
    for name in packages:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None):
            folders.append(os.path.dirname(module.__file__) + os.sep)
    return tuple(folders)


def _relative(path: str, root: str) -> str:
    try:
        relative = os.path.relpath(path, root)
    except ValueError:  # another drive
        return path
    return path if relative.startswith("..") else relative
