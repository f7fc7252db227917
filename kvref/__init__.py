"""The reference transformer and the public key/value cache protocol.

Every public name is importable from here (``from kvref import CacheSpec``). The protocol's
core is ``kvref.protocol``, the optional capabilities ``kvref.capabilities``, the argument
checks offered to implementers ``kvref.checks``; the reference model is ``kvref.model``, the
engine-level contract ``kvref.engine``.
"""

from kvref.capabilities import (
    Attending,
    Forkable,
    Movable,
    Offloadable,
    Reorderable,
    TreeDrafts,
    Truncatable,
    capabilities,
    may_refuse_shift,
    may_refuse_truncate,
)
from kvref.checks import (
    check_accepted,
    check_append,
    check_append_rows,
    check_attend,
    check_attend_latent,
    check_import,
    check_reorder,
    check_shift,
    check_shift_rows,
    check_tree,
    check_truncate,
)
from kvref.engine import (
    EngineFactory,
    EngineSpec,
    SequenceEngine,
    Step,
    engine_capabilities,
)
from kvref.memory import min_nbytes
from kvref.model import ModelConfig, ReferenceTransformer, attention
from kvref.moves import CacheRows
from kvref.pools import BlockPool, BlockTables, PrefixCaching
from kvref.protocol import CacheContractError, CacheFactory, CacheSpec, LayerCache, Shard
from kvref.quantized import Quantized, storage
from kvref.rope import rerotate
from kvref.shards import shard_heads

__all__ = [
    "Attending",
    "BlockPool",
    "BlockTables",
    "CacheContractError",
    "CacheFactory",
    "CacheRows",
    "CacheSpec",
    "EngineFactory",
    "EngineSpec",
    "Forkable",
    "LayerCache",
    "ModelConfig",
    "Movable",
    "Offloadable",
    "PrefixCaching",
    "Quantized",
    "ReferenceTransformer",
    "Reorderable",
    "SequenceEngine",
    "Shard",
    "Step",
    "TreeDrafts",
    "Truncatable",
    "attention",
    "capabilities",
    "check_accepted",
    "check_append",
    "check_append_rows",
    "check_attend",
    "check_attend_latent",
    "check_import",
    "check_reorder",
    "check_shift",
    "check_shift_rows",
    "check_tree",
    "check_truncate",
    "engine_capabilities",
    "may_refuse_shift",
    "may_refuse_truncate",
    "min_nbytes",
    "rerotate",
    "shard_heads",
    "storage",
]
