"""The optional capabilities a layer cache may offer, each declared as a runtime-checkable
protocol: a cache offers one by having the method (``truncate``, ``reorder``, ``fork``,
``attend``, ``attend_latent``, ``shift``, ``append_rows``, ``append_tree``, ``offload``,
``export_rows``); ``capabilities(cache)`` names those it offers, as the kit selects its
properties by them. Beside the declarations, when a window layer may refuse a rollback or a
shift (``may_refuse_truncate``, ``may_refuse_shift``), which the kit needs to tell a lawful
refusal from a bug.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

from torch import Tensor

from kvref.moves import CacheRows
from kvref.protocol import LayerCache, keys_stored


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


def capabilities(cache: object) -> set[str]:
    """The optional capabilities ``cache`` offers: it offers one by having the method (but
    ``attend`` on a cache that keeps keys unrotated, whose keys the model rotates as it reads
    them: section 8.4)."""
    names = {name for name, protocol in CAPABILITIES.items() if isinstance(cache, protocol)}
    attending = {"attend", "attend_latent"}
    if shifts_per_row(cache):  # declared, not a method of its own (section 8.4)
        names.add("shift per row")
    return names - attending if keys_stored(cache) == "unrotated" else names


def shifts_per_row(cache: object) -> bool:
    """Whether ``cache`` declares a shift per row (section 8.4): rows of their own,
    ``shift`` and ``shift_per_row = True``."""
    return (
        getattr(cache, "shift_per_row", False) is True
        and isinstance(cache, RowsOfTheirOwn)
        and isinstance(cache, Shiftable)
    )


def may_refuse_truncate(windows: Iterable[int | None], held: int, target: int) -> bool:
    """Whether a model whose layers have ``windows``, holding ``held`` tokens, may see a
    truncate to ``target`` refused: a window layer must keep only the last W - 1 positions,
    and the next query needs those from target - W + 1."""
    # Some position the next query needs (target - W + 1 .. target - 1) lies before the
    # first one every cache must keep (held - W + 1).
    return any(
        max(0, target - w + 1) < min(target, max(0, held - w + 1)) for w in set(windows) - {None}
    )


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
