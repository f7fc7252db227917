"""Hypothesis strategies that draw what a cache is run through, and the plans they draw.

Two kinds of plan:

- a ``Scenario`` runs the reference model: a model config, a batch size, a dtype and a list
  of sessions, each a prompt plus the rest of its tokens split into chunks, on fresh caches
  or on reset ones. Tokens come from a per-session seed rather than being drawn one by one,
  so Hypothesis shrinks plans (how many tokens, in which chunks), not token ids;
- a ``CachePlan`` (and ``IsolationPlan``, ``ModelPlan``) drives caches directly, with rows of
  random numbers: no model, so these properties are cheap.

Every plan has ``describe()``, which failure messages quote. Sizes are biased to the
boundaries of ``EDGE``-row blocks, where off-by-ones live; a share of every draw reaches the
sizes real caches run at (``kvcheck.sizes``: wide heads, many heads, big batches, sessions
past 1,024 tokens, dozens of resets), aimed at the sizes a cache declares.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from kvcheck import devices as kvdevices
from kvcheck import sizes as kvsizes
from kvcheck.tensors import POISON_VALUES, ROW_KINDS, TOKEN_KINDS, build_model, tokens_of_kind
from kvref import CacheSpec, ModelConfig, ReferenceTransformer
from kvref.reprs import short_repr

DTYPES = (torch.float64, torch.float32)  # close enough for a tolerance (asserts.TOLERANCES)
HALF_DTYPES = (torch.bfloat16, torch.float16)  # held to an error budget (asserts.BUDGETS)
# What scenarios and cache specs draw: half precision a third of the time. float64 comes
# first, so that a failure that does not need another dtype shrinks to it.
WITH_HALF = (*DTYPES, *DTYPES, *HALF_DTYPES)

# Sizes are drawn near multiples of a 16-row block (a common page and chunk size, and the
# built-in chunked cache's): one below, at, and one past the boundary, once and twice.
EDGE = 16
BOUNDARY_SIZES = (EDGE - 1, EDGE, EDGE + 1, 2 * EDGE - 1, 2 * EDGE, 2 * EDGE + 1)
LONG_SESSION = 64  # sessions are drawn beyond this too: some bugs only show past it
MAX_SESSION = 100
# A long-lived set of caches runs a model through 9 to this many sessions (8 resets and
# more); the cache-level stale-rows property takes one cache through dozens.
LIVED_SESSIONS = 12
# What a session may bring past its chunks, within the domain's largest max_length: poison
# rows (up to 4) and slack (up to 7); and a long session's decode steps (up to 3 x 4).
AFTER_SESSION = 4 + 7
AFTER_LONG = 3 * 4 + AFTER_SESSION


chunk_sizes = st.one_of(
    st.integers(1, 4), st.integers(5, 2 * EDGE + 1), st.sampled_from(BOUNDARY_SIZES)
)
prompt_sizes = st.one_of(chunk_sizes, st.integers(LONG_SESSION - 16, LONG_SESSION + 16))


@short_repr
@dataclass(frozen=True)
class Session:
    """One prompt's worth of work: ``chunks[0]`` is the prefill, the rest are decode steps."""

    chunks: tuple[int, ...]
    token_seed: int
    start: Literal["fresh", "reset"]  # new caches from the factory, or reset() the previous
    poison: str | None = None  # after the session, append rows full of nan/inf/-inf/huge values
    poison_rows: int = 0
    tokens: str = "random"  # one of TOKEN_KINDS: what the rows it writes look like

    @property
    def length(self) -> int:
        return sum(self.chunks)

    def in_words(self) -> str:
        """Its steps as the plan reads: ``prompt 5, decode 1, chunk 16``."""
        steps = [f"prompt {self.chunks[0]}"]
        steps += [f"decode {size}" if size == 1 else f"chunk {size}" for size in self.chunks[1:]]
        if self.poison:
            steps.append(f"{self.poison_rows} {self.poison} rows")
        if self.tokens != "random":
            steps.append(f"tokens: {self.tokens}")
        return ", ".join(steps)

    def describe(self) -> str:
        plan = f"prompt {self.chunks[0]} + chunks {list(self.chunks[1:])}"
        poisoned = f", then {self.poison_rows} {self.poison} rows" if self.poison else ""
        return f"{plan} ({self.length} tokens, {self.start} caches{poisoned})"


@short_repr
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
        return tokens_of_kind(
            session.tokens, self.config, self.batch, session.length, session.token_seed
        )

    def model(self) -> ReferenceTransformer:
        return build_model(self.config, self.dtype)

    def reference(self) -> ReferenceTransformer:
        """The float64 model: the truth a half-precision run is measured against."""
        return build_model(self.config, torch.float64)

    def in_words(self) -> str:
        """The whole plan as it reads: ``prompt 5, reset, prompt 2, decode 1 (1 layer, ...)``,
        each later session after ``reset`` (its caches reset) or ``fresh caches``."""
        sessions = [self.sessions[0].in_words()]
        for session in self.sessions[1:]:
            start = "reset" if session.start == "reset" else "fresh caches"
            sessions.append(f"{start}, {session.in_words()}")
        return f"{', '.join(sessions)} ({self.describe()})"

    def describe(self) -> str:
        return f"{describe_config(self.config)}, batch {self.batch}, " + (
            f"{kvdevices.dtype_name(self.dtype)}, max_length {self.max_length}"
        )

    def summary(self) -> tuple[str, str, str]:
        """Tokens (chunks per session), layers and batch: a row of the mutant table."""
        plans = "; ".join(f"{s.start} {'+'.join(map(str, s.chunks))}" for s in self.sessions)
        tokens = sum(session.length for session in self.sessions)
        return f"{tokens} ({plans})", str(self.config.num_layers), str(self.batch)


def describe_config(c: ModelConfig) -> str:
    sinks = f" and {c.sinks} sinks" if c.sinks else ""
    if c.sinks and c.sink_positions == "in cache":
        sinks += " (at their positions in the cache)"
    if c.window is None:
        window = ""
    elif c.window_layers == "all":
        window = f", window {c.window}{sinks} on every layer"
    else:
        window = f", window {c.window}{sinks} on even layers (odd ones global)"
    hidden = "" if c.hidden is None else f" on a residual of width {c.hidden}"
    shared = ""
    if c.kv_sources is not None:
        readers = [
            f"layer {layer} reads {source}'s"
            for layer, source in enumerate(c.kv_sources)
            if source is not None
        ]
        shared = f", layers sharing caches ({', '.join(readers)})"
    if c.attention == "mla":
        return (
            f"{c.num_layers} layers of latent attention ({c.mla_path} path for cached calls): "
            f"{c.num_heads} heads over one cached latent of width {c.latent_dim} and one rope "
            f"key of width {c.rope_dim} (heads' no-rope width {c.nope_dim}, value width "
            f"{c.head_dim}){hidden}{window}{shared}"
        )
    return (
        f"{c.num_layers} layers, {c.num_heads} heads over {c.num_kv_heads} kv heads of "
        f"width {c.head_dim}{hidden}{window}{shared}"
    )


# Windows around the chunk sizes drawn (so that lengths cross W - 1, W and W + 1, chunks
# straddle the window's edge and prefills outrun it), and often none at all.
@st.composite
def window_from(draw, strategy: st.SearchStrategy) -> int | None:
    """A window from ``strategy``, or none where the cache supports no windows."""
    return None if kvsizes.domain().windows is False else draw(strategy, label="window")


windows = window_from(
    st.one_of(
        st.none(), st.integers(1, 4), st.sampled_from(BOUNDARY_SIZES), st.integers(5, 2 * EDGE + 1)
    )
)


@st.composite
def model_configs(
    draw, min_layers: int = 1, max_layers: int = 4, tokens: int = MAX_SESSION + 8
) -> ModelConfig:
    """A model config; a share are wide where a cache looks (head_dim up to 256, up to 8 kv
    heads, up to 8 query heads per kv head) on a narrow residual, with one or two layers.
    ``tokens`` is the most the model attends over: wide draws stay within
    ``kvsizes.ATTENTION_BUDGET`` at that length, and the batch gets what is left."""
    units = kvsizes.ATTENTION_BUDGET // tokens**2  # batch x heads x (head_dim + SCORE_COST)
    head_dim = draw(kvsizes.head_dims(room=units - kvsizes.SCORE_COST), label="head_dim")
    per_head = head_dim + kvsizes.SCORE_COST
    kv_heads = draw(kvsizes.kv_head_counts(room=units // per_head), label="kv_heads")
    group = draw(kvsizes.groups(room=units // (per_head * kv_heads)), label="heads per kv head")
    wide = head_dim > 8 or kv_heads > 3 or group > 3
    # Wide or long: one or two layers (a cache's bugs rarely need a third).
    few = wide or tokens > 2 * MAX_SESSION
    layers = st.integers(min_layers, min(max_layers, max(min_layers, 2)) if few else max_layers)
    if latent_drawable() and draw(st.booleans(), label="latent attention"):
        return draw(latent_configs(head_dim, group, layers, units), label="latent config")
    return ModelConfig(
        **draw(any_attention(layers), label="model"),
        num_heads=kv_heads * group,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        # Wide heads on a narrow residual: the cache sees real sizes, the model stays cheap.
        hidden=draw(st.sampled_from((16, 8, 32)), label="hidden") if wide else None,
    )


def readable_by(config: ModelConfig, layer: int, sources) -> list[int]:
    """The earlier layers ``layer`` may read the cache of, given what each earlier layer
    reads (``sources``, None: its own cache): those with a cache of their own that attend
    as it does (the same window and sinks), so that one cache serves both."""

    def attends(index: int) -> tuple:
        return config.layer_window(index), config.layer_sinks(index)

    return [j for j in range(layer) if sources[j] is None and attends(j) == attends(layer)]


@st.composite
def kv_sources(draw, config: ModelConfig) -> tuple[int | None, ...]:
    """Which earlier layer each layer reads (``ModelConfig.kv_sources``; None: its own
    cache), at least one reader where any layer can read (``readable_by``): the last layers
    reading one source, alternate layers reading the one before, and the rest."""
    sources: list[int | None] = [None] * config.num_layers
    for layer in range(1, config.num_layers):
        eligible = readable_by(config, layer, sources)
        sources[layer] = draw(st.sampled_from([None, *eligible]), label=f"layer {layer} reads")
    if all(source is None for source in sources):  # the last layer that can read, reads
        pairs = [
            (layer, j)
            for layer in range(1, config.num_layers)
            for j in readable_by(config, layer, [None] * layer)
        ]
        if pairs:
            layer, source = pairs[-1]
            sources[layer] = source
    return tuple(sources)


@st.composite
def any_attention(draw, layers: st.SearchStrategy[int]) -> dict:
    """The fields of a drawn model that do not depend on its attention: vocabulary, layers,
    feed-forward width, weights and windows."""
    return {
        "vocab_size": draw(st.integers(5, 40), label="vocab_size"),
        "num_layers": draw(layers, label="layers"),
        "ffn_dim": draw(st.sampled_from((8, 32)), label="ffn_dim"),
        "seed": draw(st.integers(0, 2**16), label="weight seed"),
        "window": draw(windows, label="window"),
        "window_layers": draw(st.sampled_from(("all", "alternate")), label="window layers"),
    }


def latent_drawable() -> bool:
    """Whether latent (MLA) layers are drawn: the cache declares them, and its domain's kv
    heads (where it declares some) take a latent layer's one."""
    domain = kvsizes.domain()
    return bool(domain.latent) and (domain.kv_heads is None or 1 in domain.kv_heads)


@st.composite
def latent_configs(draw, rope_dim: int, heads: int, layers, units: int) -> ModelConfig:
    """An MLA model (contract, section 10.2) for a cache that declares latent layers: its
    cache's keys ``rope_dim`` wide, its values a latent mostly narrow, a share as wide as
    DeepSeek-V3's (512) where the budget has room, on either path."""
    domain = kvsizes.domain()
    if domain.rope_dims is not None:  # a kernel's rope widths (section 10.2), those alone
        rope_dim = draw(st.sampled_from(domain.rope_dims), label="rope_dim")
    room = units // max(1, heads) - kvsizes.SCORE_COST - rope_dim
    latent = draw(st.sampled_from((2, 6, 16, 64)), label="latent_dim")
    if room >= 512 and kvsizes.large(draw, "latent_dim"):
        latent = 512
    if domain.latent_dims is not None:
        latent = draw(st.sampled_from(domain.latent_dims), label="declared latent_dim")
    return ModelConfig(
        **draw(any_attention(layers), label="model"),
        num_heads=heads,
        num_kv_heads=1,
        head_dim=draw(st.sampled_from((2, 4, 8)), label="value head width"),
        hidden=draw(st.sampled_from((16, 8, 32)), label="hidden") if latent > 64 else None,
        attention="mla",
        latent_dim=latent,
        rope_dim=rope_dim,
        nope_dim=draw(st.sampled_from((2, 4, 8)), label="nope_dim"),
        mla_path=draw(st.sampled_from(("naive", "absorbed")), label="mla path"),
    )


def attention_room(config: ModelConfig, tokens: int) -> int:
    """The largest batch whose attention over ``tokens`` stays within the budget."""
    width = config.head_dim
    if config.attention == "mla":  # the absorbed path attends over the latent and rope key
        width = max(width, config.query_width, config.latent_dim + config.rope_dim)
    per_row = config.num_heads * (width + kvsizes.SCORE_COST) * tokens**2
    return max(1, kvsizes.ATTENTION_BUDGET // per_row)


@st.composite
def sessions(draw, start: str, poison: bool = False, max_chunks: int = 10) -> Session:
    # Room for the poison rows and the slack within the domain's largest max_length.
    most = kvsizes.longest(MAX_SESSION + AFTER_SESSION) - AFTER_SESSION
    chunks = [min(most, draw(prompt_sizes, label="prompt"))]
    for size in draw(st.lists(chunk_sizes, max_size=max_chunks), label="decode chunks"):
        if sum(chunks) + size > most:
            break
        chunks.append(size)
    return finish_session(draw, chunks, start, poison)


def finish_session(draw, chunks: list[int], start: str, poison: bool) -> Session:
    poison_kind = draw(st.sampled_from(sorted(POISON_VALUES)), label="poison") if poison else None
    return Session(
        chunks=tuple(chunks),
        token_seed=draw(st.integers(0, 2**16), label="token seed"),
        start=start,
        poison=poison_kind,
        poison_rows=draw(st.integers(1, 4), label="poison rows") if poison else 0,
        # Random first, so that a session shrinks to random tokens unless the kind matters.
        tokens=draw(st.sampled_from(TOKEN_KINDS), label="tokens"),
    )


def cuts(limit: int) -> st.SearchStrategy[int]:
    """Where a chunk of a long session ends: at and around page boundaries, or anywhere."""
    return st.one_of(kvsizes.boundary_lengths(limit), st.integers(1, limit))


@st.composite
def long_sessions(draw, start: str, poison: bool = False) -> Session:
    """A session of up to ``kvsizes.LONG`` tokens: a prompt and chunks of up to hundreds of
    tokens on a warm cache, each ending at or around a page boundary or anywhere (so that
    chunks straddle pages), then a few decode steps."""
    # Within the domain's largest max_length, with room for decode steps, poison and slack.
    limit = kvsizes.longest(kvsizes.LONG + AFTER_LONG) - AFTER_LONG
    ends = draw(st.lists(cuts(limit), min_size=1, max_size=5, unique=True), label="ends")
    ends.sort()
    chunks = [end - before for before, end in zip([0, *ends], ends, strict=False)]
    chunks += draw(st.lists(st.integers(1, 4), max_size=3), label="decode steps")
    return finish_session(draw, chunks, start, poison)


@st.composite
def scenarios(
    draw,
    *,
    min_sessions: int = 1,
    max_sessions: int = 3,
    poison: bool = False,
    dtypes: tuple[torch.dtype, ...] = WITH_HALF,
) -> Scenario:
    """A model, a batch, a dtype and sessions; with ``poison``, every session but the last
    leaves nan/inf/-inf/huge rows behind for the next one's reset or fresh caches to shed."""
    if not 1 <= min_sessions <= max_sessions:
        raise InvalidArgument(
            f"need 1 <= min_sessions <= max_sessions, got {min_sessions}, {max_sessions}"
        )
    # A share of scenarios runs one set of caches through dozens of sessions (each reset),
    # and a share has sessions past 1,024 tokens; most have a few short ones.
    long_lived = kvsizes.large(draw, "long-lived caches")
    most = max(max_sessions, LIVED_SESSIONS) if long_lived else max_sessions
    low = max(min_sessions, 9) if long_lived else min_sessions
    count = draw(st.integers(low, most), label="sessions")
    long = not long_lived and kvsizes.large(draw, "long sessions")
    drawn = []
    for index in range(count):
        if index == 0:
            start = "fresh"
        elif long_lived:
            start = "reset"  # one cache object through every session
        else:
            start = draw(st.sampled_from(("reset", "fresh")), label="start")
        leaves_poison = poison and index < count - 1
        if long and index == 0:  # one long session: the others reuse or replace its caches
            session = long_sessions(start, poison=leaves_poison)
        else:
            session = sessions(start, poison=leaves_poison, max_chunks=1 if long_lived else 10)
        drawn.append(draw(session, label="session"))
    needed = max(s.length + s.poison_rows for s in drawn)
    slack = draw(st.sampled_from((0, 0, 1, 7)), label="slack")
    largest = kvsizes.domain().max_length
    if largest is not None and largest <= kvsizes.LARGEST_BUILT and kvsizes.edge(draw, "slack"):
        slack = largest - needed  # caches built for the domain's largest max_length
    tokens = needed + slack
    config = draw(model_configs(tokens=tokens), label="config")
    return Scenario(
        config=config,
        batch=draw(kvsizes.batches(room=attention_room(config, tokens)), label="batch"),
        dtype=draw(dtypes_on_device(dtypes), label="dtype"),
        sessions=tuple(drawn),
        slack=slack,
    )


# Hand-picked edges, run as plain tests (not @example, so that a search that finds a bug
# still shrinks it). Both fill a buffer exactly (slack 0) with chunks that start, end and
# straddle block boundaries; later sessions reuse reset caches or get fresh ones.
_small = ModelConfig(vocab_size=17, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4, seed=7)
BOUNDARIES = Scenario(
    config=_small,
    batch=2,
    dtype=torch.float64,
    sessions=(
        Session(chunks=(EDGE - 1, 1, EDGE + 1, 3, 1), token_seed=1, start="fresh"),
        Session(chunks=(EDGE, EDGE, 2, 1, 1, 1), token_seed=2, start="reset"),
        Session(chunks=(1, 1, 1, 2 * EDGE), token_seed=3, start="fresh"),
    ),
)
POISONED_RESET = Scenario(
    config=_small,
    batch=3,
    dtype=torch.float32,
    sessions=(
        Session(chunks=(5, 3), token_seed=4, start="fresh", poison="nan", poison_rows=2),
        Session(chunks=(4, 1, 2), token_seed=5, start="reset", poison="inf", poison_rows=1),
        Session(chunks=(2 * EDGE,), token_seed=6, start="fresh"),
    ),
)
EDGES = {"boundaries": BOUNDARIES, "poisoned_reset": POISONED_RESET}


@st.composite
def cache_specs(
    draw,
    dtypes: tuple[torch.dtype, ...] = WITH_HALF,
    min_length: int = 1,
    judged: tuple[torch.dtype, ...] = WITH_HALF,
    latent: bool = True,
    wide_one_in: int | None = None,
) -> CacheSpec:
    """A spec for cache-level properties (no model, so they can go long cheaply): mostly
    small; a share up to ``kvsizes.LONG`` rows, at and around page boundaries, and a share
    wide, within ``kvsizes.ROWS_BUDGET`` numbers per key tensor; for a cache that declares
    latent layers, half of them a latent layer's (values of their own width), unless not
    ``latent`` (``attend``, whose output is shaped like the query, has no latent form yet).
    Heads go wide one time in ``wide_one_in`` (else the profile's share)."""
    low = max(1, min_length)
    largest = kvsizes.domain().max_length
    limit = kvsizes.longest(kvsizes.LONG)
    if largest is not None and kvsizes.edge(draw, "max_length"):
        max_length = min(largest, kvsizes.LARGEST_BUILT)  # the domain's largest
    elif kvsizes.large(draw, "max_length", kvsizes.LONG_ONE_IN):
        long = st.one_of(kvsizes.boundary_lengths(limit, low), st.integers(low, limit))
        max_length = draw(long, label="max_length")
    else:
        max_length = draw(st.integers(low, max(low, 3 * EDGE)), label="max_length")
    room = max(1, kvsizes.ROWS_BUDGET // max_length)  # for batch x kv heads x head_dim
    head_dim = draw(kvsizes.head_dims(room=room, wide_one_in=wide_one_in), label="head_dim")
    kv_heads = draw(kvsizes.kv_head_counts(room=room // head_dim), label="kv_heads")
    value_dim = None
    if latent and latent_drawable() and draw(st.booleans(), label="latent"):
        # An MLA layer's cache: one "head", its values a latent of another width.
        kv_heads = 1
        value_dim, head_dim = draw(latent_widths(max_length, head_dim), label="latent widths")
    width = max(head_dim, value_dim or 0)  # of the widest rows
    return CacheSpec(
        batch=draw(kvsizes.batches(small_max=3, room=room // (width * kv_heads)), label="batch"),
        kv_heads=kv_heads,
        head_dim=head_dim,
        max_length=max_length,
        dtype=draw(dtypes_on_device(dtypes, judged), label="dtype"),
        device=kvdevices.current(),
        window=draw(windows, label="window"),
        value_dim=value_dim,
    )


@st.composite
def latent_widths(draw, max_length: int, head_dim: int) -> tuple[int, int]:
    """A latent layer's cache widths (value_dim, head_dim): a latent within the rows
    budget and the rope key ``head_dim`` wide, or the declared widths alone (section 10.2)."""
    domain = kvsizes.domain()
    if domain.rope_dims is not None:
        head_dim = draw(st.sampled_from(domain.rope_dims), label="rope width")
    if domain.latent_dims is not None:
        return draw(st.sampled_from(domain.latent_dims), label="value_dim"), head_dim
    widths = [w for w in (2, 6, 16, 64, 512) if w * max_length <= kvsizes.ROWS_BUDGET]
    return draw(st.sampled_from(widths or [2]), label="value_dim"), head_dim


@st.composite
def dtypes_on_device(
    draw, dtypes: tuple[torch.dtype, ...], judged: tuple[torch.dtype, ...] = WITH_HALF
) -> torch.dtype:
    """One of ``dtypes`` that the kit's device computes in and the cache supports; where it
    supports none of them, one of ``judged`` (the dtypes the property can judge)."""
    return draw(st.sampled_from(supported_dtypes(dtypes, judged)), label="dtype")


def supported_dtypes(
    dtypes: tuple[torch.dtype, ...], judged: tuple[torch.dtype, ...] = WITH_HALF
) -> tuple[torch.dtype, ...]:
    """``dtypes`` on the kit's device within the cache's domain, else ``judged`` there; ()
    where neither has one."""
    supported = kvsizes.domain().dtypes

    def fitting(candidates):  # repeats kept: they weight the draw (WITH_HALF)
        return tuple(d for d in kvdevices.usable(candidates) if supported is None or d in supported)

    return fitting(dtypes) or fitting(judged)


def chunk_plans(max_total: int, min_chunks: int = 0, max_chunks: int = 6) -> st.SearchStrategy:
    """Chunk sizes adding up to at most ``max_total``: each up to two blocks and one row,
    or (when ``max_total`` allows) up to hundreds, ending at and around page boundaries."""
    if min_chunks < 0 or max_chunks < min_chunks:
        raise InvalidArgument(f"need 0 <= min_chunks <= max_chunks, got {min_chunks}, {max_chunks}")
    if max_total < min_chunks:
        raise InvalidArgument(
            f"max_total={max_total} cannot hold min_chunks={min_chunks} chunks of at least 1"
        )
    return _chunk_plans(max_total, min_chunks, max_chunks)


@st.composite
def _chunk_plans(draw, max_total: int, min_chunks: int, max_chunks: int) -> list[int]:
    if max_total > 3 * EDGE:
        # A long plan (a long spec): its chunks end at and around page boundaries (or
        # anywhere), so that lengths land on them and chunks of hundreds straddle them.
        size = max(min_chunks, 1)
        ends = st.lists(cuts(max_total), min_size=size, max_size=max(size, max_chunks), unique=True)
        drawn = draw(ends, label="chunk ends")
        if kvsizes.domain().max_length is not None and kvsizes.edge(draw, "filled"):
            drawn = [end for end in drawn if end != max_total] + [max_total]  # to the end
        drawn = sorted(drawn)
        if drawn[-1] < max_total and draw(st.booleans(), label="straddle a page?"):
            # Then one chunk on, to one row past the next page boundary: ends drawn at and
            # around boundaries can all land below one, and a write that splits at page
            # ends only in its read path goes wrong on a chunk that runs across it.
            page = draw(kvsizes.pages(max_total), label="page straddled")
            if (past := (drawn[-1] // page + 1) * page + 1) <= max_total:
                drawn.append(past)
        return [end - before for before, end in zip([0, *drawn], drawn, strict=False)]
    plan: list[int] = []
    sizes = st.lists(st.integers(1, 2 * EDGE + 1), min_size=min_chunks, max_size=max_chunks)
    for size in draw(sizes, label="chunk sizes"):
        # Cut to what is left, keeping one row for every chunk still owed to min_chunks.
        owed = max(min_chunks - len(plan) - 1, 0)
        size = min(size, max_total - sum(plan) - owed)
        if size < 1:
            break
        plan.append(size)
    return plan


@short_repr
@dataclass(frozen=True)
class CachePlan:
    """A cache spec, the sizes of the appends that warm it (rows of kind ``rows``, one of
    ``kvcheck.tensors.ROW_KINDS``), and the size of the next append (the one a property
    tries)."""

    spec: CacheSpec
    chunks: tuple[int, ...]
    new_tokens: int = 1
    rows: str = "random"

    @property
    def warm_length(self) -> int:
        return sum(self.chunks)

    def describe(self) -> str:
        warmed = (
            f"a cache warmed by appends of {list(self.chunks)} rows ({self.warm_length} tokens)"
            if self.chunks
            else "an empty cache (no appends)"
        )
        rows = f" of {self.rows} rows" if self.rows != "random" and self.chunks else ""
        return f"{warmed}{rows}; built for {self.spec}"

    def summary(self) -> tuple[str, str, str]:
        appends = "+".join(map(str, self.chunks)) or "none"
        return f"{self.warm_length} (appends {appends})", "1 cache", str(self.spec.batch)


@st.composite
def cache_plans(
    draw, room: int = 1, min_chunks: int = 0, max_new: int = 3, wide_one_in: int | None = None
) -> CachePlan:
    """A spec and appends that leave room for ``room`` more rows within its max_length, and
    the size of the next append, 1 to ``max_new``; heads wide one time in ``wide_one_in``
    (else the profile's share)."""
    spec = draw(cache_specs(min_length=room + min_chunks, wide_one_in=wide_one_in), label="spec")
    chunks = draw(chunk_plans(spec.max_length - room, min_chunks=min_chunks), label="warm-up")
    new_tokens = draw(st.integers(1, max_new), label="new tokens")
    # Random first, so that a plan shrinks to noise unless the kind of rows matters.
    rows = draw(st.sampled_from(ROW_KINDS), label="rows")
    return CachePlan(spec, tuple(chunks), new_tokens, rows)


@short_repr
@dataclass(frozen=True)
class ModelPlan:
    """A model's caches warmed by a prefill and decode steps (``chunks``), a layer a bad call
    may pick on, and a seed for the tokens."""

    config: ModelConfig
    dtype: torch.dtype
    batch: int
    chunks: tuple[int, ...]
    layer: int
    token_seed: int

    def describe(self) -> str:
        return (
            f"{describe_config(self.config)}, batch {self.batch}, "
            f"{kvdevices.dtype_name(self.dtype)}, caches fed chunks {list(self.chunks)}; "
            f"the layer a case may lengthen or empty: {self.layer}"
        )

    def summary(self) -> tuple[str, str, str]:
        chunks = "+".join(map(str, self.chunks))
        return f"{sum(self.chunks)} ({chunks})", str(self.config.num_layers), str(self.batch)


@st.composite
def model_plans(draw) -> ModelPlan:
    config = draw(model_configs(min_layers=2, max_layers=3, tokens=EDGE + 3), label="config")
    return ModelPlan(
        config=config,
        dtype=draw(dtypes_on_device(DTYPES), label="dtype"),
        batch=draw(
            kvsizes.batches(small_max=3, room=attention_room(config, EDGE + 3)), label="batch"
        ),
        chunks=tuple(draw(chunk_plans(EDGE + 1, min_chunks=1, max_chunks=3), label="chunks")),
        layer=draw(st.integers(0, config.num_layers - 1), label="layer"),
        token_seed=draw(st.integers(0, 2**16), label="token seed"),
    )


# Shrunk counterexamples of the mutant catalogue (tests/mutants), pinned with @example on
# the core properties: small, and each at an edge where a real cache broke.
_tiny = ModelConfig(vocab_size=11, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4, seed=3)
PINNED = (
    # ResetKeepsChunks: a reset after a full chunk, then a prompt; AttendPositionsSurviveReset:
    # of two tokens, so that a query placed late after the reset sees the token after it.
    Scenario(
        _tiny,
        1,
        torch.float64,
        (Session((1, EDGE), 1, "fresh"), Session((2,), 2, "reset")),
    ),
    # DropsFullLastChunk: a prompt of exactly one chunk.
    Scenario(_tiny, 1, torch.float64, (Session((EDGE,), 3, "fresh"),)),
    # WrapsPast48: one token past 48.
    Scenario(_tiny, 1, torch.float64, (Session((1, 47, 1), 4, "fresh"),)),
)
