"""``python -m kvbench``: the benchmark's command line (kvbench.cli)."""

from kvbench.cli import main

main()
