"""Argument checks offered to implementers: each validates one call of the protocol or of
an optional capability (``append``, ``append_rows``, ``attend``, ``attend_latent``,
``truncate``, ``shift``, ``reorder``, ``append_tree`` / ``commit_tree``, ``import_rows``)
before a cache changes anything, and raises ``TypeError`` or ``ValueError`` with a message
that names the problem. They only read, so a cache that calls one first is left untouched
when it refuses. Using them is optional; keeping the rules they check is not. The reference
model uses the same checks on what it is handed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from kvref.moves import CacheRows
from kvref.protocol import CacheSpec, is_count


def check_append(
    spec: CacheSpec, length: int, key: object, value: object, *, capacity: int | None = None
) -> int:
    """Validate one ``append(key, value)`` against ``spec``; return T, the number of new tokens.

    ``length`` is what the cache holds now and ``capacity`` the most it can hold (None: no
    limit). Raises ``TypeError`` for non-tensors and ``ValueError`` for everything else, with
    a message that names the problem. It only reads, so a cache that calls it before changing
    anything leaves itself untouched on rejection.
    """
    for name, tensor in (("key", key), ("value", value)):
        if not isinstance(tensor, Tensor):
            raise TypeError(f"append: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    for name, tensor in (("key", key), ("value", value)):
        if tensor.ndim != 4:
            raise ValueError(
                f"append: {name} must have rank 4 (batch, kv_heads, T, head_dim), "
                f"got rank {tensor.ndim} with shape {tuple(tensor.shape)}"
            )
    if key.shape[:3] != value.shape[:3] or (spec.value_dim is None and key.shape != value.shape):
        raise ValueError(
            f"append: key and value shapes differ: "
            f"key {tuple(key.shape)}, value {tuple(value.shape)}"
        )
    batch, kv_heads, new_tokens, head_dim = key.shape
    expected = {"batch": spec.batch, "kv_heads": spec.kv_heads, "head_dim": spec.head_dim}
    for axis, got in (("batch", batch), ("kv_heads", kv_heads), ("head_dim", head_dim)):
        if got != expected[axis]:
            raise ValueError(
                f"append: wrong {axis}: got {got}, this cache was built for {expected[axis]} "
                f"(key shape {tuple(key.shape)})"
            )
    if value.shape[3] != spec.value_width:
        raise ValueError(
            f"append: wrong value width: got {value.shape[3]}, this cache was built for "
            f"{spec.value_width} (value shape {tuple(value.shape)})"
        )
    if new_tokens == 0:
        raise ValueError("append: zero new tokens (T = 0); append at least one token")
    for name, tensor in (("key", key), ("value", value)):
        if tensor.dtype != spec.dtype:
            raise ValueError(
                f"append: wrong dtype for {name}: got {tensor.dtype}, this cache holds "
                f"{spec.dtype} (it refuses rather than casting)"
            )
        if not same_device(tensor.device, torch.device(spec.device)):
            raise ValueError(
                f"append: wrong device for {name}: got {tensor.device}, this cache lives on "
                f"{spec.device}"
            )
    if capacity is not None and length + new_tokens > capacity:
        raise ValueError(
            f"append: overflow: holding {length} tokens, {new_tokens} more would exceed "
            f"the capacity of {capacity}"
        )
    return new_tokens


def same_device(actual: torch.device, wanted: torch.device) -> bool:
    """Whether a tensor on ``actual`` is on the device a spec names, ``wanted``."""
    # A spec that says "cuda" accepts "cuda:0"; one that says "cuda:1" does not.
    return actual.type == wanted.type and wanted.index in (None, actual.index)


def check_counts(counts: object, batch: int, new_tokens: int) -> tuple[int, ...]:
    """``counts`` as a tuple: one int per batch row, each 0 to ``new_tokens`` (ValueError,
    naming the problem, otherwise; a tensor of them is read as a list)."""
    if isinstance(counts, Tensor):
        counts = counts.tolist()
    if not isinstance(counts, Sequence) or isinstance(counts, str):
        raise ValueError(f"counts must be a sequence of {batch} ints, got {type(counts).__name__}")
    counts = tuple(counts)
    if len(counts) != batch:
        raise ValueError(f"counts must have one entry per batch row ({batch}), got {len(counts)}")
    wrong = [n for n in counts if not is_count(n) or n > new_tokens]
    if wrong:
        raise ValueError(
            f"counts must be ints from 0 to the {new_tokens} slots a row has; got {list(counts)}"
        )
    return counts


def check_append_rows(
    spec: CacheSpec,
    row_lengths: Sequence[int],
    key: object,
    value: object,
    counts: object,
    *,
    capacity: int | None = None,
) -> tuple[int, ...]:
    """Validate one ``append_rows(key, value, counts)`` (contract, section 8.1) on a cache
    whose rows hold ``row_lengths`` now: ``key`` and ``value`` as ``check_append`` does, for
    a batch of ``len(row_lengths)`` rows, ``counts`` one int per row from 0 to T, and no row
    past ``capacity``. Returns the counts as a tuple; only reads, like ``check_append``."""
    batch = len(row_lengths)
    check_append(dataclasses.replace(spec, batch=batch), 0, key, value)
    counts = check_counts(counts, batch, key.shape[2])
    if capacity is not None:
        over = [row for row in range(batch) if row_lengths[row] + counts[row] > capacity]
        if over:
            row = over[0]
            raise ValueError(
                f"append_rows: overflow: row {row} holds {row_lengths[row]} tokens, "
                f"{counts[row]} more would exceed the capacity of {capacity}"
            )
    return counts


def check_attend(
    spec: CacheSpec,
    length: int,
    query: object,
    key: object,
    value: object,
    *,
    capacity: int | None = None,
) -> int:
    """Validate one ``attend(query, key, value)``: ``key`` and ``value`` as ``check_append``
    does, and ``query`` shaped (batch, heads, T, head_dim) with heads a positive multiple of
    kv_heads, of the key's dtype and device. Returns T; only reads, like ``check_append``."""
    new_tokens = check_append(spec, length, key, value, capacity=capacity)
    if not isinstance(query, Tensor):
        raise TypeError(f"attend: query must be a torch.Tensor, got {type(query).__name__}")
    if query.ndim != 4:
        raise ValueError(
            f"attend: query must have rank 4 (batch, heads, T, head_dim), got shape "
            f"{tuple(query.shape)}"
        )
    batch, heads, new_tokens, head_dim = query.shape
    if (batch, new_tokens, head_dim) != (key.shape[0], key.shape[2], key.shape[3]):
        raise ValueError(
            f"attend: query shape {tuple(query.shape)} does not match key shape "
            f"{tuple(key.shape)} in batch, T or head_dim"
        )
    if heads == 0 or heads % spec.kv_heads:
        raise ValueError(
            f"attend: query has {heads} heads, not a positive multiple of the cache's "
            f"{spec.kv_heads} kv heads"
        )
    if query.dtype != key.dtype or query.device != key.device:
        raise ValueError(
            f"attend: query is {query.dtype} on {query.device}, key is {key.dtype} on "
            f"{key.device}; they must agree"
        )
    return new_tokens


def check_attend_latent(
    spec: CacheSpec,
    length: int,
    query: object,
    key: object,
    value: object,
    scale: object,
    *,
    capacity: int | None = None,
) -> int:
    """Validate one ``attend_latent(query, key, value, scale)`` (contract, section 10.2):
    ``key`` and ``value`` as ``check_append`` does, ``query`` shaped (batch, heads, T,
    value_width + head_dim) of the key's dtype and device, ``scale`` a positive finite
    number. Returns T; only reads."""
    new_tokens = check_append(spec, length, key, value, capacity=capacity)
    if not isinstance(query, Tensor):
        raise TypeError(f"attend_latent: query must be a torch.Tensor, got {type(query).__name__}")
    width = spec.value_width + spec.head_dim
    if query.ndim != 4 or (query.shape[0], query.shape[2], query.shape[3]) != (
        key.shape[0],
        key.shape[2],
        width,
    ):
        raise ValueError(
            f"attend_latent: query must be shaped ({key.shape[0]}, heads, {key.shape[2]}, "
            f"{width}: the latent's {spec.value_width} channels, then the rope key's "
            f"{spec.head_dim}), got {tuple(query.shape)}"
        )
    if query.shape[1] == 0:
        raise ValueError("attend_latent: query has 0 heads")
    if query.dtype != key.dtype or query.device != key.device:
        raise ValueError(
            f"attend_latent: query is {query.dtype} on {query.device}, key is {key.dtype} on "
            f"{key.device}; they must agree"
        )
    if (
        isinstance(scale, bool)
        or not isinstance(scale, int | float)
        or not math.isfinite(scale)
        or scale <= 0
    ):
        raise ValueError(f"attend_latent: scale must be a positive finite number, got {scale!r}")
    return new_tokens


def check_truncate(length_now: int, length: object) -> None:
    """Refuse ``truncate(length)`` on a cache holding ``length_now`` tokens unless
    0 <= length <= length_now and length is an int (a bool is not)."""
    if isinstance(length, bool) or not isinstance(length, int):
        raise ValueError(f"truncate: length must be an int, got {type(length).__name__} {length!r}")
    if not 0 <= length <= length_now:
        raise ValueError(
            f"truncate: length must be between 0 and {length_now} (the tokens held), got {length}"
        )


def check_shift(length_now: int, start: object, count: object) -> None:
    """Refuse ``shift(start, count)`` (section 8.4) on a cache holding ``length_now`` tokens
    unless both are ints (not bools), count >= 1, start >= 0 and start + count <= length."""
    for name, number in (("start", start), ("count", count)):
        if isinstance(number, bool) or not isinstance(number, int):
            raise ValueError(
                f"shift: {name} must be an int, got {type(number).__name__} {number!r}"
            )
    if count < 1 or start < 0 or start + count > length_now:
        raise ValueError(
            f"shift: discarding {count} tokens from index {start} needs count >= 1, start >= 0 "
            f"and start + count <= {length_now} (the tokens held)"
        )


def is_row_shift(start: object, count: object) -> bool:
    """Whether ``shift(start, count)`` is a shift per row (section 8.4): either argument a
    tuple or list (a mix with an int is then refused by ``check_shift_rows``)."""
    return isinstance(start, (tuple, list)) or isinstance(count, (tuple, list))


def check_shift_rows(
    row_lengths: Sequence[int], starts: object, counts: object
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Refuse ``shift(starts, counts)`` per row (section 8.4) on a cache whose rows hold
    ``row_lengths`` unless both are tuples (or lists) of one int per row, every row's
    0 <= start, 0 <= count and start + count <= its own length, and some count >= 1.
    Returns them as tuples; only reads."""
    rows = len(row_lengths)
    given = {"starts": starts, "counts": counts}
    ints = [name for name, arg in given.items() if not isinstance(arg, (tuple, list))]
    if ints:
        raise ValueError(
            f"shift: {' and '.join(ints)} must be a tuple of {rows} ints (one per row) beside "
            f"the other; got starts {starts!r} and counts {counts!r} (two ints shift every row "
            f"alike, an int beside a tuple is neither)"
        )
    for name, arg in given.items():
        if len(arg) != rows:
            raise ValueError(
                f"shift: {name} must have one entry per row ({rows}), got {len(arg)}: "
                f"{tuple(arg)!r}"
            )
        wrong = [row for row, n in enumerate(arg) if isinstance(n, bool) or not isinstance(n, int)]
        if wrong:
            raise ValueError(
                f"shift: {name}[{wrong[0]}] must be an int, got {type(arg[wrong[0]]).__name__} "
                f"{arg[wrong[0]]!r}"
            )
    for row, (start, count, held) in enumerate(zip(starts, counts, row_lengths, strict=True)):
        if count < 0 or start < 0 or start + count > held:
            raise ValueError(
                f"shift: row {row} holds {held} tokens; discarding {count} from index {start} "
                f"needs count >= 0, start >= 0 and start + count <= {held}"
            )
    if not any(counts):
        raise ValueError(f"shift: every count is 0 ({tuple(counts)!r}): the call moves no row")
    return tuple(starts), tuple(counts)


def check_reorder(spec: CacheSpec, indices: object) -> None:
    """Refuse ``reorder(indices)`` unless ``indices`` is an int64 tensor shaped (batch,) on
    the cache's device with values in [0, batch) (repeats are fine)."""
    if not isinstance(indices, Tensor):
        raise TypeError(f"reorder: indices must be a torch.Tensor, got {type(indices).__name__}")
    if indices.dtype != torch.int64:
        raise ValueError(f"reorder: indices must be int64, got {indices.dtype}")
    if indices.shape != (spec.batch,):
        raise ValueError(
            f"reorder: indices must have shape (batch,) = ({spec.batch},), "
            f"got {tuple(indices.shape)}"
        )
    if not same_device(indices.device, torch.device(spec.device)):
        raise ValueError(
            f"reorder: indices must be on the cache's device {spec.device}, got {indices.device}"
        )
    low, high = int(indices.min()), int(indices.max())
    if low < 0 or high >= spec.batch:
        raise ValueError(
            f"reorder: indices must be in [0, {spec.batch}) (batch rows), "
            f"got values from {low} to {high}"
        )


def check_tree(parents: object, nodes: int) -> tuple[int, ...]:
    """``parents`` as a tuple: one int per draft node, node i's an earlier node or -1
    (contract, section 9.2); ValueError naming the problem otherwise."""
    if isinstance(parents, Tensor):
        parents = parents.tolist()
    if not isinstance(parents, Sequence) or isinstance(parents, str):
        raise ValueError(f"parents must be a sequence of ints, got {type(parents).__name__}")
    parents = tuple(parents)
    if len(parents) != nodes:
        raise ValueError(
            f"parents must have one entry per draft node ({nodes}), got {len(parents)}"
        )
    for node, parent in enumerate(parents):
        if isinstance(parent, bool) or not isinstance(parent, int) or not -1 <= parent < node:
            raise ValueError(
                f"parents[{node}] is {parent!r}: a node's parent must be an earlier node or -1"
            )
    return parents


def check_accepted(
    accepted: object, parents: Sequence[int], batch: int, *, same_length: bool = False
) -> tuple[tuple[int, ...], ...]:
    """``accepted`` as tuples: per batch row, a path of draft nodes from a root (parent -1)
    down, each node the parent of the next (section 9.2); with ``same_length``, all of one
    length (a cache without rows of their own). ValueError naming the problem otherwise."""
    if not isinstance(accepted, Sequence) or isinstance(accepted, str) or len(accepted) != batch:
        raise ValueError(f"accepted must be one sequence of nodes per batch row ({batch})")
    paths = []
    for row, path in enumerate(accepted):
        if isinstance(path, Tensor):
            path = path.tolist()
        if not isinstance(path, Sequence) or isinstance(path, str):
            raise ValueError(f"accepted[{row}] must be a sequence of node indices")
        path = tuple(path)
        above = -1
        for node in path:
            if isinstance(node, bool) or not isinstance(node, int) or not 0 <= node < len(parents):
                raise ValueError(f"accepted[{row}] holds {node!r}, not a draft node")
            if parents[node] != above:
                raise ValueError(
                    f"accepted[{row}] = {list(path)} is not a path from a root down: node "
                    f"{node}'s parent is {parents[node]}, not {above}"
                )
            above = node
        paths.append(path)
    if same_length and len({len(path) for path in paths}) > 1:
        raise ValueError(
            f"accepted paths of lengths {[len(path) for path in paths]}: this cache keeps one "
            f"length for every row"
        )
    return tuple(paths)


def check_import(
    spec: CacheSpec, length: int, rows: object, *, capacity: int | None = None
) -> CacheRows:
    """Validate one ``import_rows(rows)`` (section 11.2) on a cache holding ``length`` tokens
    that can hold ``capacity`` (None: no limit); return ``rows``. ``TypeError`` for what is
    not a ``CacheRows``, ``ValueError`` for the rest; it only reads, like ``check_append``."""
    if not isinstance(rows, CacheRows):
        raise TypeError(f"import_rows: expected a kvref.CacheRows, got {type(rows).__name__}")
    if length:
        raise ValueError(f"import_rows: the cache holds {length} tokens; import into an empty one")
    if not is_count(rows.length):
        raise ValueError(f"import_rows: length must be an int >= 0, got {rows.length!r}")
    if not isinstance(rows.keys, Tensor) or not isinstance(rows.values, Tensor):
        raise TypeError("import_rows: keys and values must be torch.Tensors")
    if rows.keys.ndim != 4 or rows.values.ndim != 4 or rows.keys.shape[:3] != rows.values.shape[:3]:
        raise ValueError(
            f"import_rows: keys {tuple(rows.keys.shape)} and values {tuple(rows.values.shape)} "
            "must be (batch, kv_heads, rows, width) with the same rows"
        )
    for name, tensor in (("keys", rows.keys), ("values", rows.values)):
        if tensor.dtype != spec.dtype or not same_device(tensor.device, torch.device(spec.device)):
            raise ValueError(
                f"import_rows: {name} are {tensor.dtype} on {tensor.device}; this cache holds "
                f"{spec.dtype} on {spec.device}"
            )
    want = (spec.batch, spec.kv_heads, spec.head_dim, spec.value_width)
    got = (*rows.keys.shape[:2], rows.keys.shape[3], rows.values.shape[3])
    if got != want:
        raise ValueError(
            f"import_rows: rows of (batch, kv_heads, head_dim, value width) {got}; this cache "
            f"was built for {want}"
        )
    if rows.rows > rows.length:
        raise ValueError(f"import_rows: {rows.rows} rows for a length of {rows.length}")
    needed = spec.rows_needed(rows.length)
    if rows.rows < needed:
        raise ValueError(
            f"import_rows: {rows.rows} rows for a length of {rows.length}; this cache needs "
            f"the last {needed}"
        )
    if capacity is not None and rows.length > capacity:
        raise ValueError(
            f"import_rows: overflow: {rows.length} tokens exceed the capacity of {capacity}"
        )
    return rows
