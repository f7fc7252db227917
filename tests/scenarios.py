"""Hypothesis strategies that draw what a cache is run through: models, batches and sessions.

A scenario is a model config, a batch size, a dtype and a list of sessions. Each session is a
prompt plus the rest of its tokens split into chunks, started either on fresh caches or on
reset ones. Tokens come from a per-session seed rather than being drawn one by one, so
Hypothesis shrinks plans (how many tokens, in which chunks), not individual token ids.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import torch
from hypothesis import strategies as st

from kvimpl.chunked import DEFAULT_CHUNK_SIZE
from kvref import CacheSpec, ModelConfig, ReferenceTransformer

DTYPES = (torch.float64, torch.float32)

# Sizes near the chunked cache's boundary (and twice it) are where off-by-ones live.
_edge = DEFAULT_CHUNK_SIZE
POISON_VALUES = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"), "huge": 1e30}
BOUNDARY_SIZES = (_edge - 1, _edge, _edge + 1, 2 * _edge - 1, 2 * _edge, 2 * _edge + 1)
LONG_SESSION = 64  # sessions are drawn beyond this too: some bugs only show past it
MAX_SESSION = 100

chunk_sizes = st.one_of(
    st.integers(1, 4), st.integers(5, 2 * _edge + 1), st.sampled_from(BOUNDARY_SIZES)
)
prompt_sizes = st.one_of(chunk_sizes, st.integers(LONG_SESSION - 16, LONG_SESSION + 16))


@dataclass(frozen=True)
class Session:
    """One prompt's worth of work: ``chunks[0]`` is the prefill, the rest are decode steps."""

    chunks: tuple[int, ...]
    token_seed: int
    start: Literal["fresh", "reset"]  # new caches from the factory, or reset() the previous
    poison: str | None = None  # after the session, append rows full of nan/inf/-inf/huge values
    poison_rows: int = 0

    @property
    def length(self) -> int:
        return sum(self.chunks)

    def describe(self) -> str:
        plan = f"prompt {self.chunks[0]} + chunks {list(self.chunks[1:])}"
        poisoned = f", then {self.poison_rows} {self.poison} rows" if self.poison else ""
        return f"{plan} ({self.length} tokens, {self.start} caches{poisoned})"


@dataclass(frozen=True)
class Scenario:
    config: ModelConfig
    batch: int
    dtype: torch.dtype
    sessions: tuple[Session, ...]
    slack: int = 0  # max_length beyond the longest session: 0 tests the exact end of a buffer

    @property
    def max_length(self) -> int:
        return max(s.length + s.poison_rows for s in self.sessions) + self.slack

    def tokens(self, session: Session) -> torch.Tensor:
        return random_tokens(self.config, self.batch, session.length, session.token_seed)

    def model(self) -> ReferenceTransformer:
        return build_model(self.config, self.dtype)

    def describe(self) -> str:
        c = self.config
        return (
            f"{c.num_layers} layers, {c.num_heads} heads over {c.num_kv_heads} kv heads of "
            f"width {c.head_dim}, batch {self.batch}, {str(self.dtype).removeprefix('torch.')}, "
            f"max_length {self.max_length}"
        )


def random_tokens(config: ModelConfig, batch: int, length: int, seed: int) -> torch.Tensor:
    """Token ids from a seed of their own, so that no test depends on the global RNG."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (batch, length), generator=generator)


@functools.lru_cache(maxsize=64)
def build_model(config: ModelConfig, dtype: torch.dtype) -> ReferenceTransformer:
    # Models are pure functions of (config, dtype); building one per example would dominate.
    return ReferenceTransformer(config, dtype=dtype)


@st.composite
def model_configs(draw, min_layers: int = 1, max_layers: int = 4) -> ModelConfig:
    kv_heads = draw(st.integers(1, 3))
    group = draw(st.integers(1, 3))  # heads per kv head: 1 is plain multi-head attention
    head_dim = draw(st.sampled_from((2, 4, 6, 8)))
    return ModelConfig(
        vocab_size=draw(st.integers(5, 40)),
        num_layers=draw(st.integers(min_layers, max_layers)),
        num_heads=kv_heads * group,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        ffn_dim=draw(st.sampled_from((8, 32))),
        seed=draw(st.integers(0, 2**16)),
    )


@st.composite
def sessions(draw, start: str, poison: bool = False) -> Session:
    chunks = [draw(prompt_sizes)]
    for size in draw(st.lists(chunk_sizes, max_size=10)):
        if sum(chunks) + size > MAX_SESSION:
            break
        chunks.append(size)
    poison_kind = draw(st.sampled_from(sorted(POISON_VALUES))) if poison else None
    return Session(
        chunks=tuple(chunks),
        token_seed=draw(st.integers(0, 2**16)),
        start=start,
        poison=poison_kind,
        poison_rows=draw(st.integers(1, 4)) if poison else 0,
    )


@st.composite
def scenarios(
    draw,
    *,
    min_sessions: int = 1,
    max_sessions: int = 3,
    poison: bool = False,
    dtypes: tuple[torch.dtype, ...] = DTYPES,
) -> Scenario:
    """A model, a batch, a dtype and sessions; with ``poison``, every session but the last
    leaves nan/inf/-inf/huge rows behind for the next one's reset or fresh caches to shed."""
    count = draw(st.integers(min_sessions, max_sessions))
    drawn = []
    for index in range(count):
        start = "fresh" if index == 0 else draw(st.sampled_from(("reset", "fresh")))
        drawn.append(draw(sessions(start, poison=poison and index < count - 1)))
    return Scenario(
        config=draw(model_configs()),
        batch=draw(st.integers(1, 4)),
        dtype=draw(st.sampled_from(dtypes)),
        sessions=tuple(drawn),
        slack=draw(st.sampled_from((0, 0, 1, 7))),
    )


# Hand-picked edges, run by tests/test_regressions.py so that a derandomized search is not
# the only guard. Both fill a buffer exactly (slack 0) with chunks that start, end and
# straddle the chunked cache's boundaries; later sessions reuse reset caches or get fresh ones.
_small = ModelConfig(vocab_size=17, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4, seed=7)
BOUNDARIES = Scenario(
    config=_small,
    batch=2,
    dtype=torch.float64,
    sessions=(
        Session(chunks=(_edge - 1, 1, _edge + 1, 3, 1), token_seed=1, start="fresh"),
        Session(chunks=(_edge, _edge, 2, 1, 1, 1), token_seed=2, start="reset"),
        Session(chunks=(1, 1, 1, 2 * _edge), token_seed=3, start="fresh"),
    ),
)
POISONED_RESET = Scenario(
    config=_small,
    batch=3,
    dtype=torch.float32,
    sessions=(
        Session(chunks=(5, 3), token_seed=4, start="fresh", poison="nan", poison_rows=2),
        Session(chunks=(4, 1, 2), token_seed=5, start="reset", poison="inf", poison_rows=1),
        Session(chunks=(2 * _edge,), token_seed=6, start="fresh"),
    ),
)


@st.composite
def cache_specs(draw, dtypes: tuple[torch.dtype, ...] = DTYPES, min_length: int = 1) -> CacheSpec:
    return CacheSpec(
        batch=draw(st.integers(1, 3)),
        kv_heads=draw(st.integers(1, 3)),
        head_dim=draw(st.sampled_from((2, 4, 6, 8))),
        max_length=draw(st.integers(max(1, min_length), 3 * _edge)),
        dtype=draw(st.sampled_from(dtypes)),
        device=torch.device("cpu"),
    )


@st.composite
def chunk_plans(draw, max_total: int, min_chunks: int = 0, max_chunks: int = 6) -> list[int]:
    """Chunk sizes (up to two chunks of the chunked cache each) adding up to at most max_total."""
    plan: list[int] = []
    sizes = st.lists(st.integers(1, 2 * _edge + 1), min_size=min_chunks, max_size=max_chunks)
    for size in draw(sizes):
        size = min(size, max_total - sum(plan))
        if size < 1:
            break
        plan.append(size)
    return plan


def random_rows(spec: CacheSpec, rows: int, seed: int) -> torch.Tensor:
    """Keys or values for ``rows`` new tokens: normal noise, so every row is distinct."""
    generator = torch.Generator().manual_seed(seed)
    shape = (spec.batch, spec.kv_heads, rows, spec.head_dim)
    return torch.randn(shape, generator=generator, dtype=torch.float64).to(spec.dtype)


@dataclass(frozen=True)
class CachePlan:
    """A cache spec and the sizes of the appends that warm it (rows from ``random_rows``)."""

    spec: CacheSpec
    chunks: tuple[int, ...]

    def describe(self) -> str:
        return (
            f"a cache warmed by appends of {list(self.chunks)} rows ({sum(self.chunks)} "
            f"tokens), built for {self.spec}"
        )


@st.composite
def cache_plans(draw, room: int = 1, min_chunks: int = 0) -> CachePlan:
    """A spec and appends that leave room for ``room`` more rows within its max_length."""
    spec = draw(cache_specs(min_length=room))
    chunks = draw(chunk_plans(max_total=spec.max_length - room, min_chunks=min_chunks))
    return CachePlan(spec, tuple(chunks))


# Shrunk counterexamples of the mutant catalogue (tests/mutants), pinned with @example on
# the core properties: small, and each at an edge where a real cache broke.
_tiny = ModelConfig(vocab_size=11, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4, seed=3)
PINNED = (
    # ResetKeepsChunks: a reset after a full chunk, then one token.
    Scenario(
        _tiny,
        1,
        torch.float64,
        (Session((1, _edge), 1, "fresh"), Session((1,), 2, "reset")),
    ),
    # DropsFullLastChunk: a prompt of exactly one chunk.
    Scenario(_tiny, 1, torch.float64, (Session((_edge,), 3, "fresh"),)),
    # WrapsPast48: one token past 48.
    Scenario(_tiny, 1, torch.float64, (Session((1, 47, 1), 4, "fresh"),)),
)
