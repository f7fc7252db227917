"""Moves between layouts (docs/contract.md, section 11.2): disaggregated prefill and decode.

A plan draws a model, a script of events on one request (``kvcheck.scripts``: feeds,
truncates, reorders, forks, resets) with moves in it, and the layout each move goes to: the
cache as given, its pool with another block size (where it has ``with_block_size``), or the
kit's reference cache, the cache under test at one end of every move at least. At a move
the session engine exports every layer's rows (held to the rows given, bit for bit), builds
the next layout's caches, imports them there, and the request goes on: every step's logits
are held to the uncached model, the pool left must have every block back.

- ``move``: caches that offer ``export_rows`` and ``import_rows``.
- ``bad import``: rows of another batch, heads, width, dtype or device, more rows than
  their length or fewer than the next query needs, a length that is no int, not a
  ``CacheRows``, or into a cache that holds tokens: refused, changing nothing.
"""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import strategies as st

from kvcheck import asserts as kvassert
from kvcheck import badinput as kvbad
from kvcheck import devices as kvdevices
from kvcheck import failures, reach, scripts
from kvcheck import layouts as kvlayouts
from kvcheck import sizes as kvsizes
from kvcheck import strategies as kvst
from kvcheck import tensors as kvtensors
from kvcheck.harness import build, warm
from kvcheck.kit import KitTests, Property, path_for, property_test
from kvcheck.plan_events import Feed, Fork, Move, Truncate
from kvcheck.properties.rejection import check_refused, every_import
from kvcheck.session import Engine
from kvref import BlockPool, CacheFactory, CacheRows, ModelConfig
from kvref.reprs import short_repr

MOST_TOKENS = 2 * kvst.EDGE + 4
EVENTS = ("feed", "truncate", "reorder", "reset")  # forks only after the last move
BLOCK_SIZES = (1, 2, 3, 5, 8, 16, 32)


@short_repr
@dataclasses.dataclass(frozen=True)
class MovePlan:
    """A model, a batch and a dtype, the layouts a request lives on in turn (the first
    where it starts) and the path the model takes on each, and a script with its moves."""

    config: ModelConfig
    batch: int
    dtype: torch.dtype
    layouts: tuple
    paths: tuple[str, ...]
    events: tuple[tuple, ...]
    token_seed: int
    # Whether the rows of each move go through the CPU on their way, where the kit's device
    # is another (on the CPU they stay where they are).
    through_cpu: tuple[bool, ...] = ()

    def describe(self) -> str:
        layouts = "; ".join(
            f"{n}: {kvlayouts.said(layout)} ({path} path)"
            for n, (layout, path) in enumerate(zip(self.layouts, self.paths, strict=True))
        )
        return (
            f"move plan: batch {self.batch}, {kvdevices.dtype_name(self.dtype)}\n"
            f"  model: {kvst.describe_config(self.config)}\n  layouts: {layouts}\n"
            f"  events: {', '.join(event.describe() for event in self.events)}"
        )

    def summary(self) -> tuple[str, str, str]:
        tokens = scripts.fed(self.events)
        return (
            f"{tokens} ({len(self.layouts) - 1} moves)",
            str(self.config.num_layers),
            str(self.batch),
        )


@st.composite
def layouts(draw, count: int) -> tuple:
    """``count`` layouts, the cache under test at one end of every move at least, each
    of another block size or the reference; resolved against the factory when run."""
    sizes = kvsizes.domain().pages or BLOCK_SIZES
    chosen = [kvlayouts.THE_CACHE]
    for _ in range(count - 1):
        options = [kvlayouts.THE_CACHE, *(("block size", size) for size in sizes)]
        if chosen[-1] != kvlayouts.REFERENCE:
            options.append(kvlayouts.REFERENCE)
        chosen.append(draw(st.sampled_from(options), label="layout"))
    return tuple(chosen)


@st.composite
def move_plans(draw) -> MovePlan:
    moved = draw(st.integers(1, 3), label="moves")
    batch = draw(kvsizes.batches(small_max=3), label="batch")
    script = list(draw(scripts.events(EVENTS, MOST_TOKENS, batch, moves=moved), label="events"))
    if draw(st.booleans(), label="fork after the last move"):
        script.extend((Fork(0, 1), Feed(1, 1), Feed(0, 1)))
    return MovePlan(
        config=draw(kvst.model_configs(max_layers=2, tokens=MOST_TOKENS), label="config"),
        batch=batch,
        dtype=draw(kvst.dtypes_on_device(kvst.WITH_HALF), label="dtype"),
        layouts=draw(layouts(moved + 1), label="layouts"),
        paths=tuple(
            draw(st.sampled_from(("append", "attend")), label="path") for _ in range(moved + 1)
        ),
        events=tuple(script),
        token_seed=draw(st.integers(0, 2**16), label="token seed"),
        through_cpu=tuple(draw(st.booleans(), label="through the CPU") for _ in range(moved)),
    )


def resolved(factory: CacheFactory, plan: MovePlan) -> list[tuple[CacheFactory, str]]:
    """Each layout's factory and path for ``factory``: a block size it cannot take (not a
    pool with ``with_block_size``) is the cache itself, the reference where the cache keeps
    keys unrotated (the reference keeps them rotated) is too; a path it lacks is append."""
    pool = isinstance(factory, BlockPool) and callable(getattr(factory, "with_block_size", None))
    probe = build(factory, kvtensors.build_model(plan.config, plan.dtype).cache_spec(1, 8))
    out = []
    for layout, path in zip(plan.layouts, plan.paths, strict=True):
        if (isinstance(layout, tuple) and not pool) or (
            layout == kvlayouts.REFERENCE and not kvlayouts.reference_fits(factory, probe)
        ):
            layout = kvlayouts.THE_CACHE
        made = kvlayouts.factory_of(factory, layout)
        reference = made is kvlayouts.ReferenceRows
        out.append((made, "append" if reference else path_for(path, made)))
    return out


def through_the_cpu(rows: CacheRows) -> CacheRows:
    """``rows`` copied to the CPU and back to the kit's device (disaggregated serving's
    transfer through host memory)."""
    device = kvdevices.current()
    moved = (rows.keys.cpu().to(device), rows.values.cpu().to(device))
    return dataclasses.replace(rows, keys=moved[0], values=moved[1])


TO_BLOCK_SIZE = "move to a pool of another block size"
AT_BLOCK_END = "move of a length that ends a block"
INSIDE_BLOCK = "move of a length that ends inside a block"
TO_REFERENCE = "move to the kit's reference cache"
FROM_REFERENCE = "move from the kit's reference cache"
AFTER_WRAP = "move after a window's ring wrapped"
AFTER_REORDER = "move right after a reorder"
AFTER_TRUNCATE = "move right after a truncate"
BACK_TO_BACK = "two moves back to back"
MOVES_CODES = "rows in codes moved to another layout"  # contract, 10.1

MOVE_EDGES = (
    reach.Edge(MOVES_CODES, needs=("move", "lossy storage")),
    reach.Edge(TO_BLOCK_SIZE, needs=("move", "block pool")),
    reach.Edge(AT_BLOCK_END, needs=("move", "block pool")),
    reach.Edge(INSIDE_BLOCK, needs=("move", "block pool")),
    reach.Edge(TO_REFERENCE, needs=("move",)),
    reach.Edge(FROM_REFERENCE, needs=("move",)),
    reach.Edge(AFTER_WRAP, needs=("move",)),
    reach.Edge(AFTER_REORDER, needs=("move", "reorder")),
    reach.Edge(AFTER_TRUNCATE, needs=("move", "truncate")),
    reach.Edge(BACK_TO_BACK, needs=("move",)),
)


def move_edges(plan: MovePlan, ends: list, layout: int, held: int, last: str) -> dict:
    """Each edge of the move to ``layout`` of ``held`` tokens (the event before it ``last``),
    with whether it reaches it."""
    (source, _), (target, _) = ends[layout - 1], ends[layout]
    size, to_size = getattr(source, "block_size", None), getattr(target, "block_size", None)
    windows = {plan.config.layer_window(n) for n in range(plan.config.num_layers)} - {None}
    return {
        TO_BLOCK_SIZE: None not in (size, to_size) and size != to_size,
        AT_BLOCK_END: size is not None and held > 0 and held % size == 0,
        INSIDE_BLOCK: size is not None and held % size != 0,
        TO_REFERENCE: target is kvlayouts.ReferenceRows,
        FROM_REFERENCE: source is kvlayouts.ReferenceRows,
        AFTER_WRAP: any(held > w for w in windows),
        AFTER_REORDER: last == "reorder",
        AFTER_TRUNCATE: last == "truncate",
        BACK_TO_BACK: last == "move",
    }


def check_moves(factory: CacheFactory, plan: MovePlan) -> None:
    """Every step of the script, on each layout in turn, gives the uncached model's logits;
    each export holds the rows given; the pool a request leaves gets every block back."""
    model = kvtensors.build_model(plan.config, plan.dtype)
    ends = resolved(factory, plan)
    first, path = ends[0]
    engine = Engine(first, model, max_length=MOST_TOKENS + 1, path=path, describe=plan.describe)
    moves = [step for step, event in enumerate(plan.events) if isinstance(event, Move)]

    def move(request, layout: int, at: str) -> None:
        before = scripts.kind_of(plan.events[moves[layout - 1] - 1])  # never the first event
        edges = move_edges(plan, ends, layout, request.held, before)
        reach.note(*(name for name, reached in edges.items() if reached))
        if any(any(cache.quantized_below) for cache in request.caches):
            reach.note(MOVES_CODES)
        made, path = ends[layout]
        if plan.through_cpu[layout - 1 : layout] == (True,):
            engine.move(request, made, path=path, carry=through_the_cpu, at=f"{at}, via the CPU")
        else:
            engine.move(request, made, path=path, at=at)

    scripts.play(engine, plan.events, plan.batch, plan.token_seed, move=move)


def check_bad_import(factory: CacheFactory, plan: kvst.CachePlan, case: kvbad.BadInput) -> None:
    """``case``'s rows, imported into a fresh cache (into the plan's warm one, for an import
    into a cache that holds tokens), are refused as the contract says and change nothing."""
    if case is kvbad.BAD_IMPORTS[0]:
        check_refused(factory, plan, case, "import_rows", lambda cache: case.make(plan.spec))
        return
    if not case.applies(plan.spec):  # no such input for this spec; others draw it
        return
    empty = dataclasses.replace(plan, chunks=())
    if case.may_be_accepted:  # an import past max_length: refused, or held whole
        check_import_held_or_refused(factory, empty, case)
        return
    check_refused(factory, empty, case, "import_rows", lambda cache: case.make(plan.spec))


def check_import_held_or_refused(factory, plan: kvst.CachePlan, case: kvbad.BadInput) -> None:
    """Rows past max_length: refused (changing nothing), or taken and then held exactly."""
    cache = warm(factory, plan)
    (rows,) = case.make(plan.spec)
    error = kvassert.raised_by(lambda: cache.cache.import_rows(rows))
    where = plan.describe()
    if kvassert.assert_refused(error, case, where=where):
        kvassert.assert_unchanged(cache, plan.spec, who="the cache", where=where, case=case)
        kvassert.assert_clear_error(error, case, (rows,), where=where)
        return
    cache.hold_given((rows.keys, rows.values))  # in codes, but for the recent, if it codes
    kvassert.assert_length(cache, rows.length, who="the cache", where=where)
    kvassert.assert_exported(cache, cache.cache.export_rows(), who="the cache", where=where)


# Tried first on every run: a prefill ending inside a 16-token block, moved to a pool of
# 3-token blocks, a decode, moved to the reference and back, a decode and a truncate.
ACROSS_BLOCK_SIZES = MovePlan(
    config=ModelConfig(vocab_size=23, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4),
    batch=2,
    dtype=torch.float64,
    layouts=(kvlayouts.THE_CACHE, ("block size", 3), kvlayouts.REFERENCE, kvlayouts.THE_CACHE),
    paths=("append", "attend", "append", "attend"),
    events=(
        Feed(0, 19),
        Move(0, 1),
        Feed(0, 1),
        Move(0, 2),
        Feed(0, 2),
        Move(0, 3),
        Feed(0, 1),
        Truncate(0, 2),
        Feed(0, 1),
    ),
    token_seed=11,
)

MOVE = Property(
    "move",
    "a request prefilled on one layout and moved (another block size, the kit's reference "
    "cache) decodes on the next as the uncached model does",
    check_moves,
    move_plans(),
    failures.WRONG_RESULTS,
    requires=("move",),
    pinned=(ACROSS_BLOCK_SIZES,),
    reaches=MOVE_EDGES,
    since="1.5",
    holds=(
        "a request prefilled on one layout and moved, up to three times, to another (the pool with "
        "another block size where it has `with_block_size`, the kit's reference cache, the cache "
        "again): every export holds the rows given bit for bit, every step's logits equal the "
        "uncached model's, the pool left gets every block back (contract, section 11.2; caches with"
        " `export_rows` and `import_rows`)"
    ),
)
BAD_IMPORT = Property(
    "bad import",
    "an import of rows of another shape, dtype, device or length, or into a cache that holds "
    "tokens, is refused, changing nothing",
    check_bad_import,
    kvst.cache_plans(room=1, min_chunks=1),
    failures.ACCEPTS_BAD_INPUT,
    cases=tuple(kvbad.BAD_IMPORTS),
    requires=("move",),
    examples_share=0.25,
    since="1.5",
    every_plan=every_import,
    exhaustive_tokens=8,
    holds=(
        "rows of another batch, kv heads, width, dtype or device, more rows than their length, "
        "fewer than the next query needs, a length that is no int, not a `CacheRows`, or into a "
        "cache that holds tokens: refused, changing nothing"
    ),
)


class MoveTests(KitTests):
    """Moves between layouts, for caches that offer export_rows and import_rows."""

    test_moved_requests_decode_as_the_uncached_model = property_test(MOVE)
    test_bad_import_is_refused_and_changes_nothing = property_test(BAD_IMPORT)
