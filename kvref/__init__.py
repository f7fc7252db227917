"""The reference transformer and the public key/value cache protocol."""

from kvref.model import ModelConfig, ReferenceTransformer
from kvref.protocol import (
    CacheContractError,
    CacheFactory,
    CacheSpec,
    LayerCache,
    Reorderable,
    Truncatable,
    capabilities,
    check_append,
    check_reorder,
    check_truncate,
    min_nbytes,
)

__all__ = [
    "CacheContractError",
    "CacheFactory",
    "CacheSpec",
    "LayerCache",
    "ModelConfig",
    "ReferenceTransformer",
    "Reorderable",
    "Truncatable",
    "capabilities",
    "check_append",
    "check_reorder",
    "check_truncate",
    "min_nbytes",
]
