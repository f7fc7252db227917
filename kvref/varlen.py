"""Attention over rows of their own as a varlen kernel computes it (contract, section 8.2):
each batch row over only the slots its cache marks valid, so that a row costs its own
length, not the longest row's (``varlen_attention``); and, for a cache that keeps keys
unrotated (section 8.4), its keys rotated at their positions first (``rotating_keys``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvref.rope import apply_rope


def varlen_attention(
    attend,
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    query_positions: Tensor,
    key_positions: Tensor,
    *args,
    valid: Tensor,
    sink_end: int | Tensor | None = None,
    sink_query: Tensor | None = None,
    **kwargs,
) -> Tensor:
    """``attend`` (``attention``, or MLA's over latents) as a varlen kernel computes it
    (flash-attn's ``cu_seqlens``, contract section 8.2): batch row b over only the rows
    ``valid[b]`` marks, (B, rows), taken as a slice where they are one run (right or left
    padding) and gathered where they are not, the other slots never read. The result of
    ``attend(..., valid=valid)``, the dense masked path, within rounding (the sums run over
    fewer terms), at each row's own cost: the dense path attends every row over the longest
    row's slots. A row with no valid rows takes the dense path: its queries see no key (nan).
    ``sink_end`` (B,) and ``sink_query`` are split by row with the rest."""
    per_row = []
    for row in range(query.shape[0]):
        one = slice(row, row + 1)
        own = {"sink_query": None if sink_query is None else sink_query[one], **kwargs}
        per_row_sinks = isinstance(sink_end, Tensor) and sink_end.ndim
        own["sink_end"] = sink_end[one] if per_row_sinks else sink_end
        slots = valid_slots(valid[row])
        if slots is None:
            slots, own["valid"] = slice(None), valid[one]
        keys_seen, values_seen = keys[one, :, slots], values[one, :, slots]
        seen_at = (query_positions[one], key_positions[one, slots])
        per_row.append(attend(query[one], keys_seen, values_seen, *seen_at, *args, **own))
    return torch.cat(per_row)


def rotating_keys(attend, base: float, query: Tensor, keys: Tensor, *args, **kwargs) -> Tensor:
    """``attend`` over ``keys`` kept unrotated (section 8.4), rotated first at
    ``key_positions``: on the varlen path, each row's own rows alone, not its pads."""
    values, query_positions, key_positions, *rest = args
    rotated = apply_rope(keys, key_positions.clamp(min=0), base)  # a pad's position is any
    return attend(query, rotated, values, query_positions, key_positions, *rest, **kwargs)


def valid_slots(valid: Tensor) -> slice | Tensor | None:
    """The slots ``valid`` (rows,) marks: a slice where they are one run (a view, no copy),
    else their indices; None where there are none."""
    slots = valid.nonzero().flatten()
    if not slots.numel():
        return None
    first, last = int(slots[0]), int(slots[-1])
    return slice(first, last + 1) if last - first + 1 == slots.numel() else slots
