"""What a run writes and prints: each table as a CSV and as a Markdown table (readable on a
terminal, pasteable into docs/performance.md), the decode plot, and the line that describes
the model and machine the numbers were measured on."""

from __future__ import annotations

import argparse
import csv
from collections.abc import Sequence
from dataclasses import asdict, fields
from pathlib import Path

import torch

from kvbench.batch import BatchRow
from kvbench.decode import Row
from kvbench.memory import RequestRow
from kvbench.shared_prefix import PrefixRow
from kvbench.workload import GQA, Workload

MIB = 2**20


def write_csv(rows: Sequence[object], path: Path) -> None:
    """``rows``, dataclasses of one kind, as a CSV whose columns are their fields."""
    with path.open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=[field.name for field in fields(type(rows[0]))])
        writer.writeheader()
        writer.writerows(asdict(row) for row in rows)


def markdown_table(rows: list[Row]) -> str:
    """The results as a Markdown table: readable on a terminal, pasteable into the README.
    Each row's "x ideal" is against the ideal of the model it decodes on, its "x formula"
    against its own formula (the compressed arm's: what it declares)."""
    ideal = ideals(rows)
    header = "cache,arm,length,ms/token,IQR ms,x ideal,samples,nbytes MiB,formula MiB,x formula"
    header += ",peak RSS MiB,note"
    lines = []
    for row in sorted(rows, key=lambda row: row.length):
        ms, spread = row.ms_per_token, row.ms_spread
        lines.append(
            [
                row.cache,
                row.arm if row.model == GQA else f"{row.arm} ({row.model} model)",
                str(row.length),
                "-" if ms is None else f"{ms:.3f}",
                "-" if spread is None else f"{spread:.3f}",
                "-" if ms is None else f"{ms / ideal[row.model, row.length]:.2f}",
                str(row.samples),
                f"{row.nbytes / MIB:.1f}",
                f"{row.formula_bytes / MIB:.1f}",
                "-" if not row.nbytes else f"{row.nbytes / row.formula_bytes:.2f}",
                f"{row.peak_rss_bytes / MIB:.0f}",
                row.note,
            ]
        )
    return markdown(header.split(","), lines, text_columns=(0, 1, 11))


def ideals(rows: list[Row]) -> dict[tuple[str, int], float | None]:
    """Each model's ideal ms per token, by (model, length)."""
    return {
        (row.model, row.length): row.ms_per_token for row in rows if row.cache.startswith("ideal")
    }


def requests_table(rows: list[RequestRow]) -> str:
    """The requests held side by side, as a Markdown table."""
    header = "scenario,cache,tokens per request,in use MiB,formula MiB,x formula,reserved MiB,note"
    lines = [
        [
            row.scenario,
            row.cache,
            row.requests,
            f"{row.in_use_bytes / MIB:.1f}",
            f"{row.formula_bytes / MIB:.1f}",
            f"{row.in_use_bytes / row.formula_bytes:.2f}",
            f"{row.reserved_bytes / MIB:.1f}",
            row.note,
        ]
        for row in rows
    ]
    return markdown(header.split(","), lines, text_columns=(0, 1, 2, 7))


def batch_table(rows: list[BatchRow]) -> str:
    """Every request's next token in one step, as a Markdown table: each batch against its
    requests on separate caches of the same factory."""
    alone = {row.cache: row.ms_per_step for row in rows if row.scenario == "separate caches"}
    header = "scenario,cache,tokens per request,ms per step,IQR ms,x separate,samples,nbytes MiB"
    header += ",formula MiB"
    lines = [
        [
            row.scenario,
            row.cache,
            row.requests,
            f"{row.ms_per_step:.3f}",
            "-" if row.ms_spread is None else f"{row.ms_spread:.3f}",
            f"{row.ms_per_step / alone[row.cache]:.2f}",
            str(row.samples),
            f"{row.nbytes / MIB:.1f}",
            f"{row.formula_bytes / MIB:.1f}",
        ]
        for row in rows
    ]
    return markdown(header.split(","), lines, text_columns=(0, 1, 2))


def shared_prefix_table(rows: list[PrefixRow]) -> str:
    """The shared-prefix workload, as a Markdown table: each way against separate caches."""
    alone = next(row.prefill_ms for row in rows if row.scenario == "separate caches")
    header = "scenario,cache,requests,prompt tokens,hit tokens,hit rate,prefill ms,IQR ms"
    header += ",x separate,samples,peak MiB,formula MiB,x formula,note"
    lines = [
        [
            row.scenario,
            row.cache,
            row.requests,
            str(row.prompt_tokens),
            "-" if row.hit_tokens is None else str(row.hit_tokens),
            "-" if row.hit_tokens is None else f"{row.hit_tokens / row.prompt_tokens:.2f}",
            f"{row.prefill_ms:.1f}",
            "-" if row.ms_spread is None else f"{row.ms_spread:.1f}",
            f"{row.prefill_ms / alone:.2f}",
            str(row.samples),
            f"{row.peak_bytes / MIB:.1f}",
            f"{row.formula_bytes / MIB:.1f}",
            f"{row.peak_bytes / row.formula_bytes:.2f}",
            row.note,
        ]
        for row in rows
    ]
    return markdown(header.split(","), lines, text_columns=(0, 1, 2, 13))


def markdown(header: list[str], lines: list[list[str]], text_columns: tuple[int, ...]) -> str:
    """A Markdown table, numbers right-aligned."""
    align = ["---" if column in text_columns else "---:" for column in range(len(header))]
    rows = ["| " + " | ".join(cells) + " |" for cells in [header, *lines]]
    return "\n".join([rows[0], "|" + "|".join(align) + "|", *rows[1:]])


def plot(rows: list[Row], title: str, path: Path) -> None:
    """ms per token against context length (log-log), and each cache relative to the ideal.
    Raises ImportError without matplotlib (the bench extra), the one part that needs it."""
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 4.5))
    FigureCanvasAgg(figure)  # draw with Agg: no display, no global pyplot state
    absolute, relative = figure.subplots(1, 2)
    for axes in (absolute, relative):  # more rows than the default cycle has colours
        axes.set_prop_cycle(color=colormaps["tab20"].colors)
    ideal = ideals(rows)
    for label in dict.fromkeys(row.cache for row in rows):
        timed = [row for row in rows if row.cache == label and row.ms_per_token is not None]
        lengths = [row.length for row in timed]
        # The floor, dashed and on top: a cache that reaches it would otherwise hide it.
        style = {"color": "black", "linestyle": "--", "zorder": 3} if label == "ideal" else {}
        if label == "ideal (MLA)":
            style = {"color": "grey", "linestyle": "--", "zorder": 3}
        ms = [row.ms_per_token for row in timed]
        absolute.plot(lengths, ms, marker="o", label=label, **style)
        if label != "uncached":  # hundreds of times the floor: it would flatten the rest
            ratios = [row.ms_per_token / ideal[row.model, row.length] for row in timed]
            relative.plot(lengths, ratios, marker="o", label=label, **style)
    lengths = sorted({row.length for row in rows})
    for axes in (absolute, relative):
        axes.set_xscale("log", base=2)
        axes.set_xticks(lengths, [str(length) for length in lengths])
        axes.set_xlabel("context length (tokens attended by the decoded token)")
        axes.grid(True, which="both", alpha=0.3)
        axes.legend()
    absolute.set_yscale("log")
    absolute.set_ylabel("ms per decoded token (median)")
    relative.set_ylabel("ms per token / ideal's ms per token")
    figure.suptitle(title, fontsize=10)
    figure.savefig(path, dpi=110, bbox_inches="tight")


def describe(workload: Workload, args: argparse.Namespace) -> str:
    """The model, batch, dtype, device, threads and torch a run measured on: the first line
    printed and the plot's title."""
    c = workload.config
    threads = f"{args.threads} thread" + ("s" if args.threads > 1 else "")
    window = "" if c.window is None else f", window {c.window} on every layer"
    return (
        f"{c.num_layers} layers, {c.num_heads} heads ({c.num_kv_heads} kv) of {c.head_dim}"
        f"{window}, batch {workload.batch}, {str(workload.dtype).removeprefix('torch.')}, "
        f"{args.device}, {threads}, torch {torch.__version__}"
    )
