"""How a row is timed: a clock that stops while a cache is put back, and rows taking turns,
a share of the time each per round, so that a change in the machine's load falls on all of
them alike. ``torch.utils.benchmark`` warms up, picks a block size and repeats within each
share."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch.utils import benchmark

from kvbench.workload import Workload


class DecodeClock:
    """A perf_counter that stops while caches are put back, so only decode steps count."""

    def __init__(self, device: torch.device) -> None:
        self._paused = 0.0
        self._sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None

    def now(self) -> float:
        self._sync()  # queued GPU work belongs to the step that queued it
        return time.perf_counter() - self._paused

    def off_the_clock(self, action: Callable[[], object]) -> None:
        start = self.now()
        action()
        self._paused += self.now() - start


def timer(
    step: Callable[[], object],
    restore: Callable[[], object],
    device: torch.device,
    threads: int,
) -> benchmark.Timer:
    """A timer of ``step`` that runs ``restore`` off the clock before each call."""
    clock = DecodeClock(device)
    return benchmark.Timer(
        stmt="clock.off_the_clock(restore); step()",
        globals={"clock": clock, "restore": restore, "step": step},
        timer=clock.now,
        num_threads=threads,
    )


def take_turns(
    timers: dict[str, benchmark.Timer],
    workload: Workload,
    after_round: Callable[[int], object] = lambda round_number: None,
) -> dict[str, benchmark.Measurement]:
    """Run every timer for a share of ``workload.min_run_time`` in each of its rounds, in
    turn, and merge each one's shares; ``after_round`` is told each round done (from 1)."""
    rounds = workload.rounds
    parts: dict[str, list[benchmark.Measurement]] = {label: [] for label in timers}
    for round_number in range(1, rounds + 1):
        for label, each in timers.items():
            share = workload.min_run_time / rounds
            parts[label].append(each.blocked_autorange(min_run_time=share))
        after_round(round_number)
    return {label: benchmark.Measurement.merge(shares)[0] for label, shares in parts.items()}


def spread_ms(measured: benchmark.Measurement) -> float | None:
    """The interquartile range of ``measured``'s samples in ms; None with one sample."""
    return measured.iqr * 1000 if len(measured.times) > 1 else None
