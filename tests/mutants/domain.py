"""Mutants of caches that declare a domain (docs/contract.md, section 7, "Support").

Each is a preallocated cache shaped like one backed by a fused kernel: it refuses, at
construction, every spec outside the domain it declares (as it may), and has one bug inside
it. The kit must draw inside the domain to reach any of them, and hit its edges (the largest
batch, the largest max_length) to reach two of them. ``DOMAIN_MUTANTS`` are found out by a
property; ``REFUSING_MUTANTS`` refuse valid input inside their own domain, which the verdict
reports as a crash (``tests/test_domain.py``), the declaration blamed where the refusal is
the factory's.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from kvimpl import PreallocatedCache
from kvimpl.latent import LatentCache
from kvref import CacheSpec

HALF = ("float16", "bfloat16")


class KernelShaped(PreallocatedCache):
    """A correct cache for half precision and head widths 64 and 128 only."""

    kv_sizes: ClassVar[dict] = {"supports": {"dtypes": HALF, "head_dims": (64, 128)}}
    builds: ClassVar[dict] = kv_sizes[
        "supports"
    ]  # what the constructor takes: what it declares, unless a bug

    def __init__(self, spec: CacheSpec) -> None:
        builds = self.builds
        dtype = str(spec.dtype).removeprefix("torch.")
        if dtype not in builds["dtypes"] or spec.head_dim not in builds["head_dims"]:
            raise ValueError(
                f"this kernel takes dtypes {builds['dtypes']} and head_dim "
                f"{builds['head_dims']}; got {dtype}, head_dim {spec.head_dim}"
            )
        if spec.batch > builds.get("max_batch", spec.batch):
            raise ValueError(f"batch {spec.batch} past the largest, {builds['max_batch']}")
        if spec.max_length > builds.get("max_length", spec.max_length):
            raise ValueError(f"max_length {spec.max_length} past {builds['max_length']}")
        super().__init__(spec)


class WideHeadsHalfTile(KernelShaped):
    """At head_dim 128 the value copy moves one 64-channel tile: channels 64 to 127 of every
    value stay zero (a tile loop bound taken from the narrower kernel).

    Inside the domain, so the kit must build specs there to see it."""

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        if self.spec.head_dim == 128:
            value = torch.cat((value[..., :64], torch.zeros_like(value[..., 64:])), dim=-1)
        return super().append(key, value)


class LastRowAtLargestBatch(KernelShaped):
    """At its largest batch (4), the last row's keys are written over the row before it: a
    launch grid of batch // 2 blocks of two rows, right only below the largest batch.

    Only at the domain's edge: the kit must draw batches of exactly 4."""

    kv_sizes: ClassVar[dict] = {
        "supports": {"dtypes": HALF, "head_dims": (64, 128), "max_batch": 4}
    }
    builds: ClassVar[dict] = kv_sizes["supports"]

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        if self.spec.batch == 4:
            key = key.clone()
            key[-1] = key[-2]
        return super().append(key, value)


class LastRowAtLargestMaxLength(KernelShaped):
    """Built for its largest max_length (512), the buffer's last row is the kernel's scratch
    row: the key written there is zeroed before it is returned.

    Only at the domain's edge: the kit must fill a cache built for max_length 512 to its end."""

    kv_sizes: ClassVar[dict] = {
        "supports": {"dtypes": HALF, "head_dims": (64, 128), "max_length": 512}
    }
    builds: ClassVar[dict] = kv_sizes["supports"]

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        keys, values = super().append(key, value)
        if self.spec.max_length == 512 and self.length == 512:
            self.key[:, :, 511] = 0
        return keys, values


class DeclaresHeadDim256(KernelShaped):
    """Declares head widths 64, 128 and 256, but its constructor takes 64 and 128 only: a
    declaration wider than what the cache supports.

    The kit builds it at 256, inside the declared domain, and must blame the declaration."""

    kv_sizes: ClassVar[dict] = {"supports": {"dtypes": HALF, "head_dims": (64, 128, 256)}}
    builds: ClassVar[dict] = {"dtypes": HALF, "head_dims": (64, 128)}


class RefusesLongChunks(KernelShaped):
    """Refuses an append of more than 64 rows at once (a kernel's chunk limit it never
    declared): valid input inside its domain, refused.

    A crash: the kit reports it as one, never as "not supported"."""

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        if key.shape[2] > 64:
            raise ValueError(f"chunks of at most 64 rows, got {key.shape[2]}")
        return super().append(key, value)


class LatentTileOf256(LatentCache):
    """A latent (MLA) cache built for DeepSeek's widths alone (latents 512 wide, rope keys 64,
    contract 10.2), refusing any other latent layer, whose latent copy moves 256 channels:
    channels 256 to 511 of every latent stay zero.

    Stands for a FlashMLA-shaped kernel whose tile loop bound was taken from a narrower
    build: it is wrong at the one width it takes, so the kit must draw that width (and no
    other latent width, which it refuses) to see it."""

    kv_sizes: ClassVar[dict] = {
        "supports": {"latent": True, "latent_dims": (512,), "rope_dims": (64,)}
    }

    def __init__(self, spec: CacheSpec) -> None:
        if spec.value_dim is not None and (spec.value_dim, spec.head_dim) != (512, 64):
            raise ValueError(
                f"this kernel takes latents 512 wide beside rope keys 64 wide; got value_dim "
                f"{spec.value_dim}, head_dim {spec.head_dim}"
            )
        super().__init__(spec)

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        if value.shape[-1] == 512:
            value = torch.cat((value[..., :256], torch.zeros_like(value[..., 256:])), dim=-1)
        return super().append(key, value)

    def attend_latent(self, query: Tensor, key: Tensor, value: Tensor, scale: float) -> Tensor:
        value = torch.cat((value[..., :256], torch.zeros_like(value[..., 256:])), dim=-1)
        return super().attend_latent(query, key, value, scale)


DOMAIN_MUTANTS = (
    WideHeadsHalfTile,
    LastRowAtLargestBatch,
    LastRowAtLargestMaxLength,
    DeclaresHeadDim256,
    LatentTileOf256,
)
REFUSING_MUTANTS = (RefusesLongChunks,)
