"""A latent (MLA) cache kept in pages, after vLLM's paged MLA cache (contract, section 10.2).

Deliberately unlike ``kvimpl/latent.py`` (one preallocated buffer, latent and rope key side by
side in each row): storage is a Python list of fixed pages of 8 tokens, taken one at a time as
tokens arrive. Rope keys and latents live in pages of their own, laid out token-major,
(8, batch, kv_heads, width), as a paged engine's block of slots is; ``append`` gathers the pages
with ``torch.cat`` and returns (batch, kv_heads, length, width) views of that gather. Every
check is written out here, in this cache's own words; it refuses T = 0 and refuses to go past
``max_length``. A window is accepted and ignored: the model masks what lies outside it.
"""

from __future__ import annotations

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

    # --- internals ---------------------------------------------------------------------

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
