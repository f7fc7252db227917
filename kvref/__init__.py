"""The reference transformer and the public key/value cache protocol."""

from kvref.model import ModelConfig, ReferenceTransformer
from kvref.protocol import (
    CacheContractError,
    CacheFactory,
    CacheSpec,
    LayerCache,
    check_append,
    min_nbytes,
)

__all__ = [
    "CacheContractError",
    "CacheFactory",
    "CacheSpec",
    "LayerCache",
    "ModelConfig",
    "ReferenceTransformer",
    "check_append",
    "min_nbytes",
]
