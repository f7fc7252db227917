"""Style: a 4-bit, symmetric, group-wise quantized cache kept as Python lists of per-token chunks.

Written independently of ``kvimpl/quantized.py`` and in another style: nothing is preallocated;
every token that leaves the full-precision window of the last ``RECENT`` rows becomes one chunk
of its own (its codes, two per byte, and one absmax scale per group of ``GROUP`` channels of
head_dim, the last group possibly partial), and the recent rows are a list of per-token copies
as given. Codes are round(x / scale) clamped to [-7, 7], scale = absmax / 7, held as nibbles
offset by 8. A row stays in codes once quantized (a truncate keeps it so). Offers truncate and
reorder (codes, scales and the recent rows all move). Its checks of bad input are its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvref.protocol import CacheSpec
from kvref.quantized import Quantized

BITS = 4
TOP_CODE = 2 ** (BITS - 1) - 1  # 7: codes run from -7 to 7
OFFSET = 8  # a code c is held as the nibble c + 8 (1 .. 15)
GROUP = 32
RECENT = 8


@dataclass
class _Coded:
    """One token's keys or values in codes: ``packed`` (B, H, ceil(D / 2)) uint8, two nibbles a
    byte (channel 2i in the low one), and ``scales`` (B, H, groups) in the wide float."""

    packed: Tensor
    scales: Tensor

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales.nbytes

    def take(self, indices: Tensor) -> _Coded:
        return _Coded(self.packed.index_select(0, indices), self.scales.index_select(0, indices))


class GroupInt4Cache:
    def __init__(self, spec: CacheSpec) -> None:
        self.spec = spec
        self.group = min(GROUP, spec.head_dim)
        self.kv_storage = Quantized(bits=BITS, group=self.group, symmetric=True, recent=RECENT)
        self._wide = torch.float64 if spec.dtype == torch.float64 else torch.float32
        self._groups = -(-spec.head_dim // self.group)
        self.reset()

    # --- state ----------------------------------------------------------------------------
    def reset(self) -> None:
        # Oldest first. ``_old[i]`` is token i as (keys, values) in codes; ``_new[j]`` is token
        # len(_old) + j as (keys, values) (B, H, D) copies of what was given.
        self._old: list[tuple[_Coded, _Coded]] = []
        self._new: list[tuple[Tensor, Tensor]] = []

    @property
    def length(self) -> int:
        return len(self._old) + len(self._new)

    @property
    def nbytes(self) -> int:
        coded = sum(k.nbytes + v.nbytes for k, v in self._old)
        exact = sum(k.nbytes + v.nbytes for k, v in self._new)
        return int(coded + exact)

    # --- the protocol ---------------------------------------------------------------------
    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        tokens = self._admit(key, value)
        for t in range(tokens):
            self._new.append((key[:, :, t].clone(), value[:, :, t].clone()))
        leaving = len(self._new) - RECENT
        if leaving > 0:
            rows, self._new = self._new[:leaving], self._new[leaving:]
            keys = self._encode(torch.stack([k for k, _ in rows], dim=2))
            values = self._encode(torch.stack([v for _, v in rows], dim=2))
            self._old.extend(zip(keys, values, strict=True))
        return self._rows(0), self._rows(1)

    def truncate(self, length: int) -> None:
        if isinstance(length, bool) or not isinstance(length, int):
            raise TypeError(f"truncate wants an int length, not {type(length).__name__}")
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate to length {length}: it holds {self.length} tokens")
        coded = len(self._old)
        if length <= coded:
            del self._old[length:]
            self._new = []
        else:
            del self._new[length - coded :]

    def reorder(self, indices: Tensor) -> None:
        batch = self.spec.batch
        if not isinstance(indices, Tensor):
            raise TypeError(f"reorder indices must be a tensor, not {type(indices).__name__}")
        if indices.dtype != torch.int64 or indices.shape != (batch,):
            raise ValueError(
                f"reorder indices must be int64 of shape ({batch},), got {indices.dtype} "
                f"{tuple(indices.shape)}"
            )
        if indices.device != torch.device(self.spec.device):
            raise ValueError(f"reorder indices are on {indices.device}, not {self.spec.device}")
        if bool(((indices < 0) | (indices >= batch)).any()):
            raise ValueError(f"reorder indices {indices.tolist()} out of range for batch {batch}")
        self._old = [(k.take(indices), v.take(indices)) for k, v in self._old]
        self._new = [(k.index_select(0, indices), v.index_select(0, indices)) for k, v in self._new]

    def _admit(self, key: Tensor, value: Tensor) -> int:
        """The number of new tokens, once key and value are found fit to keep."""
        s = self.spec
        for what, rows in (("key", key), ("value", value)):
            if not isinstance(rows, Tensor):
                raise TypeError(f"{what} should be a torch.Tensor, got {type(rows).__name__}")
            if rows.dtype != s.dtype:
                raise ValueError(f"{what} dtype {rows.dtype} does not match the cache's {s.dtype}")
            if rows.device != torch.device(s.device):
                raise ValueError(f"{what} lives on {rows.device}; this cache is on {s.device}")
            wanted = (s.batch, s.kv_heads, s.head_dim)
            if rows.ndim != 4 or (rows.shape[0], rows.shape[1], rows.shape[3]) != wanted:
                raise ValueError(
                    f"{what} has shape {tuple(rows.shape)}; expected (batch, kv_heads, tokens, "
                    f"head_dim) with (batch, kv_heads, head_dim) = {wanted}"
                )
        if key.shape != value.shape:
            raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} differ")
        tokens = key.shape[2]
        if tokens == 0:
            raise ValueError("nothing to append: key and value hold 0 tokens")
        if self.length + tokens > s.max_length:
            raise ValueError(
                f"overflow: {self.length} tokens held + {tokens} new > max_length {s.max_length}"
            )
        return tokens

    # --- codes ----------------------------------------------------------------------------
    def _encode(self, rows: Tensor) -> list[_Coded]:
        """(B, H, n, D) rows as n per-token chunks of codes."""
        s = self.spec
        wide = rows.to(self._wide)
        padded_width = self._groups * self.group
        # Zeros pad the last group: |0| never raises a group's absmax, so padding cannot change a
        # scale; the padded channels' codes are dropped on decoding.
        wide = torch.nn.functional.pad(wide, (0, padded_width - s.head_dim))
        grouped = wide.unflatten(-1, (self._groups, self.group))
        absmax = grouped.abs().amax(-1, keepdim=True)
        scale = absmax / TOP_CODE
        # A group of zeros: any scale will do (every code is 0); nan and inf stay as they are.
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        codes = (grouped / scale).round().clamp(-TOP_CODE, TOP_CODE).nan_to_num(0.0)
        nibbles = (codes.to(torch.int16) + OFFSET).flatten(-2)[..., : s.head_dim]
        if s.head_dim % 2:  # an odd head_dim: one nibble of code 0 fills the last byte
            nibbles = torch.nn.functional.pad(nibbles, (0, 1), value=OFFSET)
        low, high = nibbles[..., 0::2], nibbles[..., 1::2]
        packed = (low | (high << 4)).to(torch.uint8)
        scales = scale.squeeze(-1)
        return [
            _Coded(packed[:, :, t].clone(), scales[:, :, t].clone()) for t in range(rows.shape[2])
        ]

    def _decode(self, packed: Tensor, scales: Tensor) -> Tensor:
        """(B, H, n, ceil(D / 2)) bytes and (B, H, n, groups) scales as (B, H, n, D) rows."""
        s = self.spec
        as_int = packed.to(torch.int16)
        nibbles = torch.stack((as_int & 0x0F, as_int >> 4), dim=-1).flatten(-2)
        codes = (nibbles[..., : s.head_dim] - OFFSET).to(self._wide)
        padded_width = self._groups * self.group
        codes = torch.nn.functional.pad(codes, (0, padded_width - s.head_dim))
        codes = codes.unflatten(-1, (self._groups, self.group))
        rows = (codes * scales.unsqueeze(-1)).flatten(-2)[..., : s.head_dim]
        return rows.to(s.dtype)

    def _rows(self, part: int) -> Tensor:
        """Every token held, keys (0) or values (1): the coded ones decoded, then the recent."""
        s = self.spec
        pieces = []
        if self._old:
            chunks = [pair[part] for pair in self._old]
            packed = torch.stack([c.packed for c in chunks], dim=2)
            scales = torch.stack([c.scales for c in chunks], dim=2)
            pieces.append(self._decode(packed, scales))
        if self._new:
            pieces.append(torch.stack([pair[part] for pair in self._new], dim=2))
        if not pieces:
            return torch.empty(
                s.batch, s.kv_heads, 0, s.head_dim, dtype=s.dtype, device=torch.device(s.device)
            )
        return torch.cat(pieces, dim=2)
