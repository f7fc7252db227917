"""A latent (MLA) cache kept in pages, after vLLM's paged MLA cache (contract, section 10.2).

Deliberately unlike ``kvimpl/latent.py`` (one preallocated buffer, latent and rope key side by
side in each row): storage is a Python list of fixed pages of 8 tokens, taken one at a time as
tokens arrive. Rope keys and latents live in pages of their own, laid out token-major,
(8, batch, kv_heads, width), as a paged engine's block of slots is; ``append`` gathers the pages
with ``torch.cat`` and returns (batch, kv_heads, length, width) views of that gather. Every
check is written out here, in this cache's own words; it refuses T = 0 and refuses to go past
``max_length``. A window is accepted and ignored by ``append``: the model masks what lies
outside it.

It computes attention too, page by page as a split-KV decode kernel does: ``attend`` over
the rope-key and latent pages of an ordinary spec, ``attend_latent`` (MLA's absorbed path,
section 10.2) over each page's latent and rope key joined, with a running maximum and sum
carried from page to page in float64 (an online softmax), masking each slot by its position:
causal, the window, and the sinks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import ClassVar

import torch
from torch import Tensor

from kvref.protocol import CacheSpec

SLOTS = 8  # tokens per page


def _on_device(got: torch.device, want: torch.device) -> bool:
    """Whether ``got`` is the device ``want`` names ("cuda" names "cuda:0" as well)."""
    if got.type != want.type:
        return False
    return got.index is None or want.index is None or got.index == want.index


class PagedLatentCache:
    kv_sizes: ClassVar[dict] = {"supports": {"latent": True}}

    def __init__(self, spec: CacheSpec) -> None:
        self.spec = spec
        self._device = torch.device(spec.device)
        self._key_pages: list[Tensor] = []
        self._value_pages: list[Tensor] = []
        self._count = 0

    # --- the four members --------------------------------------------------------------

    @property
    def length(self) -> int:
        return self._count

    @property
    def nbytes(self) -> int:
        return sum(page.nbytes for page in self._key_pages) + sum(
            page.nbytes for page in self._value_pages
        )

    def reset(self) -> None:
        # Forget every page: a later append takes fresh zeroed ones.
        self._key_pages = []
        self._value_pages = []
        self._count = 0

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        tokens = self._admit(key, value)
        # Token-major views of the input: (T, batch, kv_heads, width).
        key_rows = key.permute(2, 0, 1, 3)
        value_rows = value.permute(2, 0, 1, 3)
        done = 0
        while done < tokens:
            page, slot = divmod(self._count + done, SLOTS)
            if page == len(self._key_pages):
                self._key_pages.append(self._blank(self.spec.head_dim))
                self._value_pages.append(self._blank(self.spec.value_width))
            take = min(SLOTS - slot, tokens - done)
            self._key_pages[page][slot : slot + take] = key_rows[done : done + take]
            self._value_pages[page][slot : slot + take] = value_rows[done : done + take]
            done += take
        self._count += tokens
        return self._gather()

    # --- optional capabilities ---------------------------------------------------------

    def truncate(self, length: int) -> None:
        if isinstance(length, bool) or not isinstance(length, int):
            raise TypeError(f"truncate wants an int length, got {type(length).__name__} {length!r}")
        if not 0 <= length <= self._count:
            raise ValueError(
                f"truncate length {length} is out of range: this cache holds {self._count} "
                f"tokens, so it must lie in 0..{self._count}"
            )
        pages = -(-length // SLOTS)
        del self._key_pages[pages:]
        del self._value_pages[pages:]
        slot = length % SLOTS
        if slot:  # blank the forgotten slots of the last page kept
            self._key_pages[-1][slot:] = 0
            self._value_pages[-1][slot:] = 0
        self._count = length

    def reorder(self, indices: Tensor) -> None:
        batch = self.spec.batch
        if not isinstance(indices, Tensor):
            raise TypeError(f"reorder wants a tensor of indices, got {type(indices).__name__}")
        if indices.dtype != torch.int64:
            raise ValueError(f"reorder indices must be torch.int64, got dtype {indices.dtype}")
        if tuple(indices.shape) != (batch,):
            raise ValueError(
                f"reorder indices must have shape ({batch},), one per batch row, "
                f"got {tuple(indices.shape)}"
            )
        if not _on_device(indices.device, self._device):
            raise ValueError(
                f"reorder indices are on device {indices.device}, this cache is on {self._device}"
            )
        if batch and (int(indices.min()) < 0 or int(indices.max()) >= batch):
            raise ValueError(
                f"reorder indices {indices.tolist()} out of range: each must be in [0, {batch})"
            )
        # Batch is axis 1 of a token-major page; index_select makes new pages.
        self._key_pages = [page.index_select(1, indices) for page in self._key_pages]
        self._value_pages = [page.index_select(1, indices) for page in self._value_pages]

    def fork(self) -> PagedLatentCache:
        twin = PagedLatentCache(self.spec)
        twin._key_pages = [page.clone() for page in self._key_pages]
        twin._value_pages = [page.clone() for page in self._value_pages]
        twin._count = self._count
        return twin

    def attend(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        self._admit_query(query, key, self.spec.head_dim, "attend")
        start = self._count
        self.append(key, value)
        scale = 1 / math.sqrt(self.spec.head_dim)
        return self._over_pages(query, start, scale, lambda page: self._key_pages[page])

    def attend_latent(self, query: Tensor, key: Tensor, value: Tensor, scale: float) -> Tensor:
        width = self.spec.value_width + self.spec.head_dim
        self._admit_query(query, key, width, "attend_latent")
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not scale > 0:
            raise ValueError(f"attend_latent: the scale should be a positive number, got {scale!r}")
        start = self._count
        self.append(key, value)

        def joined(page: int) -> Tensor:  # the page's latent, then its rope key
            return torch.cat((self._value_pages[page], self._key_pages[page]), dim=-1)

        return self._over_pages(query, start, float(scale), joined)

    # --- internals ---------------------------------------------------------------------

    def _over_pages(
        self, query: Tensor, start: int, scale: float, keys_of: Callable[[int], Tensor]
    ) -> Tensor:
        """Softmax attention of ``query`` (the tokens from ``start``) over every page, its
        values the value pages, merged page by page with a running maximum and sum."""
        batch, heads, tokens, _ = query.shape
        group = heads // self.spec.kv_heads
        q = query.to(torch.float64)
        positions = torch.arange(start, start + tokens, device=self._device)[:, None]
        best = torch.full((batch, heads, tokens, 1), -math.inf, dtype=torch.float64)
        best = best.to(self._device)
        total = torch.zeros_like(best)
        mixed = torch.zeros(batch, heads, tokens, self.spec.value_width, dtype=torch.float64)
        mixed = mixed.to(self._device)
        for page in range(len(self._key_pages)):
            # Token-major (SLOTS, batch, kv_heads, width) to (batch, heads, SLOTS, width).
            keys = keys_of(page).permute(1, 2, 0, 3).to(torch.float64)
            values = self._value_pages[page].permute(1, 2, 0, 3).to(torch.float64)
            keys, values = (t.repeat_interleave(group, dim=1) for t in (keys, values))
            slots = torch.arange(page * SLOTS, (page + 1) * SLOTS, device=self._device)[None, :]
            seen = self._sees(positions, slots) & (slots < self._count)
            scores = (q @ keys.transpose(-2, -1) * scale).masked_fill(~seen, -math.inf)
            new_best = torch.maximum(best, scores.amax(dim=-1, keepdim=True))
            shift = torch.where(torch.isinf(new_best), 0.0, new_best)  # nothing seen yet
            weights = torch.exp(scores - shift)
            carried = torch.exp(best - shift)
            total = total * carried + weights.sum(dim=-1, keepdim=True)
            mixed = mixed * carried + weights @ values
            best = new_best
        return (mixed / total).to(query.dtype)

    def _sees(self, queries: Tensor, keys: Tensor) -> Tensor:
        """Whether the query at each position sees the key at each: causal, within the
        window, or a sink."""
        seen = keys <= queries
        if self.spec.window is not None:
            seen &= (keys > queries - self.spec.window) | (keys < self.spec.sinks)
        return seen

    def _admit_query(self, query: object, key: object, width: int, call: str) -> None:
        """Look at the query before anything is written (the rows are looked at by append)."""
        if not isinstance(query, Tensor):
            raise TypeError(
                f"{call}: the query should be a torch tensor; a {type(query).__name__} came"
            )
        if not isinstance(key, Tensor) or key.dim() != 4:
            self._admit(key, key)  # refuses it, with this cache's own words
        shape = (key.shape[0], query.shape[1] if query.dim() == 4 else 0, key.shape[2], width)
        if query.dim() != 4 or tuple(query.shape) != shape:
            raise ValueError(
                f"{call}: the query should be (batch, heads, T, {width}) matching the key's "
                f"batch and T, shape {list(shape)}; it is {list(query.shape)}"
            )
        if query.shape[1] == 0 or query.shape[1] % self.spec.kv_heads:
            raise ValueError(
                f"{call}: the query has {query.shape[1]} heads, not a multiple of the cache's "
                f"{self.spec.kv_heads} kv heads"
            )
        if query.dtype != key.dtype or query.device != key.device:
            raise ValueError(
                f"{call}: the query is {query.dtype} on {query.device}, the key {key.dtype} on "
                f"{key.device}: they should agree"
            )

    def _blank(self, width: int) -> Tensor:
        s = self.spec
        return torch.zeros(SLOTS, s.batch, s.kv_heads, width, dtype=s.dtype, device=self._device)

    def _gather(self) -> tuple[Tensor, Tensor]:
        keys = torch.cat(self._key_pages, dim=0)[: self._count]
        values = torch.cat(self._value_pages, dim=0)[: self._count]
        return keys.permute(1, 2, 0, 3), values.permute(1, 2, 0, 3)

    def _admit(self, key: object, value: object) -> int:
        """Look at the whole call before anything is written; return the new token count."""
        s = self.spec
        for name, t in (("key", key), ("value", value)):
            if not isinstance(t, Tensor):
                raise TypeError(f"the {name} should be a torch tensor; a {type(t).__name__} came")
        for name, t in (("key", key), ("value", value)):
            if t.dim() != 4:
                raise ValueError(
                    f"the {name} should be 4-D (batch, kv_heads, T, width); it has "
                    f"{t.dim()} dims, shape {list(t.shape)}"
                )
        widths = (
            ("key", key, "head_dim", s.head_dim),
            ("value", value, "width", s.value_width),
        )
        for name, t, label, width in widths:
            b, h, _, d = t.shape
            if b != s.batch:
                raise ValueError(f"{name} batch is {b}, this cache holds batch {s.batch}")
            if h != s.kv_heads:
                raise ValueError(f"{name} has {h} kv_heads, this cache holds {s.kv_heads}")
            if d != width:
                raise ValueError(f"{name} {label} is {d}, this cache holds {label} {width}")
        tokens = key.shape[2]
        if value.shape[2] != tokens:
            raise ValueError(
                f"key brings {tokens} tokens but value brings {value.shape[2]}: token counts differ"
            )
        if tokens == 0:
            raise ValueError("nothing to append: T = 0 tokens; append at least one")
        for name, t in (("key", key), ("value", value)):
            if t.dtype != s.dtype:
                raise ValueError(f"{name} dtype is {t.dtype}; this cache stores only {s.dtype}")
        for name, t in (("key", key), ("value", value)):
            if not _on_device(t.device, self._device):
                raise ValueError(f"{name} device is {t.device}; this cache lives on {self._device}")
        if self._count + tokens > s.max_length:
            raise ValueError(
                f"overflow: {self._count} tokens held plus {tokens} new exceed "
                f"max_length {s.max_length}"
            )
        return tokens
