"""How a plan reads in a failure: a dataclass shown by the fields that differ from their
defaults, as its constructor (``ModelConfig(vocab_size=11, num_layers=1, ...)``), so that a
falsifying example is short and can still be pasted back as a pinned input.

Hypothesis prints a dataclass field by field, every field, unless the object has a
``_repr_pretty_``: ``short_repr`` gives a class both.
"""

from __future__ import annotations

import dataclasses


def fields_repr(self) -> str:
    """``Name(field=value, ...)`` of the init fields whose values differ from their defaults."""
    shown = []
    for field in dataclasses.fields(self):
        if not (field.init and field.repr):
            continue
        value = getattr(self, field.name)
        if field.default is not dataclasses.MISSING and _same(value, field.default):
            continue
        factory = field.default_factory
        if factory is not dataclasses.MISSING and _same(value, factory()):
            continue
        shown.append(f"{field.name}={value!r}")
    return f"{type(self).__name__}({', '.join(shown)})"


def _same(value: object, default: object) -> bool:
    try:
        return type(value) is type(default) and bool(value == default)
    except Exception:  # a value whose == is not a bool (a tensor): shown
        return False


def _repr_pretty_(self, printer, cycle: bool) -> None:  # Hypothesis's pretty printer
    printer.text(fields_repr(self))


def short_repr(cls: type) -> type:
    """Give a dataclass ``fields_repr`` as its repr, for Hypothesis's printer too."""
    cls.__repr__ = fields_repr
    cls._repr_pretty_ = _repr_pretty_
    return cls
