"""What the benchmark runs on: the model, batch and context lengths of a run (``FULL``, or
``QUICK`` for a small model in seconds), its requests side by side and its shared-prefix
workload, and the compressed arm's caches with the MLA model they decode on."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvimpl.latent import LatentCache
from kvimpl.quantized import QuantizedCache
from kvref import CacheFactory, ModelConfig


@dataclass(frozen=True)
class SharedPrefix:
    """Requests that open with one system prompt, each then its own prompt and a few
    decoded tokens: the shared-prefix workload (shared_prefix.csv)."""

    requests: int
    system: int  # tokens of the system prompt every request starts with
    own: int  # tokens of each request's own prompt after it
    decode: int  # tokens each request then decodes, one model call each


@dataclass(frozen=True)
class Workload:
    """The model every cache is timed on, and how long to time each row."""

    config: ModelConfig
    batch: int
    lengths: tuple[int, ...]
    min_run_time: float  # seconds of timed decode steps per row
    rounds: int  # the rows of one length take turns this many times
    # Context lengths of requests of batch 1 decoding side by side on one paged pool (cut to
    # the longest of ``lengths``); the second is also the prompt that samples fork from.
    requests: tuple[int, ...]
    shared_prefix: SharedPrefix  # requests opening with one system prompt
    dtype: torch.dtype = torch.float32


# Big enough that attention over the cache, not the fixed per-token work, dominates at 4096.
FULL = Workload(
    ModelConfig(1024, num_layers=4, num_heads=8, num_kv_heads=8, head_dim=64, ffn_dim=2048),
    batch=4,
    lengths=(256, 1024, 4096),
    min_run_time=2.0,
    rounds=5,
    requests=(4096, 1536, 512, 64),
    shared_prefix=SharedPrefix(requests=16, system=512, own=32, decode=4),
)
QUICK = Workload(
    ModelConfig(64, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=16, ffn_dim=64),
    batch=2,
    lengths=(16, 64, 256),
    min_run_time=0.05,
    rounds=2,
    requests=(256, 100, 33, 5),
    shared_prefix=SharedPrefix(requests=4, system=40, own=6, decode=3),
)
BLOCK_SIZE = 256  # tokens per block (chunk) of the paged (chunked) built-in while timed
QUICK_BLOCK_SIZE = 16  # with QUICK: the block size the suite tests them at


# The compressed arm (docs/compressed.md): caches that hold less than the full-precision
# formula, each held to the formula of what it declares. Lossy storage on the grouped-query
# model; a latent cache on an MLA model of the same sizes (``latent_config``).
LOSSY: dict[str, CacheFactory] = {"quantized": QuantizedCache}
LATENT: dict[str, CacheFactory] = {"latent": LatentCache}
# A row's arm and the model it decodes on, as results.csv names them.
FULL_PRECISION, COMPRESSED = "full precision", "compressed"
GQA, MLA = "grouped-query", "MLA"


def latent_config(config: ModelConfig) -> ModelConfig:
    """An MLA model of the benchmark's sizes (contract, 10.2) in DeepSeek-V3's proportions:
    each head's no-rope key channels as wide as its value, a rope key half that, a latent 4
    heads wide; cached calls on the absorbed path, the one decode kernels take."""
    width = config.head_dim
    return replace(
        config,
        attention="mla",
        num_kv_heads=1,
        latent_dim=4 * width,
        rope_dim=width // 2,
        nope_dim=width,
        mla_path="absorbed",
    )
