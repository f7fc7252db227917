"""Smoke test of the benchmark: a tiny run writes a complete results.csv and a PNG plot.

Timings are machine-dependent, so nothing here asserts on them beyond being positive.
"""

import csv
import sys
from dataclasses import replace
from functools import partial

import pytest
import torch

import kvimpl
from kvbench.bench import Bench
from kvbench.cli import main, parse_args
from kvbench.report import shared_prefix_table
from kvbench.shared_prefix import PrefixRow, shared_prefix_rows
from kvbench.workload import LATENT, LOSSY, QUICK, QUICK_BLOCK_SIZE, SharedPrefix, latent_config

LENGTHS = (8, 48)  # 48: the forked samples share a full block of 16
COLUMNS = {"cache", "length", "ms_per_token", "ms_spread", "nbytes", "formula_bytes"}


def test_quick_run_writes_results_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    argv = ["--quick", "--lengths", ",".join(map(str, LENGTHS)), "--min-run-time", "0.005"]
    main([*argv, "--out", str(tmp_path)])

    with (tmp_path / "results.csv").open(newline="") as file:
        reader = csv.DictReader(file)
        assert set(reader.fieldnames) >= COLUMNS, f"missing columns in {reader.fieldnames}"
        rows = list(reader)
    labels = [*kvimpl.CACHES, *LOSSY, *LATENT, "ideal", "ideal (MLA)", "uncached"]
    expected = {(label, length) for label in labels for length in LENGTHS}
    got = [(row["cache"], int(row["length"])) for row in rows]
    assert sorted(got) == sorted(expected), f"want one row per (cache, length), got {got}"
    # The compressed arm, each row held to the formula of what it declares.
    by_label = {(row["cache"], int(row["length"])): row for row in rows}
    for length in LENGTHS:
        full = int(by_label["ideal", length]["formula_bytes"])
        quantized, latent = by_label["quantized", length], by_label["latent", length]
        assert quantized["arm"] == latent["arm"] == "compressed", (quantized, latent)
        # Rows in int8 codes but the last 16, kept as given: at 8 tokens, none in codes.
        assert int(quantized["formula_bytes"]) <= full, quantized
        assert (int(quantized["formula_bytes"]) < full) == (length > 16), quantized
        assert (latent["model"], int(latent["formula_bytes"])) == ("MLA", latent_formula(length))
    for row in rows:
        where = f"row {row['cache']} at {row['length']}"
        assert float(row["ms_per_token"]) > 0, f"{where}: ms_per_token {row['ms_per_token']}"
        assert row["ms_spread"] == "" or float(row["ms_spread"]) >= 0, f"{where}: {row}"
        assert int(row["formula_bytes"]) > 0, f"{where}: formula_bytes {row['formula_bytes']}"
        if row["cache"] != "uncached":  # the uncached model keeps nothing between tokens
            assert int(row["nbytes"]) >= int(row["formula_bytes"]), f"{where}: {row}"

    png = (tmp_path / "decode.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n"), "decode.png is not a PNG file"

    with (tmp_path / "requests.csv").open(newline="") as file:
        requests = {(row["scenario"], row["cache"]): row for row in csv.DictReader(file)}
    assert {cache for scenario, cache in requests if scenario == "mixed lengths"} == set(
        kvimpl.CACHES
    )
    mixed, forked = (
        requests["mixed lengths", "paged"],
        requests[next(k for k in requests if "forked" in k[0])],
    )
    # Per request and layer the pool wastes under one block: the rest of the last one.
    block_bytes = 2 * 4 * QUICK_BLOCK_SIZE * 16 * 4  # 4 kv heads of 16, float32
    waste = len(QUICK.requests) * QUICK.config.num_layers * block_bytes
    formula, in_use = int(mixed["formula_bytes"]), int(mixed["in_use_bytes"])
    assert formula <= in_use < formula + waste, f"paged, mixed lengths: {mixed}"
    # Forked samples share the prompt's blocks: less in use than their formulas' sum.
    assert int(forked["in_use_bytes"]) < int(forked["formula_bytes"]), f"forked: {forked}"

    # The requests' next token in one batch of rows of their own, and on separate caches.
    with (tmp_path / "batch.csv").open(newline="") as file:
        batch = {(row["scenario"], row["cache"]): row for row in csv.DictReader(file)}
    offering = {cache for _, cache in batch}
    assert "preallocated" in offering, batch
    for cache in offering:
        for scenario in ("one batch, rows of their own", "separate caches"):
            row = batch[scenario, cache]
            assert float(row["ms_per_step"]) > 0, row
            assert int(row["nbytes"]) >= int(row["formula_bytes"]) > 0, row

    # The shared-prefix workload, three ways (its own test checks what they measure).
    with (tmp_path / "shared_prefix.csv").open(newline="") as file:
        shared = [row["scenario"] for row in csv.DictReader(file)]
    assert shared == ["prefix caching", "one pool, no lookups", "separate caches"], shared


def latent_formula(length: int) -> int:
    """The MLA model's full-precision formula: a latent and a rope key per token and layer."""
    config = latent_config(QUICK.config)
    width = config.latent_dim + config.rope_dim
    return config.num_layers * QUICK.batch * length * width * 4  # float32


# 3 requests, each a system prompt of two 16-token blocks, 4 tokens of its own, 2 decoded.
TINY_SHARED_PREFIX = replace(
    QUICK,
    lengths=(2,),  # the Bench's own prefill, unused here
    min_run_time=0.001,
    rounds=1,
    shared_prefix=SharedPrefix(requests=3, system=32, own=4, decode=2),
)


def rows_by_scenario(pool) -> dict[str, PrefixRow]:
    bench = Bench(TINY_SHARED_PREFIX, torch.device("cpu"), threads=1)
    return {row.scenario: row for row in shared_prefix_rows(bench, pool)}


@pytest.mark.long  # the workload, with and without prefix caching
def test_shared_prefix_hits_the_system_prompt_and_holds_it_once():
    rows = rows_by_scenario(partial(kvimpl.PagedPool, QUICK_BLOCK_SIZE))
    cached, unshared, alone = (
        rows[scenario] for scenario in ("prefix caching", "one pool, no lookups", "separate caches")
    )
    # The first request finds nothing; each later one the system prompt's two blocks.
    assert cached.hit_tokens == 2 * 32, cached
    assert cached.hit_tokens / cached.prompt_tokens > 0
    assert unshared.hit_tokens is None, unshared  # no lookups
    assert alone.hit_tokens is None, alone
    # Its blocks once, against once per request; separate caches hold exactly the formula.
    assert 0 < cached.peak_bytes < unshared.peak_bytes, (cached, unshared)
    assert cached.peak_bytes < cached.formula_bytes == alone.peak_bytes, (cached, alone)
    for row in rows.values():  # timed, but nothing asserted about how fast
        assert row.prefill_ms > 0, row
        assert row.samples >= 1, row
    table = shared_prefix_table(list(rows.values()))
    assert "| prefix caching | paged | 3 x 32+4+2 | 108 | 64 | 0.59 |" in table, table


class _UnderstatesHits(kvimpl.PagedPool):
    """Its lookup returns one block less than it made the caches hold, so the request
    prefills that block's tokens again, after the rows it already has."""

    def lookup_prefix(self, caches, tokens, *, salt=None) -> int:
        hit = super().lookup_prefix(caches, tokens, salt=salt)
        return max(hit - self.block_size, 0)


def test_shared_prefix_is_not_timed_when_the_logits_disagree():
    # Every arm's logits (each prompt's last token, each decoded one) are checked against
    # separate caches' before anything is timed: a wrong pool raises, as a wrong cache
    # does in the decode table (and main exits naming it).
    with pytest.raises(AssertionError, match="prefix caching computes the requests' logits"):
        rows_by_scenario(partial(_UnderstatesHits, QUICK_BLOCK_SIZE))


@pytest.mark.parametrize(
    ("argv", "complaint"),
    [
        (["--lengths", "256,x"], "--lengths"),
        (["--lengths", "1"], "--lengths"),
        (["--threads", "0"], "--threads"),
        (["--min-run-time", "nan"], "--min-run-time"),
        (["--kv-impl", "nosuchcache"], "nosuchcache"),
        (["--kv-impl", "concat", "--kv-impl", "concat"], "concat"),
    ],
)
def test_bad_options_are_named(argv, complaint, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    assert complaint in capsys.readouterr().err


def test_a_cache_that_decodes_wrongly_is_not_timed(tmp_path):
    argv = ["--quick", "--lengths", "8", "--min-run-time", "0.005", "--out", str(tmp_path)]
    broken = "tests.mutants.caches:SwapsKeysAndValues"
    with pytest.raises(SystemExit, match="SwapsKeysAndValues decodes token 8 unlike the ideal"):
        main([*argv, "--kv-impl", broken])
    assert not (tmp_path / "results.csv").exists(), "a wrong cache's timings were written"


def test_without_matplotlib_the_table_and_csv_are_still_written(tmp_path, monkeypatch, capsys):
    for name in [name for name in sys.modules if name.startswith("matplotlib")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    argv = ["--quick", "--lengths", "8", "--min-run-time", "0.005", "--out", str(tmp_path)]
    main([*argv, "--kv-impl", "concat"])
    out = capsys.readouterr().out
    assert "| concat | full precision | 8 |" in out, out
    assert "for the plot, pip install 'kvcache-verify[bench]'" in out, out
    assert (tmp_path / "results.csv").exists(), "no results.csv without matplotlib"
    assert not (tmp_path / "decode.png").exists()


def test_with_a_window_the_window_cache_holds_less_than_the_rest(tmp_path):
    argv = ["--quick", "--window", "8", "--lengths", "256", "--min-run-time", "0.005"]
    main([*argv, "--kv-impl", "window", "--kv-impl", "concat", "--out", str(tmp_path)])
    with (tmp_path / "results.csv").open(newline="") as file:
        nbytes = {row["cache"]: int(row["nbytes"]) for row in csv.DictReader(file)}
    # W - 1 rows and one prefill chunk of 64 (71 rows), against all 256.
    assert 0 < nbytes["window"] < nbytes["concat"] / 3, nbytes
