"""The benchmark: decode cost, memory and scaling of every cache, side by side, on one
reference model. A tool beside the kit, not part of it: ``python -m kvbench --help``, and
docs/performance.md for what it measures and its results.

Its modules, one idea each:

- ``workload``: the model, lengths and requests of a run (``FULL``, ``QUICK``), and the
  compressed arm's caches;
- ``bench``: the model and its prefilled keys and values every table shares, and the
  formula every row's memory is held to;
- ``timing``: the clock that stops while a cache is put back, and rows taking turns;
- ``decode``: the decode table, beside the ideal cache and the uncached model;
- ``memory``: requests held side by side, and samples forked from one prompt;
- ``batch``: the requests' next token in one batched step, against separate caches;
- ``shared_prefix``: requests sharing a system prompt, with and without prefix caching;
- ``report``: the CSVs, the Markdown tables and the plot;
- ``tables`` and ``cli``: one run, the tables in order, and the command line.
"""

from kvbench.cli import main

__all__ = ["main"]
