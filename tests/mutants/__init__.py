"""A catalogue of broken caches and broken models that the suite must catch.

``MUTANTS`` lists them all. A cache mutant is a factory with one bug, run on the reference
model (those of ``tests/mutants/paged.py`` are broken paged pools and a broken chunked
``attend``, those of ``tests/mutants/attend.py`` a wrong ``attend`` beside a right ``append``,
those of ``tests/mutants/interplay.py`` a bug that shows only where capabilities mix, those
of ``tests/mutants/domain.py`` a bug inside the domain a cache declares, those of
``tests/mutants/rows.py`` a bug in rows of their own, those of ``tests/mutants/sinks.py``
a bug in attention sinks, those of ``tests/mutants/shift.py`` a bug in context shift, those
of ``tests/mutants/serving.py`` a bug in prefix caching or offload, those of
``tests/mutants/tree.py`` a bug in tree drafts, some of them patches of the model run on
``ChunkedCache``, those of ``tests/mutants/quantized.py`` a bug in quantized storage, those of
``tests/mutants/lossy_pools.py`` a bug in a coded pool's shared, restored or hit codes, those
of ``tests/mutants/latent.py`` a bug in a latent (MLA) cache or, run on ``LatentCache``, in
the model's absorbed path), those of ``tests/mutants/shards.py`` a bug in tensor-parallel
shards (a plan or a rank-aware cache), those of ``tests/mutants/moves.py`` a bug in moving a
paged cache between layouts, those of ``tests/mutants/shared.py`` a bug in layers that share
a cache through rows of their own or trees (its model mutants run on ``LeftPaddedBatchCache``
and ``ChunkedCache``); a
model mutant is a patch of the reference model with one bug, run on ``ConcatCache``.
``tests/test_mutants.py`` checks that some property catches each one, and
``python -m tests.mutants.report`` prints which property does and the shrunk counterexample.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

from kvimpl import ChunkedCache, ConcatCache
from kvimpl.latent import LatentCache
from kvref import CacheFactory
from tests.independent.left_padded_batch_cache import LeftPaddedBatchCache
from tests.mutants.attend import ATTEND_MUTANTS
from tests.mutants.caches import CACHE_MUTANTS
from tests.mutants.domain import DOMAIN_MUTANTS
from tests.mutants.interplay import INTERPLAY_MUTANTS
from tests.mutants.latent import LATENT_MODEL_MUTANTS, LATENT_MUTANTS
from tests.mutants.lossy_pools import LOSSY_POOL_MUTANTS
from tests.mutants.model import MODEL_MUTANTS
from tests.mutants.moves import MOVE_MUTANTS
from tests.mutants.paged import PAGED_MUTANTS
from tests.mutants.quantized import QUANTIZED_MUTANTS
from tests.mutants.rows import ROWS_MODEL_MUTANTS, ROWS_MUTANTS
from tests.mutants.serving import SERVING_MUTANTS
from tests.mutants.shards import SHARD_MUTANTS
from tests.mutants.shared import (
    SHARED_MUTANTS,
    SHARED_ROWS_MODEL_MUTANTS,
    SHARED_TREE_MODEL_MUTANTS,
)
from tests.mutants.shift import SHIFT_MUTANTS
from tests.mutants.sinks import SINKS_MUTANTS
from tests.mutants.sizes import SIZE_MUTANTS
from tests.mutants.tree import TREE_MODEL_MUTANTS, TREE_MUTANTS


@dataclass(frozen=True)
class Mutant:
    factory: CacheFactory
    patch: Callable[[], AbstractContextManager] = nullcontext  # applied while it runs

    @property
    def broken(self) -> Callable:
        """The cache factory or the model patch that holds the bug."""
        return self.factory if self.patch is nullcontext else self.patch

    @property
    def name(self) -> str:
        return self.broken.__name__

    @property
    def bug(self) -> str:
        """The first paragraph of the docstring, on one line."""
        return " ".join(self.broken.__doc__.split("\n\n")[0].split())


MUTANTS = (
    *(Mutant(factory) for factory in CACHE_MUTANTS),
    *(Mutant(factory) for factory in SIZE_MUTANTS),
    *(Mutant(factory) for factory in PAGED_MUTANTS),
    *(Mutant(factory) for factory in ATTEND_MUTANTS),
    *(Mutant(factory) for factory in INTERPLAY_MUTANTS),
    *(Mutant(factory) for factory in DOMAIN_MUTANTS),
    *(Mutant(factory) for factory in ROWS_MUTANTS),
    *(Mutant(factory) for factory in SINKS_MUTANTS),
    *(Mutant(factory) for factory in SHIFT_MUTANTS),
    *(Mutant(factory) for factory in SERVING_MUTANTS),
    *(Mutant(factory) for factory in TREE_MUTANTS),
    *(Mutant(factory) for factory in QUANTIZED_MUTANTS),
    *(Mutant(factory) for factory in LOSSY_POOL_MUTANTS),
    *(Mutant(factory) for factory in LATENT_MUTANTS),
    *(Mutant(factory) for factory in SHARD_MUTANTS),
    *(Mutant(factory) for factory in SHARED_MUTANTS),
    *(Mutant(factory) for factory in MOVE_MUTANTS),
    *(Mutant(ConcatCache, patch) for patch in MODEL_MUTANTS),
    *(Mutant(LeftPaddedBatchCache, patch) for patch in ROWS_MODEL_MUTANTS),
    *(Mutant(ChunkedCache, patch) for patch in TREE_MODEL_MUTANTS),
    *(Mutant(LatentCache, patch) for patch in LATENT_MODEL_MUTANTS),
    *(Mutant(LeftPaddedBatchCache, patch) for patch in SHARED_ROWS_MODEL_MUTANTS),
    *(Mutant(ChunkedCache, patch) for patch in SHARED_TREE_MODEL_MUTANTS),
)
