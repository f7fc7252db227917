"""One run of the benchmark: the tables measured in their order (decode, requests, batch,
shared prefix, and the uncached model last), with a progress bar on stderr."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from functools import partial

import torch

import kvimpl
from kvbench.batch import BatchRow, batch_rows
from kvbench.bench import Bench
from kvbench.decode import Row, decode_rows, decode_setup, skipped_row, uncached_row
from kvbench.memory import RequestRow, request_rows
from kvbench.shared_prefix import PrefixRow, shared_prefix_rows
from kvbench.workload import LATENT, LOSSY, Workload, latent_config
from kvref import CacheFactory


class Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total: int) -> None:
        self.total, self.done = total, 0

    def show(self, doing: str) -> None:
        filled = 30 * self.done // self.total
        bar = "#" * filled + "." * (30 - filled)
        sys.stderr.write(f"\r[{bar}] {self.done}/{self.total} {doing:<36}")
        sys.stderr.flush()

    def advance(self, doing: str) -> None:
        self.done += 1
        self.show(doing)
        if self.done == self.total:
            sys.stderr.write("\n")


def run(
    workload: Workload, caches: dict[str, CacheFactory], args: argparse.Namespace
) -> tuple[list[Row], list[RequestRow], list[BatchRow], list[PrefixRow]]:
    """Every table's rows for ``caches`` on ``workload``, as the options ``args`` ask (the
    device, threads, block size, the compressed arm, the longest uncached context).
    Raises AssertionError, before anything is timed, where a cache computes unlike the
    ideal (or a way of serving unlike separate caches)."""
    progress = Progress(total=len(workload.lengths) * (workload.rounds + 1) + 2)
    progress.show(f"prefill of {max(workload.lengths)} tokens")
    device = torch.device(args.device)
    bench = Bench(workload, device, args.threads)
    latent = None
    if args.compressed:  # an MLA model of the same sizes, its own prefill
        latent = Bench(
            replace(workload, config=latent_config(workload.config)), device, args.threads
        )
    rows = []
    for length in workload.lengths:
        setups = decode_setup(bench, {**caches, **(LOSSY if args.compressed else {})}, length)
        if latent is not None:
            setups |= decode_setup(latent, LATENT, length, ideal="ideal (MLA)")

        def after_round(number: int, length: int = length) -> None:
            progress.advance(f"{length} tokens, round {number} of {workload.rounds}")

        rows += decode_rows(bench, setups, length, after_round)
    progress.show("requests side by side")
    request_table = request_rows(bench, caches, args.block_size)
    batch_table = batch_rows(bench, caches)
    progress.advance("requests side by side")
    prefix_table = shared_prefix_rows(bench, partial(kvimpl.PagedPool, args.block_size))
    progress.advance("requests sharing a system prompt")
    # Last, so that its (batch, heads, L, L) scores do not set the peak RSS of the rows above.
    for length in workload.lengths:
        progress.show(f"uncached at {length} tokens")
        if length <= args.uncached_max_length:
            rows.append(uncached_row(bench, length))
        else:
            note = f"not timed: above --uncached-max-length {args.uncached_max_length}"
            rows.append(skipped_row(bench, "uncached", length, note))
        progress.advance(f"uncached at {length} tokens")
    return rows, request_table, batch_table, prefix_table
