"""The public cache protocol: what a key/value cache for one decoder layer must do.

This module is a contract with users; ``docs/contract.md`` states every rule and how the
suite checks it. In short:

- ``append(key, value)`` takes tensors shaped (batch, kv_heads, T, head_dim), T >= 1, of the
  spec's dtype and device, copies them, and returns every row appended since the last reset,
  oldest first, each exactly as given (views are fine until the next call). With
  ``spec.window = W`` it may return only a recent run: at least the last W - 1 rows before
  the new ones and the new ones (``CacheSpec.rows_needed``).
- ``length`` grows by exactly T per append; ``reset()`` makes it 0, and nothing written
  before a reset may influence a later result. Caches from one factory share no rows.
- At least ``spec.max_length`` tokens fit; past that a cache may refuse, never drop, wrap or
  overwrite (a window cache drops only positions no later query can see).
- Bad input raises ``ValueError`` (or a subclass; ``TypeError`` is also fine for an argument
  that is not a tensor) whose message names the problem in the implementer's own words, and
  leaves the cache exactly as it was. T = 0 may be refused or accepted as a no-op.
- ``nbytes`` is what the cache really reserves: at least 2 x B x H_kv x rows x D x itemsize,
  rows being ``length``, or min(length, W - 1) with a window.
- Optional capabilities (``truncate``, ``reorder``, ``fork``, ``attend``) are offered by
  having the method.

``check_append`` (and ``check_truncate``, ``check_reorder``, ``check_attend`` for the optional
capabilities) is offered to implementers so that a cache can reject bad input with clear
messages in one call; using them is optional, keeping the rules is not.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
import types
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor


@dataclass(frozen=True)
class Shard:
    """One tensor-parallel rank's share of an attention layer (contract, section 11.1): the
    global ids of the kv heads its caches hold and of the query heads it computes, in the
    order its output has them, of a layer of ``num_kv_heads`` kv heads."""

    rank: int
    world: int
    kv_heads: tuple[int, ...]
    query_heads: tuple[int, ...]
    num_kv_heads: int

    @property
    def replicated(self) -> bool:
        """Whether other ranks hold its kv heads too (kv heads fewer than ranks)."""
        return self.num_kv_heads < self.world


def shard_heads(num_heads: int, num_kv_heads: int, world: int) -> tuple[Shard, ...]:
    """The shards Megatron and vLLM cut (section 11.1): with at least as many kv heads as
    ranks, rank r holds the r-th contiguous block of them and their query heads; with fewer,
    each kv head is replicated on world / num_kv_heads consecutive ranks, which split its
    group of query heads between them. Raises ``ValueError`` where neither count divides
    the other, or a replicated group does not split evenly."""
    for name, count in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("world", world)):
        if not is_count(count) or count < 1:
            raise ValueError(f"shard_heads: {name} must be an int >= 1, got {count!r}")
    if num_heads % num_kv_heads:
        raise ValueError(f"shard_heads: {num_heads} query heads for {num_kv_heads} kv heads")
    group = num_heads // num_kv_heads
    if num_kv_heads >= world:
        if num_kv_heads % world:
            raise ValueError(f"shard_heads: {num_kv_heads} kv heads do not split over {world}")
        per = num_kv_heads // world
        return tuple(
            Shard(
                rank,
                world,
                tuple(range(rank * per, (rank + 1) * per)),
                tuple(range(rank * per * group, (rank + 1) * per * group)),
                num_kv_heads,
            )
            for rank in range(world)
        )
    if world % num_kv_heads or group % (world // num_kv_heads):
        raise ValueError(
            f"shard_heads: {num_kv_heads} kv heads of {group} query heads each do not "
            f"replicate over {world} ranks"
        )
    replicas = world // num_kv_heads
    share = group // replicas
    return tuple(
        Shard(
            rank,
            world,
            (rank // replicas,),
            tuple(range(rank * share, (rank + 1) * share)),
            num_kv_heads,
        )
        for rank in range(world)
    )


@dataclass(frozen=True)
class CacheSpec:
    """What a cache is built for: keys shaped (batch, kv_heads, length, head_dim) and values
    (batch, kv_heads, length, value_width): ``value_dim``, or ``head_dim`` where it is None."""

    batch: int
    kv_heads: int
    head_dim: int
    max_length: int  # the most tokens this cache will be asked to hold
    dtype: torch.dtype
    device: torch.device
    window: int | None = None  # sliding-window layer: a query at p sees keys p-window+1..p
    # Attention sinks beside the window (contract, section 8.5): every query also sees the
    # session's first ``sinks`` tokens. Only with a window; 0 for every spec the kit builds
    # for a cache that declares none.
    sinks: int = 0
    # The model's RoPE base, for a cache that rotates keys itself (context shift, section 8.4).
    rope_base: float = 10_000.0
    # A latent (MLA) layer's values are wider than its keys (contract, section 10.2): the
    # compressed latent beside the small rope key. None, the values are ``head_dim`` wide;
    # the kit sets it only for a cache that declares ``supports: {"latent": True}``.
    value_dim: int | None = None
    # The tensor-parallel rank this cache serves (contract, section 11.1): its share of the
    # layer's heads, ``kv_heads`` of them; None outside a sharded run. A cache may ignore it.
    shard: Shard | None = None

    @property
    def value_width(self) -> int:
        """The width of a value row: ``value_dim``, or ``head_dim`` where it is None."""
        return self.head_dim if self.value_dim is None else self.value_dim

    def __post_init__(self) -> None:
        if self.value_dim is not None and not (is_count(self.value_dim) and self.value_dim):
            raise ValueError(
                f"CacheSpec.value_dim must be None or an int >= 1, got {self.value_dim!r}"
            )
        if self.window is not None and (
            isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1
        ):
            raise ValueError(f"CacheSpec.window must be None or an int >= 1, got {self.window!r}")
        if not is_count(self.sinks):
            raise ValueError(f"CacheSpec.sinks must be an int >= 0, got {self.sinks!r}")
        if self.sinks and self.window is None:
            raise ValueError(f"CacheSpec.sinks is {self.sinks}: sinks need a window")

    def rows_needed(self, length: int, new_tokens: int = 0) -> int:
        """The fewest rows a cache holding ``length`` tokens may keep (0 new tokens) or return
        after an append of ``new_tokens`` of them (``rows_needed``)."""
        return rows_needed(self.window, length, new_tokens, self.sinks)


def rows_needed(window: int | None, length: int, new_tokens: int = 0, sinks: int = 0) -> int:
    """The fewest rows a layer with ``window`` holding ``length`` tokens may keep (0 new
    tokens) or return after an append of ``new_tokens`` of them: all of them without a
    window, else the last W - 1 before the new ones (every new query's whole window) and
    the new ones, and the first ``sinks`` (section 8.5) where they are not among those."""
    if window is None:
        return length
    return min(length, sinks + window - 1 + new_tokens)


def may_refuse_shift(windows: Iterable[int | None], held: int, start: int, count: int) -> bool:
    """Whether a model whose layers have ``windows``, holding ``held`` tokens, may see
    ``shift(start, count)`` refused (section 8.4): the next query, at index held - count,
    needs a row that a window layer was not bound to keep (only the last W - 1)."""
    after = held - count
    for window in set(windows) - {None}:
        needed = max(0, after - window + 1)  # the oldest index the next query sees, after
        if needed >= after:
            continue  # it sees no held row (W = 1, or nothing left)
        before = needed if needed < start else needed + count  # that row's index now
        if before < max(0, held - window + 1):
            return True
    return False


def kept_rows(sinks: int, held: int, total: int) -> list[int]:
    """Which of ``total`` tokens a cache returning ``held`` rows returns, as indices since
    the reset, oldest first: the first ``sinks`` (section 8.5), then the most recent run
    (rule 7). Without sinks, the last ``held``."""
    first = min(sinks, held)
    return [*range(first), *range(total - (held - first), total)]


def may_refuse_truncate(windows: Iterable[int | None], held: int, target: int) -> bool:
    """Whether a model whose layers have ``windows``, holding ``held`` tokens, may see a
    truncate to ``target`` refused: a window layer must keep only the last W - 1 positions,
    and the next query needs those from target - W + 1."""
    # Some position the next query needs (target - W + 1 .. target - 1) lies before the
    # first one every cache must keep (held - W + 1).
    return any(
        max(0, target - w + 1) < min(target, max(0, held - w + 1)) for w in set(windows) - {None}
    )


@runtime_checkable
class LayerCache(Protocol):
    """Keys and values of ONE decoder layer, each shaped (batch, kv_heads, length, head_dim)."""

    @property
    def length(self) -> int:
        """Tokens appended since the last reset (the next position); a plain int."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes of key+value storage currently reserved."""
        ...

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """Store T new rows; return the rows kept for attention, oldest first (views valid
        until the next call): every row since the reset, or with ``spec.window`` a recent
        contiguous run of at least ``spec.rows_needed(length, T)`` rows ending with the T new."""
        ...

    def reset(self) -> None:
        """Empty again, ready for an unrelated prompt."""
        ...


CacheFactory = Callable[[CacheSpec], LayerCache]  # a class taking a CacheSpec qualifies


class CacheContractError(ValueError):
    """Caches handed to the reference model that break the protocol or do not fit the call:
    the wrong number of them, one object for two layers, layers of different lengths, a
    spec for another batch, or an ``append`` that returned the wrong number of rows.

    Raised before any cache changes where it can be (all but the last, which is only known
    after ``append``). A subclass of ``ValueError``, so that callers who passed bad caches
    see the error they expect; the suite tells it apart from a caller's bad token ids.
    """


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
        if not _same_device(tensor.device, torch.device(spec.device)):
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


def is_count(value: object) -> bool:
    """An int >= 0 (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


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


def row_slots(padding: str, width: int, count: int) -> slice:
    """Where a row's ``count`` new tokens sit among the ``width`` slots of an
    ``append_rows`` call: the first ones (``padding`` "right") or the last ("left")."""
    return slice(width - count, width) if padding == "left" else slice(0, count)


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


def _same_device(actual: torch.device, wanted: torch.device) -> bool:
    # A spec that says "cuda" accepts "cuda:0"; one that says "cuda:1" does not.
    return actual.type == wanted.type and wanted.index in (None, actual.index)


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


def shifts_per_row(cache: object) -> bool:
    """Whether ``cache`` declares a shift per row (section 8.4): rows of their own,
    ``shift`` and ``shift_per_row = True``."""
    return (
        getattr(cache, "shift_per_row", False) is True
        and isinstance(cache, RowsOfTheirOwn)
        and isinstance(cache, Shiftable)
    )


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
    if not _same_device(indices.device, torch.device(spec.device)):
        raise ValueError(
            f"reorder: indices must be on the cache's device {spec.device}, got {indices.device}"
        )
    low, high = int(indices.min()), int(indices.max())
    if low < 0 or high >= spec.batch:
        raise ValueError(
            f"reorder: indices must be in [0, {spec.batch}) (batch rows), "
            f"got values from {low} to {high}"
        )


def min_nbytes(
    spec: CacheSpec,
    length: int,
    storage: tuple[Quantized | None, Quantized | None] = (None, None),
    in_codes: tuple[int, int] = (0, 0),
) -> int:
    """The least a cache holding ``length`` tokens can reserve: B x H_kv x rows x (D + the
    value width) x itemsize (2 x D where values are as wide as keys), where rows is
    ``length``, or min(length, W - 1) with a window. A concat cache reserves exactly this.
    Under a declared lossy ``storage`` (section 10.1), of keys and of values the first
    ``in_codes`` rows may be in codes, each at its declaration's least (``Quantized.nbytes``)."""
    itemsize = torch.empty((), dtype=spec.dtype).element_size()
    rows = spec.rows_needed(length)
    total = 0
    widths = (spec.head_dim, spec.value_width)
    for declared, coded, width in zip(storage, in_codes, widths, strict=True):
        coded = 0 if declared is None else max(0, min(rows, coded - (length - rows)))
        exact = (rows - coded) * width * itemsize
        total += exact + (declared.nbytes(coded, width) if declared else 0)
    return spec.batch * spec.kv_heads * total


# What ``held_nbytes`` knows holds no rows: scalars and names, and what code is made of.
_HOLDS_NOTHING = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    range,
    slice,
    torch.dtype,
    torch.device,
    torch.Size,
    torch.Generator,
    type,
    type(dataclasses),
    type(threading.Lock()),
    type(threading.RLock()),
)


def _slot_names(kind: type) -> tuple[str, ...]:
    slots = vars(kind).get("__slots__", ())
    return (slots,) if isinstance(slots, str) else tuple(slots)


def _class_data(kind: type) -> list:
    """What a class and its bases hold as data that could be rows (an arena its instances
    share, say): tensors and collections, not methods, descriptors or constants."""
    return [
        value
        for base in kind.__mro__[:-1]  # not object
        if base.__module__ != "builtins"
        for name, value in vars(base).items()
        if not name.startswith("__") and isinstance(value, Tensor | Mapping | list | tuple | set)
    ]


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:  # a name not yet bound
        return False
    return True


def held_nbytes(obj: object) -> int | None:
    """The bytes of the tensors ``obj`` holds: reachable through its attributes (``__dict__``
    and every class's ``__slots__``), collections, dicts, bound methods and partials, a
    tensor subclass counted by the inner tensors its ``__tensor_flatten__`` names and an
    array by its ``nbytes``, each storage once and whole (a view holds all of its storage).
    None where it meets an object it cannot see into (an extension type without attributes,
    a tensor whose storage cannot be read), since what that holds is unknown. What a cache's
    ``nbytes`` should be at most, where it keeps its rows in objects of its own (contract,
    section 10.1)."""
    storages: dict[tuple, int] = {}
    seen: set[int] = set()
    todo = [obj]
    while todo:
        item = todo.pop()
        if isinstance(item, _HOLDS_NOTHING) or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, Tensor):
            if type(item) is not Tensor and hasattr(item, "__tensor_flatten__"):
                todo += [getattr(item, name) for name in item.__tensor_flatten__()[0]]
                continue
            try:
                storage = item.untyped_storage()
                key = (storage.data_ptr(), str(item.device), storage.nbytes())
            except (RuntimeError, NotImplementedError):  # sparse, or a wrapper without data
                return None
            storages[key] = storage.nbytes()
        elif isinstance(item, bytes | bytearray | memoryview):
            storages[(id(item),)] = len(item)
        elif hasattr(item, "__array_interface__") and isinstance(
            getattr(item, "nbytes", None), int
        ):
            storages[(id(item),)] = item.nbytes  # a numpy array
        elif isinstance(item, Mapping):
            todo += list(item.values())
        elif isinstance(item, Collection):
            todo += list(item)
        elif isinstance(item, functools.partial):
            todo += [item.func, *item.args, *item.keywords.values()]
        elif hasattr(item, "__self__"):  # a bound method: what it is bound to
            todo.append(item.__self__)
        elif isinstance(item, types.FunctionType):  # what its closure holds, not its module
            todo += [cell.cell_contents for cell in item.__closure__ or () if _filled(cell)]
        else:
            fields = getattr(item, "__dict__", None)
            slots = [name for kind in type(item).__mro__ for name in _slot_names(kind)]
            if fields is None and not slots:
                return None
            todo += list((fields or {}).values())
            todo += [getattr(item, name) for name in slots if hasattr(item, name)]
            todo += _class_data(type(item))
    return sum(storages.values())


@runtime_checkable
class Truncatable(Protocol):
    def truncate(self, length: int) -> None:
        """Forget every token at position >= ``length`` (0 <= length <= self.length): the cache
        then behaves as if only the first ``length`` tokens had been appended. A window cache
        that has dropped a position the next query would need refuses (ValueError)."""
        ...


@runtime_checkable
class Reorderable(Protocol):
    def reorder(self, indices: Tensor) -> None:
        """Batch row b becomes the old row ``indices[b]``: ``indices`` is int64 shaped (batch,)
        on the cache's device, values in [0, batch), repeats allowed (beam search)."""
        ...


@runtime_checkable
class Forkable(Protocol):
    def fork(self) -> LayerCache:
        """A new cache holding the same tokens (parallel sampling, a shared prompt); from then
        on the two are independent. It may share storage copy-on-write."""
        ...


@runtime_checkable
class Attending(Protocol):
    def attend(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        """Append ``key`` and ``value`` as ``append`` would, then return softmax attention of
        ``query`` (batch, heads, T, head_dim; heads a multiple of kv_heads, query head h
        reading kv head h // (heads // kv_heads)) over the rows kept, masked by absolute
        position (causal, and the window), scaled by 1/sqrt(head_dim), shaped like ``query``.
        ``kvref.attention`` is the reference it is held to."""
        ...


@runtime_checkable
class AttendingLatent(Protocol):
    def attend_latent(self, query: Tensor, key: Tensor, value: Tensor, scale: float) -> Tensor:
        """An MLA layer's absorbed attention (contract, section 10.2): append the rope keys
        ``key`` (batch, 1, T, d_r) and latents ``value`` (batch, 1, T, d_c) as ``append``
        would, then return, for each head of ``query`` (batch, heads, T, d_c + d_r: the
        folded no-rope query, then the rotated rope channels), softmax(``scale`` x query
        [latent ; rope key]^T) latents over the rows kept, masked as ``attend`` masks,
        shaped (batch, heads, T, d_c) in the query's dtype."""
        ...


@runtime_checkable
class Shiftable(Protocol):
    def shift(self, start: int, count: int) -> None:
        """Forget the tokens of indices start .. start + count - 1 and move every later one
        down by ``count``, its key re-rotated by -count positions (section 8.4)."""
        ...


@runtime_checkable
class RowsOfTheirOwn(Protocol):
    """A cache whose batch rows hold lengths of their own (contract, section 8.1);
    ``truncate_rows``, ``select_rows``, ``join``, ``first_position`` and ``reset_at`` are
    each optional beside it."""

    @property
    def row_lengths(self) -> tuple[int, ...]: ...

    def append_rows(
        self, key: Tensor, value: Tensor, counts: Sequence[int]
    ) -> tuple[Tensor, Tensor, Tensor]: ...


@runtime_checkable
class TreeDrafts(Protocol):
    """A cache that holds a speculative draft tree until one path per row is committed
    (contract, section 9.2)."""

    def append_tree(
        self, key: Tensor, value: Tensor, parents: Sequence[int]
    ) -> tuple[Tensor, Tensor]:
        """Store T draft nodes after the committed rows (node i's parent ``parents[i]``, an
        earlier node, or -1) and return the committed rows then the nodes, as ``append``."""
        ...

    def commit_tree(self, accepted: Sequence[Sequence[int]]) -> None:
        """Keep, per batch row, the nodes of ``accepted[b]`` (a path from a root down), in
        path order after the committed rows; forget every other node."""
        ...


@runtime_checkable
class Offloadable(Protocol):
    """A cache whose rows can leave its pool and come back (preemption by swapping, section
    9.3)."""

    @property
    def offloaded(self) -> bool: ...

    def offload(self) -> None:
        """Move every row out of the pool, giving its blocks back; ``length`` is unchanged."""
        ...

    def restore(self) -> None:
        """Take blocks again and copy the rows back, bit for bit (ValueError, changing
        nothing, when the pool has too few free blocks)."""
        ...


@dataclass(frozen=True)
class CacheRows:
    """A cache's rows out of it, in no layout (contract, section 11.2): ``keys`` (B, H_kv,
    rows, D) and ``values`` (B, H_kv, rows, value width), oldest first, the last at position
    ``length - 1``; ``block_size`` the block size of the layout they came from (None: none)."""

    keys: Tensor
    values: Tensor
    length: int
    block_size: int | None = None

    @property
    def rows(self) -> int:
        return self.keys.shape[2] if isinstance(self.keys, Tensor) else 0


@runtime_checkable
class Movable(Protocol):
    """A cache whose rows can move to a cache of another layout: another block size, shard
    count or device (disaggregated prefill and decode, section 11.2)."""

    def export_rows(self) -> CacheRows:
        """The rows held, in tensors later calls on this cache never change."""
        ...

    def import_rows(self, rows: CacheRows) -> None:
        """On an empty cache: hold ``rows`` as if fed their tokens (ValueError, changing
        nothing, for rows it cannot take)."""
        ...


def no_rows(spec: CacheSpec) -> tuple[Tensor, Tensor]:
    """Zero rows of keys and values for ``spec``: an empty cache's, or its export."""
    shape = (spec.batch, spec.kv_heads, 0)
    return (
        torch.empty((*shape, spec.head_dim), dtype=spec.dtype, device=spec.device),
        torch.empty((*shape, spec.value_width), dtype=spec.dtype, device=spec.device),
    )


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
        if tensor.dtype != spec.dtype or not _same_device(tensor.device, torch.device(spec.device)):
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


CAPABILITIES = {
    "truncate": Truncatable,
    "reorder": Reorderable,
    "fork": Forkable,
    "attend": Attending,
    "attend_latent": AttendingLatent,
    "append_rows": RowsOfTheirOwn,
    "shift": Shiftable,
    "tree": TreeDrafts,
    "offload": Offloadable,
    "move": Movable,
}


@runtime_checkable
class BlockPool(Protocol):
    """A factory whose caches take fixed-size blocks from one pool it owns (a paged cache,
    as serving engines have): caches for any layer and any request share it, each through
    block tables of its own, and give their blocks back on ``reset()`` and when collected."""

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        ...

    @property
    def blocks_in_use(self) -> int:
        """Distinct blocks the live caches' block tables reference; a shared block once."""
        ...

    @property
    def blocks_free(self) -> int:
        """Blocks an append may still take before the pool refuses."""
        ...

    def with_blocks(self, num_blocks: int) -> BlockPool:
        """A new, empty pool of the same kind and block size with room for ``num_blocks``
        blocks: the suite builds tight pools with it, so that blocks are freed and reused
        constantly and an exhausted pool's refusal is tested."""
        ...


@runtime_checkable
class BlockTables(Protocol):
    """A cache of a ``BlockPool`` that shows where its rows lie."""

    @property
    def block_tables(self) -> list[list[int]]:
        """Per batch row, the ids of the pool blocks it reads, oldest first."""
        ...


@runtime_checkable
class PrefixCaching(Protocol):
    """A ``BlockPool`` that shares blocks by content (contract, section 9.1): a request's
    caches start holding the longest published prefix of its tokens; its caches take the
    tokens of their rows with ``declare_tokens``. ``with_blocks(n, block_hash=...)`` keys
    blocks by a hash the caller controls."""

    @property
    def blocks_cached(self) -> int:
        """Blocks published for matching, in use or not."""
        ...

    @property
    def blocks_evictable(self) -> int:
        """Published blocks no live cache references (counted in ``blocks_free``)."""
        ...

    def lookup_prefix(
        self, caches: Sequence[LayerCache], tokens: Tensor, *, salt: str | None = None
    ) -> int:
        """Declare ``tokens`` (B, T) to one request's empty caches (one per layer, in layer
        order) and make each hold the longest whole-block prefix published for its layer,
        ``salt`` and first position; return its length."""
        ...


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


def tree_depths(parents: Sequence[int]) -> tuple[int, ...]:
    """Each draft node's depth: 0 for a root, its parent's plus 1 otherwise."""
    depths: list[int] = []
    for parent in parents:
        depths.append(0 if parent < 0 else depths[parent] + 1)
    return tuple(depths)


def capabilities(cache: object) -> set[str]:
    """The optional capabilities ``cache`` offers: it offers one by having the method (but
    ``attend`` on a cache that keeps keys unrotated, whose keys the model rotates as it reads
    them: section 8.4)."""
    names = {name for name, protocol in CAPABILITIES.items() if isinstance(cache, protocol)}
    attending = {"attend", "attend_latent"}
    if shifts_per_row(cache):  # declared, not a method of its own (section 8.4)
        names.add("shift per row")
    return names - attending if keys_stored(cache) == "unrotated" else names


# How a cache keeps keys (section 8.4): rotated at their positions as the model hands them (the
# default), or as they were before RoPE, the model rotating what the cache returns.
KEYS_STORED = ("rotated", "unrotated")


def keys_stored(cache: object) -> str:
    """``cache.keys_stored``, "rotated" where it says nothing."""
    return getattr(cache, "keys_stored", "rotated")


# --- Lossy storage (section 10.1) -------------------------------------------------------


# Float codes a declaration may state (section 10.1): a float8 format by its torch dtype. Its
# error is relative (half an ulp at the scaled number), and it saturates at the format's max.
FLOAT8_CODES = (torch.float8_e4m3fn, torch.float8_e5m2)
# What a group of numbers sharing one scale spans: channels of one token (the default), or
# tokens of one channel (keys per channel, as in KIVI).
GROUPED_ALONG = ("channels", "tokens")


@dataclass(frozen=True)
class Quantized:
    """How a cache stores rows in codes (contract, section 10.1): ``bits`` per number, one
    scale (and, unless ``symmetric``, one zero point) per ``group`` channels of a row (None:
    the whole head_dim of one token), and its ``recent`` most recent rows kept as given,
    never quantized. Declared as ``kv_storage``; a pair declares keys and values apart.

    Beside them (section 10.1, float codes, groups along tokens, a floor): ``codes`` a
    float8 dtype (``FLOAT8_CODES``) for float codes (8 bits, symmetric), their scale per group
    or one fixed ``scale`` per tensor; ``along="tokens"`` for a scale per channel over each
    ``group`` tokens (the first ``group`` rows since the reset, the next ...); ``min_step``
    the least step integer codes take (HQQ's floor). Left at their defaults, a declaration
    means what it always did."""

    bits: int
    group: int | None = None
    symmetric: bool = False
    recent: int = 0
    codes: torch.dtype | None = None
    along: str = "channels"
    scale: float | None = None
    min_step: float = 0.0

    def __post_init__(self) -> None:
        if not is_count(self.bits) or not 2 <= self.bits <= 8:
            raise ValueError(f"Quantized: bits must be an int from 2 to 8, got {self.bits!r}")
        if self.group is not None and (not is_count(self.group) or self.group < 1):
            raise ValueError(f"Quantized: group must be None or an int >= 1, got {self.group!r}")
        if not is_count(self.recent):
            raise ValueError(f"Quantized: recent must be an int >= 0, got {self.recent!r}")
        self._check_codes()
        self._check_along()
        self._check_scale()
        self._check_min_step()

    def _check_codes(self) -> None:
        if self.codes is None:
            return
        if self.codes not in FLOAT8_CODES:
            raise ValueError(
                f"Quantized: codes must be None (integers) or one of {FLOAT8_CODES}, got "
                f"{self.codes!r}"
            )
        if self.bits != 8 or not self.symmetric:
            raise ValueError(
                f"Quantized: {self.codes} codes are 8 bits scaled by absmax, with no zero point "
                f"(the code carries its sign): declare bits=8, symmetric=True; got "
                f"bits={self.bits!r}, symmetric={self.symmetric!r}"
            )

    def _check_along(self) -> None:
        if self.along not in GROUPED_ALONG:
            raise ValueError(f"Quantized: along must be one of {GROUPED_ALONG}, got {self.along!r}")
        if self.along == "tokens" and self.group is None:
            raise ValueError(
                "Quantized: along='tokens' shares a scale per channel over `group` tokens: "
                "declare group as that number of tokens (an int >= 1), not None"
            )

    def _check_scale(self) -> None:
        if self.scale is None:
            return
        if (
            isinstance(self.scale, bool)
            or not isinstance(self.scale, (int, float))
            or not math.isfinite(self.scale)
            or self.scale <= 0
        ):
            raise ValueError(f"Quantized: scale must be a finite float > 0, got {self.scale!r}")
        if self.codes is None or self.group is not None:
            raise ValueError(
                f"Quantized: a fixed scale ({self.scale!r}) is one per tensor, for float8 codes "
                f"(a calibrated k_scale or v_scale): declare codes= a float8 dtype and "
                f"group=None; got codes={self.codes!r}, group={self.group!r}"
            )

    def _check_min_step(self) -> None:
        step = self.min_step
        if (
            isinstance(step, bool)
            or not isinstance(step, (int, float))
            or not math.isfinite(step)
            or step < 0
        ):
            raise ValueError(f"Quantized: min_step must be a finite float >= 0, got {step!r}")
        if step and self.codes is not None:
            raise ValueError(
                f"Quantized: min_step ({step!r}) floors the step of integer codes; {self.codes} "
                f"codes have no uniform step"
            )

    def describe(self) -> str:
        if self.along == "tokens":
            grouping = f"per channel over groups of {self.group} tokens"
        elif self.scale is not None:
            grouping = f"with one fixed scale {self.scale:g}"
        else:
            grouping = "per token" if self.group is None else f"per group of {self.group}"
        kind = "symmetric" if self.symmetric else "with zero point"
        name = f"int{self.bits}" if self.codes is None else str(self.codes).removeprefix("torch.")
        floor = f", step at least {self.min_step:g}" if self.min_step else ""
        recent = f", the last {self.recent} rows as given" if self.recent else ""
        return f"{name} {grouping}, {kind}{floor}{recent}"

    @property
    def relative_step(self) -> float:
        """A step of the codes as a share of its group's largest magnitude, at most (a float
        code's: its ulp at the group's magnitude; the floor counted as a share of 1, as the
        budget counts magnitudes of at least 1)."""
        if self.codes is not None:
            return torch.finfo(self.codes).eps
        step = 2 / (2**self.bits - 2) if self.symmetric else 2 / (2**self.bits - 1)
        return max(step, self.min_step)

    def group_size(self, width: int) -> int:
        """The numbers of one row that share a scale in a row ``width`` wide (the last group
        may have fewer); along tokens, one."""
        if self.along == "tokens":
            return 1
        return width if self.group is None else min(self.group, width)

    def coded_rows(self, length: int) -> int:
        """How many of the first rows may be in codes once ``length`` were given since the
        reset: all but the recent run; along tokens, only whole groups of them."""
        settled = max(0, length - self.recent)
        return settled if self.along == "channels" else settled - settled % self.group

    def allowed_error(self, given: Tensor, dtype: torch.dtype) -> Tensor:
        """How far each number of ``given`` (rows (..., D); along tokens (..., T, D), the T
        rows given since the reset from the first) may come back, in float64: half the step of
        its group's codes (a float code's: half its ulp at the number, or what saturation
        takes), plus ``QUANTIZED_ROUNDINGS`` roundings of ``dtype`` over the group's magnitude
        and range (the scale, the zero point, the product, the sum, each held in a float). A
        nan or inf given allows anything (nothing to bound)."""
        rows = given.double()
        if self.along == "tokens":  # the same computation, a channel's tokens as its row
            return self._allowed_in_groups(rows.transpose(-1, -2), self.group, dtype).transpose(
                -1, -2
            )
        return self._allowed_in_groups(rows, self.group_size(rows.shape[-1]), dtype)

    def _allowed_in_groups(self, rows: Tensor, size: int, dtype: torch.dtype) -> Tensor:
        width = rows.shape[-1]
        groups = -(-width // size)
        padded = torch.nn.functional.pad(rows, (0, groups * size - width))
        grouped = padded.unflatten(-1, (groups, size))
        pad = torch.arange(groups * size, device=rows.device).unflatten(0, (groups, size)) >= width
        finite = (grouped.isfinite() | pad).all(-1)
        top = grouped.masked_fill(pad, -torch.inf).amax(-1)
        bottom = grouped.masked_fill(pad, torch.inf).amin(-1)
        magnitude = torch.maximum(top.abs(), bottom.abs())
        unit = torch.finfo(dtype).eps / 2
        roundings = QUANTIZED_ROUNDINGS * unit * (magnitude + (top - bottom))
        if self.codes is not None:
            per_number = self._float_code_error(grouped, magnitude) + roundings[..., None]
            allowed = per_number.masked_fill(~finite[..., None], torch.inf).flatten(-2)
            return allowed[..., :width]
        if self.symmetric:
            step = 2 * magnitude / (2**self.bits - 2)
        else:
            step = (top - bottom) / (2**self.bits - 1)
        allowed = step.clamp_min(self.min_step) / 2 + roundings
        allowed = allowed.masked_fill(~finite, torch.inf)
        return allowed.repeat_interleave(size, dim=-1)[..., :width]

    def _float_code_error(self, grouped: Tensor, magnitude: Tensor) -> Tensor:
        """Per number of ``grouped`` (..., groups, size): half the float8 ulp at it once
        scaled (a subnormal's below the smallest normal), and beyond the format's max, what
        the clamp to it takes."""
        finfo = torch.finfo(self.codes)
        if self.scale is None:
            scale = (magnitude / finfo.max)[..., None]
        else:
            scale = torch.full_like(magnitude, self.scale)[..., None]
        size = grouped.abs()
        half_ulp = torch.maximum(size, scale * finfo.smallest_normal) * (finfo.eps / 2)
        saturated = (size - scale * finfo.max).clamp_min(0)
        return torch.maximum(half_ulp, saturated)

    def nbytes(self, rows: int, width: int) -> int:
        """The least one of keys or values quantized can reserve per (batch row, kv head)
        for ``rows`` quantized rows of ``width`` numbers: the codes, packed (a float8 code a
        byte), and one scale per group (and a zero point) in the smallest float, 2 bytes
        (along tokens, one per channel per whole group of rows; a fixed scale, none)."""
        per_group = 2 if self.symmetric else 4
        codes = rows * -(-width * self.bits // 8)
        if self.scale is not None:
            return codes
        if self.along == "tokens":
            return codes + (rows // self.group) * width * per_group
        groups = -(-width // self.group_size(width))
        return codes + rows * groups * per_group


# Roundings of the storage dtype a dequantized number may carry beyond half a step: the
# scale's, the zero point's, the product's and the sum's (a scale held in bfloat16 rounds
# by that dtype's unit).
QUANTIZED_ROUNDINGS = 4


def storage(cache: object) -> tuple[Quantized | None, Quantized | None]:
    """``cache.kv_storage`` as (keys, values): None for a cache that stores rows as given."""
    declared = getattr(cache, "kv_storage", None)
    if declared is None or isinstance(declared, Quantized):
        return declared, declared
    if (
        isinstance(declared, tuple)
        and len(declared) == 2
        and all(part is None or isinstance(part, Quantized) for part in declared)
    ):
        return declared
    raise CacheContractError(
        f"kv_storage must be a kvref.Quantized, a (keys, values) pair of them (or None), "
        f"got {declared!r}"
    )
