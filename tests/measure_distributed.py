"""Measure what the distributed properties cost (docs/contract.md, section 11): a group of
rank processes started and joined, one sharded plan on it at 2 and 4 ranks, the same plan
with its ranks simulated in one process, and a plan that moves a request between layouts.
Writes the table of docs/distributed.md between its markers:

    python -m tests.measure_distributed

Times are medians of ``--repeats`` runs on this machine, one torch thread per process, with
``torch.utils.benchmark``'s timer.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import re
import statistics
from pathlib import Path

import torch
from torch.utils.benchmark import Timer

from kvcheck import rank_processes
from kvcheck.properties.moves import ACROSS_BLOCK_SIZES, check_moves
from kvcheck.properties.sharded import REPLICATED, check_sharded, run_sharded
from kvimpl import ConcatCache, PagedPool

DOC = Path(__file__).parents[1] / "docs" / "distributed.md"
BEGIN, END = "<!-- measured by tests/measure_distributed.py -->", "<!-- end of measured -->"
OF_TWO = dataclasses.replace(
    REPLICATED, world=2, config=dataclasses.replace(REPLICATED.config, num_kv_heads=1)
)


def seconds(run, repeats: int) -> float:
    """The median of ``repeats`` runs of ``run``, in seconds."""
    timer = Timer(stmt="run()", globals={"run": run})
    return statistics.median(timer.timeit(1).median for _ in range(repeats))


def started_and_joined() -> None:
    with rank_processes.Runtime(run_sharded, ConcatCache) as runtime:
        runtime._start()


def rows(repeats: int) -> list[tuple[str, float]]:
    measured = [
        ("a group of 4 ranks forked and joined (gloo)", seconds(started_and_joined, repeats))
    ]
    with rank_processes.Runtime(run_sharded, ConcatCache) as runtime:
        runtime.run(REPLICATED)  # started
        for name, plan in (("4 ranks", REPLICATED), ("2 ranks", OF_TWO)):
            measured.append(
                (
                    f"the pinned plan on {name}, processes",
                    seconds(lambda p=plan: runtime.run(p), repeats),
                )
            )
    for name, plan in (("4 ranks", REPLICATED), ("2 ranks", OF_TWO)):
        simulated = seconds(lambda p=plan: check_sharded(ConcatCache, p), repeats)
        measured.append((f"the pinned plan on {name}, simulated in one process", simulated))
    paged = PagedPool()
    measured.append(
        (
            "the pinned move plan (3 moves) on the paged pool",
            seconds(lambda: check_moves(paged, ACROSS_BLOCK_SIZES), repeats),
        )
    )
    return measured


def table(measured: list[tuple[str, float]], repeats: int) -> str:
    lines = [
        f"Measured {datetime.date.today().isoformat()} on {os.cpu_count()} cores, torch "
        f"{torch.__version__}, medians of {repeats} runs (`python -m tests.measure_distributed`):",
        "",
        "| what | seconds |",
        "|---|---|",
        *(f"| {name} | {value:.3f} |" for name, value in measured),
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    text = table(rows(args.repeats), args.repeats)
    doc = DOC.read_text()
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.DOTALL)
    DOC.write_text(pattern.sub(lambda _: f"{BEGIN}\n{text}\n{END}", doc))
    print(text)


if __name__ == "__main__":
    main()
