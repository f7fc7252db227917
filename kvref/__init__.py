"""The reference transformer and the public key/value cache protocol."""

from kvref.model import ModelConfig, ReferenceTransformer, attention
from kvref.protocol import (
    Attending,
    BlockPool,
    BlockTables,
    CacheContractError,
    CacheFactory,
    CacheSpec,
    Forkable,
    LayerCache,
    Reorderable,
    Truncatable,
    capabilities,
    check_append,
    check_attend,
    check_reorder,
    check_truncate,
    min_nbytes,
)

__all__ = [
    "Attending",
    "BlockPool",
    "BlockTables",
    "CacheContractError",
    "CacheFactory",
    "CacheSpec",
    "Forkable",
    "LayerCache",
    "ModelConfig",
    "ReferenceTransformer",
    "Reorderable",
    "Truncatable",
    "attention",
    "capabilities",
    "check_append",
    "check_attend",
    "check_reorder",
    "check_truncate",
    "min_nbytes",
]
