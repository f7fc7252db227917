"""Chunks of 4 rows from a process-wide pool (torch.empty, recycled when a cache dies or
resets, so recycled chunks hold other caches' stale rows). A cache reserves
ceil(max_length/4) chunks up front, arranged as a ring whose start moves on each reset.
Overflow refused with a terse count message. Returns a view when one chunk suffices."""

import math
import weakref

import torch
from torch import Tensor

CHUNK = 4
_POOL: dict[tuple, list[tuple[Tensor, Tensor]]] = {}


def _take(key, shape, dtype, device):
    free = _POOL.setdefault(key, [])
    if free:
        return free.pop()
    return (
        torch.empty(shape, dtype=dtype, device=device),
        torch.empty(shape, dtype=dtype, device=device),
    )


def _give_back(key, chunks):
    _POOL.setdefault(key, []).extend(chunks)


class RingCache:
    def __init__(self, spec):
        self.b, self.h, self.d = spec.batch, spec.kv_heads, spec.head_dim
        self.dtype, self.device = spec.dtype, torch.device(spec.device)
        n = math.ceil(spec.max_length / CHUNK)
        self.cap = n * CHUNK
        key = (self.b, self.h, self.d, self.dtype, str(self.device))
        shape = (self.b, self.h, CHUNK, self.d)
        self.ring = [_take(key, shape, self.dtype, self.device) for _ in range(n)]
        weakref.finalize(self, _give_back, key, list(self.ring))
        self.start = 0
        self.n = 0

    @property
    def length(self):
        return self.n

    @property
    def nbytes(self):
        return sum(k.nbytes + v.nbytes for k, v in self.ring)

    def reset(self):
        self.start = (self.start + 1) % len(self.ring)
        self.n = 0

    def _chunk(self, i):
        return self.ring[(self.start + i) % len(self.ring)]

    def append(self, key, value):
        if not isinstance(key, Tensor) or not isinstance(value, Tensor):
            raise ValueError(f"need tensors, got {type(key).__name__}, {type(value).__name__}")
        if key.dim() != 4 or value.dim() != 4:
            raise ValueError(f"want 4 axes: key {key.dim()}, value {value.dim()}")
        if key.shape != value.shape:
            raise ValueError(f"key {list(key.shape)} vs value {list(value.shape)}")
        b, h, t, d = key.shape
        if (b, h, d) != (self.b, self.h, self.d):
            raise ValueError(f"got B,H,D = {b},{h},{d}; built for {self.b},{self.h},{self.d}")
        if key.dtype != self.dtype or value.dtype != self.dtype:
            raise ValueError(f"dtype {key.dtype}/{value.dtype}, built for {self.dtype}")
        if key.device.type != self.device.type or value.device.type != self.device.type:
            raise ValueError(f"device {key.device}, built for {self.device}")
        if t == 0:
            raise ValueError("T=0")
        if self.n + t > self.cap:
            raise ValueError(f"{self.n}+{t} > {self.cap}")
        done = 0
        while done < t:
            i, off = divmod(self.n + done, CHUNK)
            k, v = self._chunk(i)
            m = min(CHUNK - off, t - done)
            k[:, :, off : off + m] = key[:, :, done : done + m]
            v[:, :, off : off + m] = value[:, :, done : done + m]
            done += m
        self.n += t
        used = math.ceil(self.n / CHUNK)
        if used == 1:
            k, v = self._chunk(0)
            return k[:, :, : self.n], v[:, :, : self.n]
        ks = torch.cat([self._chunk(i)[0] for i in range(used)], dim=2)[:, :, : self.n]
        vs = torch.cat([self._chunk(i)[1] for i in range(used)], dim=2)[:, :, : self.n]
        return ks, vs
