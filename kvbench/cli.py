"""Decode cost, memory and scaling of every cache, side by side, on one reference model.

    python -m kvbench                        # every built-in cache at 256, 1024, 4096 tokens
    python -m kvbench --quick --out /tmp/b   # a small model, in seconds
    python -m kvbench --kv-impl preallocated --kv-impl mypkg.caches:MyCache

The rows of one length take turns, a share of the time each per round, so a change in the
machine's load falls on all of them alike. The chunked and paged built-ins are timed with
blocks of ``--block-size`` tokens (default 256): their ``attend`` pays a fixed cost per block.

Beside every built-in (no ``--kv-impl``), the compressed arm: ``quantized`` (int8 codes) on
the same model, and ``latent`` on an MLA model of the same sizes (``latent_config``) with an
ideal of its own, ``ideal (MLA)``. Each is held to the formula of what it declares
(``kvref.min_nbytes`` with its storage, or the MLA model's spec: "x formula"), and before
timing its logits must be within the budget the kit holds its storage to (the lossy one of
``kvcheck.asserts`` for codes, 1e-4 for a latent kept as given).
"""

# The command's --help is this docstring, then each table's module's own, in the order a
# run measures them (help_text): what a table measures is said once, where it is measured.

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

import kvimpl
from kvbench import batch, decode, memory, shared_prefix
from kvbench.report import (
    batch_table,
    describe,
    markdown_table,
    plot,
    requests_table,
    shared_prefix_table,
    write_csv,
)
from kvbench.tables import run
from kvbench.workload import BLOCK_SIZE, FULL, QUICK, QUICK_BLOCK_SIZE
from kvcheck import selection
from kvref import CacheFactory


def _positive(kind: type, text: str):
    try:
        number = kind(text)
    except ValueError:
        number = 0
    if not 0 < number < math.inf:  # also refuses nan
        raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}")
    return number


def _lengths(text: str) -> tuple[int, ...]:
    try:
        lengths = [int(part) for part in text.split(",")]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 2:
        # Length 1 would leave nothing to prefill: the decoded token would be the first.
        raise argparse.ArgumentTypeError(
            f"expected comma-separated context lengths, each >= 2 (e.g. 256,1024), got {text!r}"
        )
    return tuple(sorted(set(lengths)))


def help_text() -> str:
    """What a run measures: this module's docstring, then each table's, in order."""
    tables = (decode, memory, batch, shared_prefix)
    return "\n".join(text.strip() + "\n" for text in (__doc__, *(m.__doc__ for m in tables)))


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, dict[str, CacheFactory]]:
    """The options, and the caches to time by label (every built-in unless --kv-impl)."""
    parser = argparse.ArgumentParser(
        prog="python -m kvbench",
        description=help_text(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--kv-impl",
        action="append",
        default=[],
        metavar="NAME",
        help="cache to time: a built-in name or MODULE:ATTR (repeatable; default: KV_IMPL, "
        "comma-separated, else every built-in)",
    )
    parser.add_argument(
        "--lengths",
        type=_lengths,
        help="comma-separated context lengths (default 256,1024,4096; with --quick 16,64,256)",
    )
    parser.add_argument("--quick", action="store_true", help="a small model, done in seconds")
    parser.add_argument(
        "--block-size",
        type=partial(_positive, int),
        metavar="N",
        help=f"tokens per block of the paged built-in and per chunk of the chunked one (default "
        f"{BLOCK_SIZE}, their attend paying a fixed cost per block; with --quick "
        f"{QUICK_BLOCK_SIZE}, as the suite tests them)",
    )
    parser.add_argument(
        "--window",
        type=partial(_positive, int),
        default=None,
        metavar="W",
        help="sliding-window attention of W tokens on every layer (default: none); the "
        "window cache then holds W - 1 + one prefill chunk rows at any context",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("bench-out"), metavar="DIR", help="default ./bench-out"
    )
    parser.add_argument(
        "--threads",
        type=partial(_positive, int),
        default=1,
        help="torch threads while timing (default 1, for repeatable numbers; the setup before "
        "timing uses torch's default)",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--min-run-time",
        type=partial(_positive, float),
        metavar="SECONDS",
        help="timed decode steps per row (default 2; with --quick 0.05)",
    )
    parser.add_argument(
        "--uncached-max-length",
        type=partial(_positive, int),
        default=4096,
        metavar="N",
        help="time the uncached model only up to this context (default 4096; it is quadratic)",
    )
    args = parser.parse_args(argv)
    args.block_size = args.block_size or (QUICK_BLOCK_SIZE if args.quick else BLOCK_SIZE)
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out}: exists and is not a directory")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False on this machine")
    # Named as for the kit (kvcheck.selection): --kv-impl, else KV_IMPL, else every built-in.
    names = selection.names_given(args.kv_impl, os.environ.get("KV_IMPL"), list(kvimpl.CACHES))
    # The compressed arm beside every built-in; a cache named is timed alone.
    args.compressed = not args.kv_impl and not os.environ.get("KV_IMPL")
    try:
        selected = selection.select(names)
    except ValueError as error:
        parser.error(f"--kv-impl / KV_IMPL: {error}")
    for label, (name, _) in selected.items():
        if label in ("ideal", "uncached"):
            parser.error(f"--kv-impl: {name!r} would be a second row labelled {label!r}")
    return args, {
        label: at_block_size(factory, args.block_size) for label, (_, factory) in selected.items()
    }


def at_block_size(factory: CacheFactory, block_size: int) -> CacheFactory:
    """The chunked and paged built-ins with ``block_size`` tokens per chunk or block; any
    other factory as given."""
    if factory is kvimpl.ChunkedCache:
        return partial(kvimpl.ChunkedCache, chunk_size=block_size)
    if factory is kvimpl.CACHES["paged"]:
        return kvimpl.PagedPool(block_size)
    return factory


def main(argv: Sequence[str] | None = None) -> None:
    """Run the benchmark with the options ``argv`` (else the command line's), print its
    tables and write them, and the plot where matplotlib is installed, to ``--out``."""
    args, caches = parse_args(argv)
    workload = QUICK if args.quick else FULL
    workload = replace(
        workload,
        config=replace(workload.config, window=args.window),
        lengths=args.lengths or workload.lengths,
        min_run_time=args.min_run_time or workload.min_run_time,
    )
    args.out.mkdir(parents=True, exist_ok=True)  # before the run, so it fails fast
    try:
        rows, request_rows, batch_rows, prefix_rows = run(workload, caches, args)
    except AssertionError as wrong:  # a cache that decodes unlike the ideal: no timing
        sys.exit(f"\nkvbench: error: {wrong}")
    write_csv(rows, args.out / "results.csv")
    write_csv(request_rows, args.out / "requests.csv")
    if batch_rows:  # where some cache offers rows of their own
        write_csv(batch_rows, args.out / "batch.csv")
    write_csv(prefix_rows, args.out / "shared_prefix.csv")
    print(describe(workload, args))
    print(markdown_table(rows))
    print()
    print(requests_table(request_rows))
    if batch_rows:
        print()
        print(batch_table(batch_rows))
    print()
    print(shared_prefix_table(prefix_rows))
    try:
        plot(rows, describe(workload, args), args.out / "decode.png")
    except ImportError:  # the plot is the one part that needs the bench extra
        print(
            f"wrote {args.out / 'results.csv'}; for the plot, pip install 'kvcache-verify[bench]'"
        )
        return
    print(f"wrote {args.out / 'results.csv'} and {args.out / 'decode.png'}")
