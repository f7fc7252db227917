"""Style 17: a dict keyed by global kv head id, each head's rows in fixed-size token-major chunks.

Deliberately different from the built-ins and the other independent caches: nothing is kept
as a (B, H_kv, T, D) tensor. Every kv head is an entry of a ``dict`` keyed by its *global*
head id (``spec.shard.kv_heads`` in a tensor-parallel run, else ``range(spec.kv_heads)``),
and holds its keys and values in lists of chunks of ``CHUNK`` tokens each, laid out token
first, (CHUNK, batch, head_dim), allocated one at a time as the tokens arrive and written in
place with ``copy_``. Local head j of an append is the head ``head_ids[j]``. Each return
and each export is built fresh: the chunks of every head joined, cut to ``length``,
stacked over the heads and permuted back to (B, H_kv, T, D).

- ``nbytes`` is the chunks really allocated, spare tail included: at least the rows held.
- ``window`` is ignored: every row is kept and returned (the model masks).
- No capacity limit: it grows past ``max_length``, and takes an import past it.
- Validation is a list of ``(what, got, wanted, agrees)`` checks run in order, the first
  that disagrees raised as "<call>: <what> is <got>, this cache takes <wanted>"; a
  non-tensor (non-``CacheRows``) argument raises TypeError; T = 0 is refused.
- ``truncate`` drops the chunks wholly past the new length; ``reorder`` re-indexes the
  batch axis of every chunk (a new tensor per chunk).
- ``export_rows``/``import_rows`` (contract, section 11.2): an import goes into an empty
  cache only and must bring every row from position 0 (it keeps every row).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from kvref import CacheRows

CHUNK = 5  # tokens per chunk: odd, so that chunk edges fall everywhere


@dataclass
class _Head:
    """One global kv head: its key and value chunks, (CHUNK, batch, width) each."""

    keys: list[Tensor] = field(default_factory=list)
    values: list[Tensor] = field(default_factory=list)


def _places_agree(got: torch.device, home: torch.device) -> bool:
    return got.type == home.type and home.index in (None, got.index)


def _first_disagreement(call: str, checks) -> None:
    """Raise ValueError for the first ``(what, got, wanted, agrees)`` that does not agree;
    ``got`` and ``agrees`` may be callables, so that they run only once the earlier checks
    held (a range check reads values: not before the device check)."""
    for what, got, wanted, agrees in checks:
        if callable(agrees):
            agrees = agrees()
        if not agrees:
            if callable(got):
                got = got()
            raise ValueError(f"{call}: {what} is {got}, this cache takes {wanted}")


class HeadKeyedCache:
    def __init__(self, spec) -> None:
        self.spec = spec
        self._home = torch.device(spec.device)
        ids = tuple(range(spec.kv_heads)) if spec.shard is None else tuple(spec.shard.kv_heads)
        if len(ids) != spec.kv_heads or len(set(ids)) != len(ids):
            raise ValueError(
                f"HeadKeyedCache: kv head ids {ids} do not name {spec.kv_heads} distinct heads"
            )
        self.head_ids = ids
        self._heads: dict[int, _Head] = {head: _Head() for head in ids}
        self._tokens = 0

    # The four members.

    @property
    def length(self) -> int:
        return self._tokens

    @property
    def nbytes(self) -> int:
        return sum(
            chunk.nbytes for head in self._heads.values() for chunk in (*head.keys, *head.values)
        )

    def reset(self) -> None:
        for head in self._heads.values():
            head.keys.clear()
            head.values.clear()
        self._tokens = 0

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        self._vet_append(key, value)
        self._write(key, value)
        return self._joined()

    # Optional capabilities.

    def truncate(self, length: int) -> None:
        if isinstance(length, bool) or not isinstance(length, int):
            raise TypeError(
                f"truncate: the length must be an int, got {type(length).__name__} {length!r}"
            )
        if not 0 <= length <= self._tokens:
            raise ValueError(
                f"truncate: length {length} is out of range: this cache holds 0..{self._tokens}"
            )
        keep = -(-length // CHUNK)
        for head in self._heads.values():
            del head.keys[keep:]
            del head.values[keep:]
        self._tokens = length

    def reorder(self, indices: Tensor) -> None:
        if not isinstance(indices, Tensor):
            raise TypeError(f"reorder: indices must be a tensor, got {type(indices).__name__}")
        batch = self.spec.batch
        _first_disagreement(
            "reorder",
            [
                ("the indices dtype", indices.dtype, torch.int64, indices.dtype == torch.int64),
                (
                    "the indices shape",
                    tuple(indices.shape),
                    f"({batch},), one index per batch row",
                    tuple(indices.shape) == (batch,),
                ),
                (
                    "the indices device",
                    indices.device,
                    self._home,
                    _places_agree(indices.device, self._home),
                ),
                (
                    "the range of the indices",
                    lambda: indices.tolist(),
                    f"values in [0, {batch})",
                    lambda: bool(((indices >= 0) & (indices < batch)).all()),
                ),
            ],
        )
        for head in self._heads.values():
            head.keys[:] = [chunk.index_select(1, indices) for chunk in head.keys]
            head.values[:] = [chunk.index_select(1, indices) for chunk in head.values]

    def export_rows(self) -> CacheRows:
        keys, values = self._joined()
        return CacheRows(keys, values, self._tokens, None)

    def import_rows(self, rows: CacheRows) -> None:
        if not isinstance(rows, CacheRows):
            raise TypeError(f"import_rows takes a kvref.CacheRows, not a {type(rows).__name__}")
        if self._tokens:
            raise ValueError(
                f"import_rows: this cache already holds {self._tokens} tokens; an import goes "
                "into an empty (new or reset) cache"
            )
        count = rows.length
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"import_rows: the length must be an int >= 0, got {count!r}")
        for name, t in (("keys", rows.keys), ("values", rows.values)):
            if not isinstance(t, Tensor):
                raise TypeError(f"import_rows: {name} must be a tensor, got {type(t).__name__}")
        keys, values = rows.keys, rows.values
        s = self.spec
        _first_disagreement(
            "import_rows",
            [
                ("the rank of keys", keys.ndim, 4, keys.ndim == 4),
                ("the rank of values", values.ndim, 4, values.ndim == 4),
            ],
        )
        _first_disagreement(
            "import_rows",
            [
                ("the keys dtype", keys.dtype, s.dtype, keys.dtype == s.dtype),
                ("the values dtype", values.dtype, s.dtype, values.dtype == s.dtype),
                (
                    "the keys device",
                    keys.device,
                    self._home,
                    _places_agree(keys.device, self._home),
                ),
                (
                    "the values device",
                    values.device,
                    self._home,
                    _places_agree(values.device, self._home),
                ),
                ("the keys batch", keys.shape[0], s.batch, keys.shape[0] == s.batch),
                ("the values batch", values.shape[0], s.batch, values.shape[0] == s.batch),
                ("the keys kv heads", keys.shape[1], s.kv_heads, keys.shape[1] == s.kv_heads),
                (
                    "the values kv heads",
                    values.shape[1],
                    s.kv_heads,
                    values.shape[1] == s.kv_heads,
                ),
                ("the keys head_dim", keys.shape[3], s.head_dim, keys.shape[3] == s.head_dim),
                (
                    "the values width",
                    values.shape[3],
                    s.value_width,
                    values.shape[3] == s.value_width,
                ),
                (
                    "the values' count of rows",
                    values.shape[2],
                    f"the keys' {keys.shape[2]} rows",
                    values.shape[2] == keys.shape[2],
                ),
                (
                    "the count of rows",
                    f"{keys.shape[2]} for a length of {count}",
                    "at most as many rows as the length",
                    keys.shape[2] <= count,
                ),
                (
                    "the count of rows",
                    f"{keys.shape[2]} for a length of {count}",
                    f"all {count} rows from position 0: it keeps every row and needs the last "
                    f"{count}",
                    keys.shape[2] == count,
                ),
            ],
        )
        if count:
            self._write(keys, values)

    # Storage.

    def _write(self, key: Tensor, value: Tensor) -> None:
        """Copy the T rows of ``key`` and ``value`` (checked) into each head's chunks, at
        positions length .. length + T - 1, allocating chunks as they fill."""
        s = self.spec
        new = key.shape[2]
        for local, head_id in enumerate(self.head_ids):
            head = self._heads[head_id]
            k = key.detach()[:, local].transpose(0, 1)  # (T, B, D): token first, as stored
            v = value.detach()[:, local].transpose(0, 1)
            done = 0
            while done < new:
                chunk, offset = divmod(self._tokens + done, CHUNK)
                while len(head.keys) <= chunk:
                    head.keys.append(
                        torch.empty(CHUNK, s.batch, s.head_dim, dtype=s.dtype, device=self._home)
                    )
                    head.values.append(
                        torch.empty(CHUNK, s.batch, s.value_width, dtype=s.dtype, device=self._home)
                    )
                take = min(CHUNK - offset, new - done)
                head.keys[chunk][offset : offset + take].copy_(k[done : done + take])
                head.values[chunk][offset : offset + take].copy_(v[done : done + take])
                done += take
        self._tokens += new

    def _joined(self) -> tuple[Tensor, Tensor]:
        """Every row held, (B, H_kv, length, width), in new tensors."""
        s = self.spec
        if not self._tokens:
            shape = (s.batch, s.kv_heads, 0)
            return (
                torch.empty(*shape, s.head_dim, dtype=s.dtype, device=self._home),
                torch.empty(*shape, s.value_width, dtype=s.dtype, device=self._home),
            )
        n = self._tokens
        per_head = [self._heads[head_id] for head_id in self.head_ids]
        keys = torch.stack([torch.cat(head.keys)[:n] for head in per_head])  # (H, T, B, D)
        values = torch.stack([torch.cat(head.values)[:n] for head in per_head])
        return keys.permute(2, 0, 1, 3).contiguous(), values.permute(2, 0, 1, 3).contiguous()

    # Validation.

    def _vet_append(self, key: object, value: object) -> None:
        for name, t in (("key", key), ("value", value)):
            if not isinstance(t, Tensor):
                raise TypeError(f"append: {name} is a {type(t).__name__}, not a torch.Tensor")
        s = self.spec
        pair = (("key", key, s.head_dim), ("value", value, s.value_width))
        _first_disagreement(
            "append",
            [
                (f"the {name} rank", f"{t.ndim} (shape {tuple(t.shape)})", 4, t.ndim == 4)
                for name, t, _ in pair
            ],
        )
        checks = []
        for name, t, width in pair:
            checks += [
                (f"the {name} dtype", t.dtype, s.dtype, t.dtype == s.dtype),
                (f"the {name} device", t.device, self._home, _places_agree(t.device, self._home)),
                (f"the {name} batch", t.shape[0], s.batch, t.shape[0] == s.batch),
                (f"the {name} kv heads", t.shape[1], s.kv_heads, t.shape[1] == s.kv_heads),
                (f"the {name} head_dim", t.shape[3], width, t.shape[3] == width),
            ]
        checks += [
            (
                "the value's token count",
                value.shape[2],
                f"the key's {key.shape[2]} tokens (they must match)",
                value.shape[2] == key.shape[2],
            ),
            ("the number of new tokens", key.shape[2], "at least one (not zero)", key.shape[2] > 0),
        ]
        _first_disagreement("append", checks)
