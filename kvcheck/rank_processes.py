"""Sharded plans on real processes: ``torch.distributed`` (docs/contract.md, section 11.1).

A ``Runtime`` forks ``world`` rank processes that join one gloo process group on a store
rank 0 hosts at 127.0.0.1 (an unused port; gloo bound to the loopback interface), and a
group of the first two ranks for plans of two. The store is not this process's: a thread
serving it here could hold a lock at the moment of a fork, and a rank would hang on it.

Each plan is sent to every rank over a pipe; each rank runs it through the runner the
runtime was made with (``kvcheck.properties.sharded.run_sharded``: given, not imported, so
that this module stays below the properties) on caches from the factory, gathering attention
outputs with ``torch.distributed.all_gather``, and answers "ok" or the failure it raised. A
rank reports each event before it runs it, so a plan that passes its deadline fails naming
the ranks that did not answer and the event each had reached; the runtime is then torn down
(every rank killed) and the next plan starts another.

The ranks are forked: they inherit the factory, the kit's settings and the declared domain
as they are in this process (no pickling, no re-import). They run on the CPU: CUDA does not
survive a fork, and the simulated test (``sharded``) runs on the kit's device.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import pickle
import socket
import time
import traceback
from collections.abc import Iterator, Sequence
from datetime import timedelta

import torch
from torch import Tensor

from kvcheck import devices as kvdevices
from kvcheck import failures
from kvcheck import sizes as kvsizes

WORLD = 4  # the most ranks a plan asks for; plans of 2 run on the first two
DEADLINE = 60.0  # seconds a plan may take on every rank
START_DEADLINE = 20.0  # seconds the ranks may take to join the group
FAILED_GRACE = 1.0  # seconds the other ranks get to report, once one has failed
LOOPBACK = "127.0.0.1"
STOP = b"stop"  # what a rank is sent to leave the group


def unused_port() -> int:
    """A port of the loopback interface no one listens on now (rank 0's store takes it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((LOOPBACK, 0))
        return probe.getsockname()[1]


def unavailable() -> str | None:
    """Why sharded plans cannot run on processes here, or None."""
    if not torch.distributed.is_available():
        return "this torch is built without torch.distributed"
    if not torch.distributed.is_gloo_available():
        return "this torch is built without the gloo backend"
    if "fork" not in multiprocessing.get_all_start_methods():
        return "the ranks are forked, and this platform cannot fork"
    return None


class ProcessGroupRanks:
    """This process's rank of a ``torch.distributed`` group (``kvcheck.sharded_cache.Ranks``)."""

    def __init__(self, group=None) -> None:
        self.group = group
        self.world = torch.distributed.get_world_size(group)
        self.hosted = (torch.distributed.get_rank(group),)

    def gather(self, local: Sequence[Tensor]) -> list[Tensor]:
        (mine,) = local
        mine = mine.contiguous()
        every = [torch.empty_like(mine) for _ in range(self.world)]
        torch.distributed.all_gather(every, mine, group=self.group)
        return every


class Runtime:
    """``world`` forked ranks serving sharded plans through ``runner(factory, plan, ranks,
    progress=...)``, each on caches from the factory sent with it, or from ``factory``,
    which the ranks inherit (for one that does not pickle)."""

    def __init__(
        self, runner, factory=None, world: int = WORLD, deadline: float = DEADLINE
    ) -> None:
        self.runner = runner
        self.factory = factory
        self.world = world
        self.deadline = deadline
        self.ranks: list = []  # (process, pipe) per rank

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self) -> None:
        """Fork the ranks and wait until each has joined the group; a start that does not
        finish within ``START_DEADLINE`` is tried once more (a fork can inherit a lock some
        thread of this process held at that moment) before it fails."""
        for _ in range(2):
            port = unused_port()
            context = multiprocessing.get_context("fork")
            for rank in range(self.world):
                ours, theirs = context.Pipe()
                process = context.Process(
                    target=_serve,
                    args=(rank, self.world, port, self.runner, self.factory, theirs, self.deadline),
                    name=f"kvcheck rank {rank}",
                    daemon=True,
                )
                process.start()
                theirs.close()
                self.ranks.append((process, ours))
            joined = self._answers("joined", START_DEADLINE)
            if len(joined) == self.world:
                return
            self.close(broken=True)
        late = sorted(set(range(self.world)) - set(joined))
        raise TimeoutError(
            f"sharded runtime: ranks {late} did not join the gloo group at {LOOPBACK}:{port} "
            f"within {START_DEADLINE:g} s (or died: their processes' stderr says why), twice"
        )

    def _answers(self, kind: str, deadline: float) -> dict[int, tuple]:
        """The first message of each rank, waited for until ``deadline`` seconds."""
        answers: dict[int, tuple] = {}
        end = time.monotonic() + deadline
        while len(answers) < self.world:
            waiting = {
                self.ranks[rank][1]: rank for rank in range(self.world) if rank not in answers
            }
            ready = multiprocessing.connection.wait(list(waiting), max(0.0, end - time.monotonic()))
            if not ready:
                break
            for pipe in ready:
                try:
                    answers[waiting[pipe]] = pipe.recv()
                except EOFError:
                    answers[waiting[pipe]] = ("died",)
        return {rank: answer for rank, answer in answers.items() if answer[0] == kind}

    def close(self, *, broken: bool = False) -> None:
        """Every rank told to stop, and killed where it does not within a few seconds (at
        once where the group is ``broken``: its ranks may wait in a collective for ever)."""
        for _, pipe in self.ranks if not broken else ():
            with contextlib.suppress(OSError):
                pipe.send_bytes(STOP)
        for process, pipe in self.ranks:
            process.join(timeout=0 if broken else 5)
            if process.is_alive():
                process.kill()
                process.join()
            pipe.close()
        self.ranks = []

    def run(self, plan, factory=None) -> None:
        """Run ``plan`` on every rank on caches from ``factory`` (the runtime's own where
        None), aiming at the sizes in force here; raise the first rank's failure, or a
        timeout naming the ranks that did not answer. Whatever escapes mid-plan (a rank's
        pipe broken, an interrupt) ends the group first: no answer of this plan may be read
        as the next one's."""
        if not self.ranks:
            self._start()
        try:
            answers = self._run(plan, factory)
        except BaseException:
            self.close(broken=True)
            raise
        failed = {rank: answer for rank, answer in answers.items() if answer[0] != "ok"}
        if failed:
            self.close(broken=True)  # a group with a failed rank cannot go on
            # The most telling first: a rank's own rows or lengths before the wrong logits
            # that rank 0 then sees, the lowest rank among equals.
            rank, (kind, *detail) = min(
                failed.items(), key=lambda item: (item[1][1:2] == ("WrongResults",), item[0])
            )
            raise _as_raised(rank, kind, detail, plan)

    def _run(self, plan, factory) -> dict[int, tuple]:
        message = pickle.dumps((factory, plan, kvsizes.current()))
        for _, pipe in self.ranks:
            pipe.send_bytes(message)
        answers: dict[int, tuple] = {}
        reached = dict.fromkeys(range(self.world), "starting")
        end = time.monotonic() + self.deadline
        while len(answers) < self.world:
            waiting = [rank for rank in range(self.world) if rank not in answers]
            left = max(0.0, end - time.monotonic())
            ready = multiprocessing.connection.wait([self.ranks[r][1] for r in waiting], left)
            if not ready:
                if any(answer[0] != "ok" for answer in answers.values()):
                    break  # the others wait in a collective for the failed rank
                self.close(broken=True)
                said = "; ".join(f"rank {rank} at {reached[rank]}" for rank in waiting)
                raise TimeoutError(
                    f"sharded runtime: ranks {waiting} did not answer within {self.deadline:g} "
                    f"s ({said}); every rank was killed\n  {plan.describe()}"
                )
            for rank in waiting:
                pipe = self.ranks[rank][1]
                if pipe not in ready:
                    continue
                try:
                    message = pipe.recv()
                except EOFError:
                    message = ("died", f"rank {rank}'s process died at {reached[rank]}")
                if message[0] == "at":
                    reached[rank] = message[1]
                else:
                    answers[rank] = message
            if any(answer[0] != "ok" for answer in answers.values()):
                # A moment for the others' own failures (a rank's rows, before the logits
                # they spoil reach rank 0), then no longer: they may be stuck for good.
                end = min(end, time.monotonic() + FAILED_GRACE)
        return answers


def _as_raised(rank: int, kind: str, detail: list, plan) -> BaseException:
    """A rank's failure raised here: the same severity, its message and where it was."""
    if kind == "died":
        return RuntimeError(f"sharded runtime: {detail[0]}\n  {plan.describe()}")
    name, message = detail
    kind_of = getattr(failures, name, None)
    severity = kind_of if isinstance(kind_of, type) and issubclass(kind_of, Exception) else None
    text = f"on rank {rank} of a real process group: {message}"
    return severity(text) if severity is not None else RuntimeError(f"{name}: {text}")


def _serve(rank: int, world: int, port: int, runner, factory, pipe, deadline: float) -> None:
    """A rank's process: join the group, then run each plan sent until told to stop."""
    torch.set_num_threads(1)
    kvdevices.choose("cpu")
    if os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # Rank 0 hosts the store: no thread of the parent serves it while it forks.
    timeout = timedelta(seconds=deadline)
    store = torch.distributed.TCPStore(LOOPBACK, port, world, rank == 0, timeout)
    torch.distributed.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timeout
    )
    groups = {world: None}
    if world > 2:
        groups[2] = torch.distributed.new_group([0, 1])
    pipe.send(("joined",))
    try:
        while (message := pipe.recv_bytes()) != STOP:
            try:
                sent, plan, sizes = pickle.loads(message)
                if rank >= plan.world:
                    pipe.send(("ok",))
                    continue
                with kvsizes.aiming_at(sizes):
                    runner(
                        factory if sent is None else sent,
                        plan,
                        lambda world: ProcessGroupRanks(groups[world]),
                        progress=lambda said: pipe.send(("at", said)),
                    )
                pipe.send(("ok",))
            except BaseException as error:
                said = "\n".join((str(error), *getattr(error, "__notes__", ())))
                if not isinstance(error, AssertionError):  # a crash: where, for its author
                    said += "\n" + "".join(traceback.format_exception(error)[-3:])
                pipe.send(("failed", type(error).__name__, said.strip()))
    finally:
        torch.distributed.destroy_process_group()


# This process's runtime of each runner, for every factory that pickles.
_shared: dict = {}


@contextlib.contextmanager
def serving(factory) -> Iterator[None]:
    """What a test of the sharded runtime needs: it skips with the reason where processes
    cannot run plans here."""
    if why := unavailable():
        import pytest

        pytest.skip(f"sharded runtime: {why}")
    yield


def run_on_processes(runner, factory, plan) -> None:
    """``plan`` through ``runner`` on this process's runtime (started at its first plan,
    again after a plan that failed), the factory sent with it; a factory that does not
    pickle (a lambda, a class defined in a function) gets a runtime of its own, forked with
    it. A cache that declares devices without the CPU, where the ranks run, skips the test,
    saying so."""
    devices = kvsizes.domain().devices
    if devices is not None and "cpu" not in devices:
        import pytest

        pytest.skip(
            f"not offered: outside the declared domain: the sharded runtime's ranks run on "
            f"the CPU; the cache supports devices {', '.join(devices)}"
        )
    try:
        pickle.dumps(factory)
    except (pickle.PicklingError, AttributeError, TypeError):
        with Runtime(runner, factory) as runtime:
            runtime.run(plan)
        return
    if runner not in _shared:
        _shared[runner] = Runtime(runner)
        atexit.register(_shared[runner].close)
    _shared[runner].run(plan, factory)
