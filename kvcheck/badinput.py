"""Tables of bad input, and what counts as an error message that names the problem.

``BAD_APPENDS`` lists bad ``LayerCache.append`` calls, each made from good (key, value)
tensors. ``BAD_CALLS`` lists bad calls of the reference model with caches, each made from a
``ModelState``. The properties apply them to warm caches and then read the caches back.

The contract asks for a ``ValueError`` (or a subclass; ``TypeError`` too for an argument
that is not a tensor) whose message names the problem in the implementer's own words. The
suite never checks wording: a message passes when it names the axis or quantity in any
usual wording (``words``) or shows an offending value (``shows``: the bad shape, dtype,
device or type name). It fails only when empty or about something else entirely.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from kvcheck import contract
from kvcheck.asserts import dtype_name
from kvcheck.harness import Recorder, builder, record, recorded
from kvcheck.strategies import ModelPlan
from kvcheck.tensors import as_values, build_model, random_rows
from kvref import CacheFactory, CacheRows, CacheSpec, ReferenceTransformer


def _nothing(_bad: Any) -> Iterable[str]:
    return ()


def _always(_state: Any) -> bool:
    return True


@dataclass(frozen=True)
class BadInput:
    """One kind of bad input: how to make it, and what a refusal of it must look like."""

    name: str
    make: Callable[..., tuple]  # good arguments -> bad ones (each table says which)
    words: str  # regex (case-insensitive): the problem named in any usual wording
    shows: Callable[[tuple], Iterable[str]] = field(default=_nothing)  # regexes of bad values
    errors: tuple[type[Exception], ...] = (ValueError,)
    # Accepting it is fine too, if the cache is then as the contract says (unchanged for
    # zero new tokens, holding everything for an append past max_length).
    may_be_accepted: bool = False
    # Whether the input is bad at all in a given state (a model call may need two layers).
    applies: Callable[[Any], bool] = field(default=_always)
    # The contract version the case arrived in (kvcheck.contract): never a default, set for
    # a whole table by arrived_in, which every table is built with.
    since: str | None = None

    def __str__(self) -> str:
        return self.name

    def named_in(self, message: str, bad: tuple) -> bool:
        """Whether ``message`` names this problem or shows one of its offending values."""
        if re.search(self.words, message, re.IGNORECASE):
            return True
        return any(re.search(pattern, message) for pattern in self.shows(bad))


def arrived_in(version: str, cases: list[BadInput]) -> list[BadInput]:
    """A table of cases that arrived together in contract ``version``."""
    if version not in contract.VERSIONS:
        raise ValueError(
            f"bad-input cases arrived in {version!r}, no version of the contract "
            f"(kvcheck.contract.VERSIONS: {', '.join(contract.VERSIONS)})"
        )
    return [dataclasses.replace(case, since=version) for case in cases]


def shape_pattern(shape: Iterable[int]) -> str:
    """A regex for a shape printed any usual way: (1, 2, 3), [1, 2, 3], 1x2x3, torch.Size."""
    return r"\b" + r"\D{1,4}".join(str(size) for size in shape) + r"\b"


def shapes_of(*which: int) -> Callable[[tuple], list[str]]:
    """The shapes of the bad arguments at ``which`` (0 key, 1 value), as ``shows``: whole,
    or without the token axis, as in "(B, H, D): expected (1, 1, 2), got (2, 1, 2)"."""

    def shows(bad: tuple) -> list[str]:
        shapes = [tuple(bad[i].shape) for i in which if isinstance(bad[i], Tensor)]
        without_tokens = [shape[:2] + shape[3:] for shape in shapes if len(shape) == 4]
        return [shape_pattern(shape) for shape in [*shapes, *without_tokens]]

    return shows


def dtypes_of(bad: tuple) -> list[str]:
    return [re.escape(dtype_name(t.dtype)) for t in bad if isinstance(t, Tensor)]


def other_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype == torch.float64 else torch.float64


def other_half(dtype: torch.dtype) -> torch.dtype:
    """float16, the dtype a half-precision caller slips in, unless the cache holds it."""
    return torch.bfloat16 if dtype == torch.float16 else torch.float16


def other_device(device: torch.device) -> torch.device:
    """A device a caller may hand a cache on ``device`` by mistake: the CPU for an
    accelerator's cache; for a CPU cache, ``meta`` (shape and dtype without values)."""
    return torch.device("meta" if device.type == "cpu" else "cpu")


def grow(tensor: Tensor, axis: int) -> Tensor:
    """One more entry along ``axis``: a copy of the first."""
    return torch.cat((tensor, tensor.narrow(axis, 0, 1)), dim=axis)


def sizes_of(axis: int) -> Callable[[tuple], list[str]]:
    """The bad key's size along ``axis`` compared with the size it should have (one less),
    in either order, as in "B=2!=1" or "3 vs 2"."""

    def shows(bad: tuple) -> list[str]:
        if not isinstance(bad[0], Tensor) or bad[0].ndim <= axis:
            return []
        got = bad[0].shape[axis]
        return [compared(got, got - 1)]

    return shows


def compared(got: int, wanted: int) -> str:
    """A regex for two numbers side by side with a comparison between them, either order."""
    between = r"\s*(?:!=|=/=|≠|<>|>|<|vs\.?|versus|instead of|but|,|/)\s*"
    number = r"(?<![\d.]){}(?![\d.])"
    pairs = ((got, wanted), (wanted, got))
    return "|".join(number.format(a) + between + number.format(b) for a, b in pairs)


def both_numbers(*numbers: int) -> str:
    """A regex for a message that shows each of ``numbers`` somewhere."""
    return "".join(rf"(?=.*(?<![\d.]){re.escape(str(number))}(?![\d.]))" for number in numbers)


def either(*shows: Callable[[tuple], list[str]]) -> Callable[[tuple], list[str]]:
    return lambda bad: [pattern for show in shows for pattern in show(bad)]


def cased(symbol: str) -> str:
    """A symbol that counts only in its own case (B, H, D, T), as a word of its own."""
    return rf"(?-i:(?<![A-Za-z_]){symbol}(?![A-Za-z]))"


RANK = r"rank|ndim|\bdims?\b|dimension|\d-?d\b|ax[ie]s"
NOT_A_TENSOR = r"tensor|list|tuple|type"
NOT_A_TENSOR_ERRORS = (TypeError, ValueError)
BATCH = rf"batch|{cased('B')}"


def overflow(max_length: int, rows: int) -> BadInput:
    """An append of ``rows`` tokens past ``max_length``: the one bad input a cache may also
    take, by growing. Its message may show either number instead of naming the problem."""
    return BadInput(
        "append past max_length",
        lambda k, v: (k, v),
        r"overflow|capacity|max_length|max length|maximum|exceed|full|room|space|limit|"
        r"too many|too long|beyond|more than|at most|out of",
        lambda bad: [both_numbers(max_length), both_numbers(rows)],
        may_be_accepted=True,
    )


# make(key, value) -> (bad key, bad value). "shape" or "size" alone names nothing: a shape
# counts when it is shown.
BAD_APPENDS = arrived_in(
    "1.0",
    [
        BadInput("key of rank 3", lambda k, v: (k[..., 0], v), RANK, shapes_of(0)),
        BadInput("value of rank 5", lambda k, v: (k, v[None]), RANK, shapes_of(1)),
        BadInput(
            "value with one token more than key",
            lambda k, v: (k, grow(v, 2)),
            rf"differ|mismatch|match|!=|same|equal|length|tokens?\b|{cased('T')}",
            shapes_of(0, 1),
        ),
        BadInput(
            "wrong batch",
            lambda k, v: (grow(k, 0), grow(v, 0)),
            BATCH,
            either(shapes_of(0), sizes_of(0)),
        ),
        BadInput(
            "wrong kv_heads",
            lambda k, v: (grow(k, 1), grow(v, 1)),
            rf"kv.?heads?|heads|{cased('H')}|{cased('H_kv')}",
            either(shapes_of(0), sizes_of(1)),
        ),
        BadInput(
            "wrong head_dim",
            lambda k, v: (grow(k, 3), grow(v, 3)),
            rf"head.?dim|head.?size|\bdim\b|width|{cased('D')}",
            either(shapes_of(0), sizes_of(3)),
        ),
        BadInput(
            "value of another width than its spec's",
            lambda k, v: (k, grow(v, 3)),
            rf"differ|mismatch|match|!=|same|equal|width|head.?dim|\bdim\b|value.?dim|{cased('D')}",
            shapes_of(1),
        ),
        BadInput(
            "zero new tokens",
            lambda k, v: (k[:, :, :0], v[:, :, :0]),
            rf"zero|empty|nothing|no tokens|at least|length|{cased('T')}|(?<![\d.])0(?![\d.])",
            shapes_of(0),
            may_be_accepted=True,
        ),
        BadInput(
            "wrong dtype",
            lambda k, v: (k.to(other_dtype(k.dtype)), v.to(other_dtype(v.dtype))),
            r"dtype|type|precision",
            dtypes_of,
        ),
        BadInput(
            "wrong dtype of value only",
            lambda k, v: (k, v.to(other_half(v.dtype))),
            r"dtype|type|precision",
            dtypes_of,
        ),
        BadInput(
            "wrong device",
            lambda k, v: (k.to(other_device(k.device)), v.to(other_device(v.device))),
            r"device|meta|cpu|cuda|place",
        ),
        BadInput(
            "key not a tensor",
            lambda k, v: (k.tolist(), v),
            NOT_A_TENSOR,
            errors=NOT_A_TENSOR_ERRORS,
        ),
        BadInput(
            "value not a tensor",
            lambda k, v: (k, tuple(v.flatten().tolist())),
            NOT_A_TENSOR,
            errors=NOT_A_TENSOR_ERRORS,
        ),
    ],
)


def query_shape(bad: tuple) -> list[str]:
    """The bad query's shape (argument 0), as ``shows``."""
    return [shape_pattern(bad[0].shape)] if isinstance(bad[0], Tensor) else []


def shows_scale(bad: tuple) -> list[str]:
    """The bad scale (argument 3) as printed, as ``shows``."""
    return [re.escape(str(bad[3]))]


QUERY_WORDS = rf"query|width|head.?dim|\bdim\b|{cased('D')}|channels?|latent|rope"
# make(query, key, value, scale) -> bad arguments of attend_latent (contract, section 10.2):
# the rows good, the query or the scale not.
BAD_LATENT_ATTENDS = arrived_in(
    "1.6",
    [
        BadInput(
            "query one channel too wide",
            lambda q, k, v, s: (grow(q, 3), k, v, s),
            QUERY_WORDS,
            query_shape,
        ),
        BadInput(
            "query of the rope width alone",
            lambda q, k, v, s: (q[..., -k.shape[3] :], k, v, s),
            QUERY_WORDS,
            query_shape,
        ),
        BadInput(
            "query of another batch",
            lambda q, k, v, s: (grow(q, 0), k, v, s),
            rf"{BATCH}|query",
            query_shape,
        ),
        BadInput(
            "query of another T than the key",
            lambda q, k, v, s: (grow(q, 2), k, v, s),
            rf"tokens?\b|{cased('T')}|length|match|query",
            query_shape,
        ),
        BadInput(
            "query of another dtype",
            lambda q, k, v, s: (q.to(other_dtype(q.dtype)), k, v, s),
            r"dtype|type|precision",
            dtypes_of,
        ),
        BadInput(
            "query not a tensor",
            lambda q, k, v, s: (q.tolist(), k, v, s),
            NOT_A_TENSOR,
            errors=NOT_A_TENSOR_ERRORS,
        ),
        BadInput("scale of 0", lambda q, k, v, s: (q, k, v, 0.0), r"scale|positive", shows_scale),
        BadInput(
            "scale nan",
            lambda q, k, v, s: (q, k, v, float("nan")),
            r"scale|finite|nan",
            shows_scale,
        ),
        BadInput(
            "rope key one channel too wide",
            lambda q, k, v, s: (q, grow(k, 3), v, s),
            rf"head.?dim|\bdim\b|width|rope|key|{cased('D')}",
            shapes_of(1),
        ),
    ],
)


@dataclass
class ModelState:
    """A model, its recorded caches after a prefill and some decode steps, good next tokens,
    and one more cache from the same factory that was never used."""

    model: ReferenceTransformer
    caches: list[Recorder]
    spare: Recorder
    spec: CacheSpec
    tokens: Tensor
    layer: int  # the layer a case may make inconsistent

    def describe(self) -> str:
        """The caches as they are now: after a case's ``make``, layers may differ."""
        lengths = [cache.given_length for cache in self.caches]
        held = (
            f"holding {lengths[0]} tokens each"
            if len(set(lengths)) == 1
            else f"holding {lengths} tokens (layer by layer)"
        )
        return (
            f"{len(self.caches)} layers {held} (caches built for {self.spec}); the layer a "
            f"case may lengthen or empty: {self.layer}"
        )


def build_model_state(factory: CacheFactory, plan: ModelPlan) -> ModelState:
    model = build_model(plan.config, plan.dtype)
    fed = sum(plan.chunks)
    # Room for a bad call that lengthens one layer, then one more token to read back.
    built = model.new_caches(builder(factory), batch=plan.batch, max_length=fed + 3)
    caches = record(built, plan.config)
    generator = torch.Generator().manual_seed(plan.token_seed)
    history = torch.randint(0, plan.config.vocab_size, (plan.batch, fed + 2), generator=generator)
    history = history.to(model.device)
    start = 0
    for size in plan.chunks:
        model(history[:, start : start + size], caches=caches)
        start += size
    spec = model.cache_spec(plan.batch, max_length=fed + 3)
    return ModelState(model, caches, recorded(factory, spec), spec, history[:, start:], plan.layer)


def with_token(tokens: Tensor, token: int) -> Tensor:
    bad = tokens.clone()
    bad[-1, -1] = token
    return bad


def lengthen(state: ModelState) -> list[Recorder]:
    row = random_rows(state.spec, 1, seed=1)
    state.caches[state.layer].append(row, as_values(state.spec, row))
    return state.caches


def empty(state: ModelState) -> list[Recorder]:
    state.caches[state.layer].reset()
    return state.caches


# make(state) -> (token ids, caches) for ``state.model(token_ids, caches=caches)``. All but
# one are refused by the reference model itself, so these words are the model's.
def two_layers(state: ModelState) -> bool:
    return len(state.caches) >= 2


def two_warm_layers(state: ModelState) -> bool:
    return two_layers(state) and state.caches[0].length > 0


BAD_CALLS = arrived_in(
    "1.0",
    [
        BadInput("one cache too few", lambda s: (s.tokens, s.caches[:-1]), r"number"),
        BadInput("one cache too many", lambda s: (s.tokens, [*s.caches, s.spare]), r"number"),
        BadInput(
            "one object for two layers",
            lambda s: (s.tokens, [s.caches[0], *s.caches[:-1]]),
            r"same",
            applies=two_layers,
        ),
        BadInput(
            "layers of different lengths",
            lambda s: (s.tokens, lengthen(s)),
            r"length",
            applies=two_layers,
        ),
        BadInput(
            "some layers empty, some not",
            lambda s: (s.tokens, empty(s)),
            r"empty",
            applies=two_warm_layers,
        ),
        # Refused by the model when a cache exposes its spec, else by layer 0's own append,
        # which may show the batch it got and the one it was built for.
        BadInput(
            "caches built for another batch size",
            lambda s: (grow(s.tokens, 0), s.caches),
            BATCH,
            lambda bad: [
                compared(len(bad[0]), len(bad[0]) - 1),
                rf"(?<![\d.]){len(bad[0])}(\D{{1,4}}\d+){{3}}",  # the key's shape (B + 1, H, T, D)
            ],
        ),
        BadInput("token ids of rank 1", lambda s: (s.tokens[0], s.caches), r"rank"),
        BadInput("token ids of rank 3", lambda s: (s.tokens[None], s.caches), r"rank"),
        BadInput("float token ids", lambda s: (s.tokens.double(), s.caches), r"dtype"),
        BadInput("uint8 token ids", lambda s: (s.tokens.byte(), s.caches), r"dtype"),
        BadInput(
            "token id past the vocabulary",
            lambda s: (with_token(s.tokens, s.model.config.vocab_size), s.caches),
            r"vocabulary",
        ),
        BadInput(
            "negative token id", lambda s: (with_token(s.tokens, -1), s.caches), r"vocabulary"
        ),
        BadInput("no token ids", lambda s: (s.tokens[:, :0], s.caches), r"empty"),
        BadInput(
            "token ids not a tensor",
            lambda s: (s.tokens.tolist(), s.caches),
            r"[Tt]ensor",
            errors=(TypeError,),
        ),
    ],
)


# make(cache length) -> the length argument of ``truncate``
BAD_TRUNCATES = arrived_in(
    "1.0",
    [
        BadInput(
            "negative length",
            lambda held: (-1,),
            r"length|negative|range|between|>=|at least|position",
            lambda bad: [both_numbers(bad[0])],
        ),
        BadInput(
            "past the length held",
            lambda held: (held + 1,),
            r"length|range|between|<=|at most|exceed|held|position|beyond|more than",
            lambda bad: [both_numbers(bad[0])],
        ),
        BadInput(
            "not an int",
            lambda held: (held / 2 + 0.5,),
            r"int|type|float|length",
            lambda bad: [both_numbers(bad[0])],
            errors=NOT_A_TENSOR_ERRORS,
        ),
    ],
)
REORDER_WORDS = r"indices|index|dtype|int64|long|shape|size|batch|range|device|tensor|between"

# make(spec) -> the indices argument of ``reorder``, for a batch of spec.batch rows
BAD_REORDERS = arrived_in(
    "1.0",
    [
        BadInput(
            "int32 indices",
            lambda s: (torch.zeros(s.batch, dtype=torch.int32, device=s.device),),
            REORDER_WORDS,
        ),
        BadInput(
            "float indices", lambda s: (torch.zeros(s.batch, device=s.device),), REORDER_WORDS
        ),
        BadInput(
            "one index too many",
            lambda s: (torch.zeros(s.batch + 1, dtype=torch.long, device=s.device),),
            REORDER_WORDS,
            shapes_of(0),
        ),
        BadInput(
            "indices of rank 2",
            lambda s: (torch.zeros(s.batch, 1, dtype=torch.long, device=s.device),),
            REORDER_WORDS,
            shapes_of(0),
        ),
        BadInput(
            "index past the batch",
            lambda s: (torch.full((s.batch,), s.batch, dtype=torch.long, device=s.device),),
            REORDER_WORDS,
        ),
        BadInput(
            "negative index",
            lambda s: (torch.full((s.batch,), -1, dtype=torch.long, device=s.device),),
            REORDER_WORDS,
        ),
        BadInput(
            "indices on another device",
            lambda s: (
                torch.zeros(s.batch, dtype=torch.long, device=other_device(torch.device(s.device))),
            ),
            REORDER_WORDS + "|meta|cpu|cuda",
        ),
        BadInput(
            "indices not a tensor",
            lambda s: ([0] * s.batch,),
            NOT_A_TENSOR,
            errors=NOT_A_TENSOR_ERRORS,
        ),
    ],
)


def good_rows(spec: CacheSpec, rows: int, length: int | None = None) -> CacheRows:
    """Rows a fresh cache for ``spec`` may import: ``rows`` of them, ending at ``length``."""
    keys = random_rows(spec, rows, seed=rows)
    return CacheRows(keys, as_values(spec, keys), rows if length is None else length)


def _resized(spec: CacheSpec, axis: int, which: str = "both") -> tuple:
    rows = good_rows(spec, 2)
    keys = grow(rows.keys, axis) if which in ("both", "keys") else rows.keys
    values = grow(rows.values, axis) if which in ("both", "values") else rows.values
    return (CacheRows(keys, values, rows.length),)


def _moved(spec: CacheSpec, how: Callable[[Tensor], Tensor]) -> tuple:
    rows = good_rows(spec, 2)
    return (CacheRows(how(rows.keys), how(rows.values), rows.length),)


def _too_few(spec: CacheSpec) -> tuple:
    """One row fewer than the next query needs, for a length past the window: all of them
    without one, else the window's last W - 1."""
    length = 3 if spec.window is None else spec.window + 3
    return (good_rows(spec, spec.rows_needed(length) - 1, length),)


# make(spec) -> the argument of ``import_rows`` on a fresh cache for spec (the first case: on
# a warm one); contract, section 11.2
BAD_IMPORTS = arrived_in(
    "1.5",
    [
        BadInput(
            "into a cache that holds tokens",
            lambda s: (good_rows(s, 1),),
            r"empty|holds|held|already|reset|fresh|length|tokens",
        ),
        BadInput("rows of another batch", lambda s: _resized(s, 0), BATCH, shapes_of(0)),
        BadInput(
            "rows of another number of kv heads",
            lambda s: _resized(s, 1),
            r"kv_heads|heads|H_kv|shape|size",
        ),
        BadInput(
            "keys of another head_dim", lambda s: _resized(s, 3, "keys"), r"head_dim|dim|width"
        ),
        BadInput(
            "values of another width", lambda s: _resized(s, 3, "values"), r"value|dim|width|shape"
        ),
        BadInput(
            "rows of another dtype",
            lambda s: _moved(s, lambda t: t.to(other_dtype(t.dtype))),
            r"dtype|float|type",
        ),
        BadInput(
            "rows on another device",
            lambda s: _moved(s, lambda t: t.to(other_device(t.device))),
            r"device|meta|cpu|cuda",
        ),
        BadInput(
            "more rows than its length",
            lambda s: (good_rows(s, 3, 2),),
            r"rows|length|more|exceed",
        ),
        BadInput(
            "fewer rows than the next query needs",
            _too_few,
            r"rows|length|needs|fewer|last",
            applies=lambda s: s.window is None or s.window > 1,  # a window of 1 needs no row
        ),
        BadInput(
            "a length that is not an int",
            lambda s: (dataclasses.replace(good_rows(s, 2), length=2.5),),
            r"int|length|type",
            errors=NOT_A_TENSOR_ERRORS,
        ),
        BadInput(
            "not a CacheRows",
            lambda s: ((good_rows(s, 2).keys, good_rows(s, 2).values),),
            r"CacheRows|type|tuple|rows",
            errors=NOT_A_TENSOR_ERRORS,
        ),
        BadInput(
            "a length past max_length",
            lambda s: (good_rows(s, s.max_length + 2),),
            r"max_length|capacity|overflow|exceed|length|room",
            may_be_accepted=True,  # a cache that grows takes it (rule 4)
        ),
    ],
)


# --- tree drafts (contract, section 9.2) --------------------------------------------------
@dataclass(frozen=True)
class BadTreeCall(BadInput):
    """A bad ``append_tree`` or ``commit_tree``, sent at one moment of a tree's round (``when``:
    "before" the tree is drafted, while it is "waiting" for its commit, or "after" it);
    ``make(call)`` gives (method, arguments) from a ``TreeCall``."""

    when: str = "waiting"


@dataclass(frozen=True)
class TreeCall:
    """What a bad tree call is made from: the round's tree, the batch, whether the cache has
    rows of their own, a layer's node rows (B, H_kv, T, D each) and the paths accepted."""

    parents: tuple[int, ...]
    batch: int
    own_lengths: bool
    keys: Tensor
    values: Tensor
    accepted: tuple[tuple[int, ...], ...]

    @property
    def nodes(self) -> int:
        return len(self.parents)

    def path_to(self, node: int) -> tuple[int, ...]:
        path = [node]
        while self.parents[path[-1]] >= 0:
            path.append(self.parents[path[-1]])
        return tuple(reversed(path))

    def every_row(self, path: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        return (path,) * self.batch

    def deepest(self) -> tuple[int, ...]:
        return max((self.path_to(node) for node in range(self.nodes)), key=len)

    def roots(self) -> list[int]:
        return [node for node, parent in enumerate(self.parents) if parent < 0]

    def with_parent(self, node: int, parent: int) -> tuple[int, ...]:
        parents = list(self.parents)
        parents[node] = parent
        return tuple(parents)

    def draft(self, parents) -> tuple[str, tuple]:
        return "append_tree", (self.keys, self.values, parents)

    def commit(self, accepted) -> tuple[str, tuple]:
        return "commit_tree", (accepted,)


PATH_WORDS = r"path|accept|node|root|parent|child|row|batch|length|sequence|tree|index|range"
PARENT_WORDS = r"parent|node|tree|entr|length|sequence|range|int"
# The moment each case is sent at, and what it sends (contract 9.2: check_tree, check_accepted,
# a second tree before the commit, paths of different lengths on a cache without rows of their
# own; each refused with ValueError, changing nothing). A tree of T nodes is in the round.
BAD_TREE_CALLS = arrived_in(
    "1.3",
    [
        BadTreeCall(
            "commit_tree with no tree drafted",
            lambda c: c.commit(c.every_row(())),
            r"no .*tree|append_tree|waiting|pending|nothing|draft|commit",
            when="before",
        ),
        BadTreeCall(
            "a node its own parent",
            lambda c: c.draft(c.with_parent(c.nodes - 1, c.nodes - 1)),
            PARENT_WORDS,
            when="before",
        ),
        BadTreeCall(
            "a parent after its node",
            lambda c: c.draft(c.with_parent(0, c.nodes - 1)),
            PARENT_WORDS,
            applies=lambda c: c.nodes >= 2,
            when="before",
        ),
        BadTreeCall(
            "a parent below -1",
            lambda c: c.draft(c.with_parent(0, -2)),
            PARENT_WORDS,
            when="before",
        ),
        BadTreeCall(
            "one parent too few",
            lambda c: c.draft(c.parents[:-1]),
            PARENT_WORDS,
            when="before",
        ),
        BadTreeCall(
            "parents not a sequence",
            lambda c: c.draft(7),
            PARENT_WORDS + "|type",
            errors=NOT_A_TENSOR_ERRORS,
            when="before",
        ),
        BadTreeCall(
            "a second append_tree before the commit",
            lambda c: c.draft(c.parents),
            r"commit|wait|already|pending|tree|draft|second|another",
        ),
        BadTreeCall(
            "paths of different lengths on a cache without rows of their own",
            lambda c: c.commit((c.deepest(), *c.every_row(())[1:])),
            r"length|same|differ|one|equal|ragged|row",
            applies=lambda c: c.batch >= 2 and not c.own_lengths,
        ),
        BadTreeCall(
            "accepted paths for one row too few",
            lambda c: c.commit(c.every_row(())[1:]),
            PATH_WORDS,
        ),
        BadTreeCall(
            "accepted paths for one row too many",
            lambda c: c.commit(((), *c.every_row(()))),
            PATH_WORDS,
        ),
        BadTreeCall(
            "a path that starts below a root",
            lambda c: c.commit(c.every_row(c.deepest()[1:])),
            PATH_WORDS,
            applies=lambda c: len(c.deepest()) >= 2,
        ),
        BadTreeCall(
            "a path that skips a node",
            lambda c: c.commit(c.every_row(c.deepest()[:1] + c.deepest()[2:])),
            PATH_WORDS,
            applies=lambda c: len(c.deepest()) >= 3,
        ),
        BadTreeCall(
            "a path from one root to another",
            lambda c: c.commit(c.every_row(tuple(c.roots()[:2]))),
            PATH_WORDS,
            applies=lambda c: len(c.roots()) >= 2,
        ),
        BadTreeCall(
            "a node twice",
            lambda c: c.commit(c.every_row((c.roots()[0],) * 2)),
            PATH_WORDS,
        ),
        BadTreeCall(
            "a node past the tree",
            lambda c: c.commit(c.every_row((*c.path_to(c.nodes - 1)[:-1], c.nodes))),
            PATH_WORDS,
        ),
        BadTreeCall(
            # The last node as -1: a path still, read from the end as Python indexes.
            "a negative node",
            lambda c: c.commit(c.every_row((*c.path_to(c.nodes - 1)[:-1], -1))),
            PATH_WORDS,
        ),
        BadTreeCall(
            "accepted not a sequence",
            lambda c: c.commit(3),
            PATH_WORDS + "|type",
            errors=NOT_A_TENSOR_ERRORS,
        ),
        BadTreeCall(
            "a row's path not a sequence",
            lambda c: c.commit((0,) * c.batch),
            PATH_WORDS + "|type",
            errors=NOT_A_TENSOR_ERRORS,
        ),
        BadTreeCall(
            "a second commit_tree of the same tree",
            lambda c: c.commit(c.accepted),
            r"no .*tree|append_tree|waiting|pending|nothing|draft|commit|again|already",
            when="after",
        ),
    ],
)


def _row_shift(lengths: tuple[int, ...], **rows: tuple[int, int]) -> tuple[tuple, tuple]:
    """A shift per row of rows holding ``lengths``: every row untouched but the longest,
    which discards its first token, and the ``shortest`` row's (start, count) where given."""
    starts, counts = [0] * len(lengths), [0] * len(lengths)
    counts[lengths.index(max(lengths))] = 1
    if "shortest" in rows:
        row = lengths.index(min(lengths))
        starts[row], counts[row] = rows["shortest"]
    return tuple(starts), tuple(counts)


def _short(lengths: tuple[int, ...]) -> int:
    return min(lengths)


ROW_SHIFT_WORDS = r"row|start|count|length|holds|range|index|exceed|past|<=|>="

# make(the rows' lengths, all different, none 0) -> the (starts, counts) of ``shift``, each
# bad for one row only and within the longest row (contract 8.4: each row against its own).
BAD_ROW_SHIFTS = arrived_in(
    "1.6",
    [
        BadInput(
            "one entry too few",
            lambda n: tuple(part[:-1] for part in _row_shift(n)),
            r"row|entr|per row|length|batch|\b\d+\b",
        ),
        BadInput(
            "a start past its row's length",
            lambda n: _row_shift(n, shortest=(_short(n) + 1, 0)),
            ROW_SHIFT_WORDS,
        ),
        BadInput(
            "a negative count",
            lambda n: _row_shift(n, shortest=(0, -1)),
            r"count|negative|>= ?0|range",
        ),
        BadInput(
            "a count past its row's end",
            lambda n: _row_shift(n, shortest=(0, _short(n) + 1)),
            ROW_SHIFT_WORDS,
        ),
        BadInput(
            "an int start beside a tuple of counts",
            lambda n: (0, _row_shift(n)[1]),
            r"int|tuple|both|mix|per row|type|sequence",
            errors=NOT_A_TENSOR_ERRORS,
        ),
        BadInput(
            "every count 0",
            lambda n: ((0,) * len(n), (0,) * len(n)),
            r"count|nothing|no row|zero|at least",
        ),
        BadInput(
            "a float count",
            lambda n: (_row_shift(n)[0], tuple(c + 0.5 if c else c for c in _row_shift(n)[1])),
            r"int|float|type|count",
            errors=NOT_A_TENSOR_ERRORS,
        ),
    ],
)
