"""Moving a cache between layouts (contract, section 11.2) for any built-in, in terms of what
it already offers.

``MovableMixin`` gives a cache ``export_rows`` and ``import_rows`` built on a reader of the
rows it holds and its own ``append``; add it as a base class and define ``_rows_to_move``::

    class ConcatCache(MovableMixin):
        def _rows_to_move(self):
            return self.key, self.value

- ``export_rows()`` returns the rows held (``_rows_to_move``: every row, or a window cache's
  most recent run), oldest first, cloned so that no later call on the cache changes them,
  with the cache's ``length`` and, for a paged cache, its pool's block size
  (``_layout_block_size``). It changes nothing.
- ``import_rows(rows)`` checks ``rows`` (``kvref.check_import``, against ``_import_capacity``:
  the length past which the cache refuses, None for a cache that grows), then appends them as
  one ``append`` on the empty cache (``_append_imported``): the cache is then exactly what
  feeding those tokens in one call makes it, and the next append continues at ``rows.length``.
  A run that starts after position 0 (a window's recent rows) is placed by
  ``_start_run_at``, which only a window cache has; every other cache keeps each row from
  position 0 and refuses one, changing nothing.

Keys move as the cache stores them: rotated, or unrotated for a cache whose
``keys_stored`` is "unrotated" (contract, section 8.4). The kit moves rows only between
caches that store keys the same way, so nothing is rotated here.

Not every built-in has it: the quantized cache (``kvimpl.quantized``) holds codes, not the
rows it was given (a move would be lossy), and the Hugging Face adapters (``kvimpl.hf``,
``kvimpl.hf_quantized``) wrap layers whose storage is not ours to write.
"""

from __future__ import annotations

from torch import Tensor

from kvref.checks import check_import
from kvref.moves import CacheRows, no_rows
from kvref.protocol import CacheSpec


class MovableMixin:
    """``export_rows`` and ``import_rows`` on the cache's own reader of its rows and its own
    ``append``; see the module docstring. Needs ``spec``, ``length``, ``append`` and
    ``_rows_to_move``, keeps no attribute and needs no ``__init__``."""

    spec: CacheSpec

    def export_rows(self) -> CacheRows:
        spec = self._movable("export_rows")
        if self.length:
            keys, values = self._rows_to_move()
        else:
            keys, values = no_rows(spec)
        block_size = self._layout_block_size()
        return CacheRows(keys.clone(), values.clone(), self.length, block_size)

    def import_rows(self, rows: CacheRows) -> None:
        spec = self._movable("import_rows")
        rows = check_import(spec, self.length, rows, capacity=self._import_capacity())
        first = rows.length - rows.rows  # the position of the first row given
        if first:
            self._start_run_at(first)
        if rows.rows:
            self._append_imported(rows)

    # What a cache defines, or changes.

    def _rows_to_move(self) -> tuple[Tensor, Tensor]:
        """The keys and values held, oldest first (views allowed: export clones them); called
        only while the cache holds some token."""
        raise NotImplementedError

    def _movable(self, call: str) -> CacheSpec:
        """The spec that rows moving in or out must fit; refuse ``call`` (ValueError) where
        the cache's rows cannot move now."""
        return self.spec

    def _import_capacity(self) -> int | None:
        """What the cache refuses past (``check_import``'s capacity); None: it grows."""
        return None

    def _layout_block_size(self) -> int | None:
        """The block size of the layout the rows leave (``CacheRows.block_size``)."""
        return None

    def _start_run_at(self, first: int) -> None:
        """Before an import whose first row is at position ``first`` > 0: only a cache that
        keeps a window's recent run can hold one; this one keeps every row."""
        raise ValueError(
            f"import_rows: the rows start at position {first}; this {type(self).__name__} "
            f"keeps every row from position 0 and takes all of them"
        )

    def _append_imported(self, rows: CacheRows) -> None:
        """Write the rows checked, at the positions ``_start_run_at`` placed them."""
        self.append(rows.keys, rows.values)


class RecentRunMixin(MovableMixin):
    """``MovableMixin`` for a ring that keeps a window's most recent run (``window``,
    ``streaming``): an import whose rows start at position ``first`` moves the empty ring's
    ``_length`` there, and its ``append`` then writes each row into the slot of its position,
    as if the tokens before had been fed and forgotten."""

    _length: int

    def _start_run_at(self, first: int) -> None:
        self._length = first
