"""The shared example database (``--kv-database``, contract 11.3, docs/search.md): a failure
one run found is replayed first by the next run anywhere that reads it, from a fresh
checkout, and fails there at once; read-only, it is replayed and nothing is written.

The cache under test is broken on a minority of draws (batch 3 or more, full precision, more
than 8 rows held), which no pinned input of the kit hits and the first, smallest example
drawn cannot: a fresh search has to draw for it. "At once" is counted, not timed. The
broken cache writes a line for each cache it builds and each row it corrupts: a run that
reads the database builds fewer caches before its first corruption than the fresh search
did. And with Redis (a ``redis-server`` of the test's own; three runs of pytest of their
own, some 30 s on two cores, hence ``soak``), Hypothesis's verbose report in the failing
test's output names each example tried, the explicit (pinned) ones first: in a run that
reads the database the first other example tried, the replayed one, fails. The shared
directory's test runs pytest twice in this process, without shrinking, in a few seconds.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import hypothesis.core
import pytest
import torch
from hypothesis import Phase, settings
from hypothesis import configuration as hypothesis_configuration
from hypothesis.database import InMemoryExampleDatabase

# Imported here, before the in-process runs: each would else import a kit of its own.
import kvcheck.base  # noqa: F401
from kvcheck import database as kvdatabase
from kvcheck import profiles as kvprofiles
from tests.pytest_run import ROOT, run_in_process, run_pytest

BROKEN = '''
"""A concat cache that hands back a corrupted value row once a cache of batch 3 or more, in
full precision, holds more than 8 rows; it writes one line per cache built ("new") and per
corrupted append ("corrupt") to caches.log beside this file."""

from pathlib import Path

from kvimpl import ConcatCache

LOG = Path(__file__).with_name("caches.log")


def log(line):
    with LOG.open("a") as file:
        file.write(line + "\\n")


class OftenRightCache(ConcatCache):
    def __init__(self, spec):
        super().__init__(spec)
        log(f"new batch={spec.batch} {spec.dtype}")

    def append(self, key, value):
        keys, values = super().append(key, value)
        if self.spec.batch >= 3 and self.spec.dtype.itemsize >= 4 and self.length > 8:
            log(f"corrupt at {self.length}")
            values = values.clone()
            values[:, :, 0] += 1
        return keys, values
'''
TEST_FILE = """
from kvcheck import CacheTests

from broken import OftenRightCache


class TestX(CacheTests):
    factory = OftenRightCache
"""
PROPERTY = "test_logits_match_uncached"  # the search of the logits property, on append


def project(where: Path) -> Path:
    """A checkout of a tiny project whose kit class tests the broken cache: no .hypothesis."""
    where.mkdir()
    (where / "broken.py").write_text(BROKEN)
    (where / "test_x.py").write_text(TEST_FILE)
    return where


def caches_before_the_first_corruption(where: Path) -> int:
    lines = (where / "caches.log").read_text().splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("corrupt"))
    return sum(line.startswith("new") for line in lines[:first])


def tried_up_to_the_first_failure(output: str) -> tuple[int, int]:
    """From Hypothesis's verbose report in a failing test's output: the explicit examples
    tried, and the other examples tried up to the first that failed (that one included)."""
    start = output.find("Captured stdout call")
    failure = output.find("Traceback (most recent call last)", start)
    assert 0 <= start < failure, f"no verbose report of the failing test:\n{output}"
    before = output[start:failure]
    # Hypothesis says "Trying example:" of a drawn or replayed example, and "Test case:" of
    # one it replays to report it: either is an example tried.
    tried = before.count("Trying example:") + before.count("Test case:")
    return before.count("Trying explicit example"), tried


def failed_in_logits(result: subprocess.CompletedProcess) -> None:
    output = result.stdout + result.stderr
    assert result.returncode == pytest.ExitCode.TESTS_FAILED, output
    assert f"FAILED test_x.py::TestX::{PROPERTY}[OftenRightCache]" in output, output
    assert "WrongResults: cached and uncached logits differ" in output, output


# --- with Redis --------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def redis_server(tmp_path):
    """A redis-server of this test's own on a free port of 127.0.0.1, no persistence;
    ``redis://127.0.0.1:PORT``. Stopped when the test ends, whatever happened."""
    server = shutil.which("redis-server")
    # .ci/run installs both and sets KV_REQUIRE_REDIS: there a missing one fails, not skips.
    missing = pytest.fail if os.environ.get("KV_REQUIRE_REDIS") else pytest.skip
    if server is None:
        missing("redis-server is not installed (apt-get install redis-server)")
    try:
        import redis
    except ImportError:
        missing("the redis package is not installed (pip install 'kvcache-verify[redis]')")
    log = tmp_path / "redis-server.log"
    for _attempt in range(3):  # the port may be taken between finding it and binding it
        port = free_port()
        command = [server, "--bind", "127.0.0.1", "--port", str(port), "--save", ""]
        command += ["--appendonly", "no", "--daemonize", "no", "--dir", str(tmp_path)]
        with log.open("w") as output:
            process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
        try:
            client = redis.Redis(port=port, socket_connect_timeout=1)
            deadline = time.monotonic() + 10
            while process.poll() is None and time.monotonic() < deadline:
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    time.sleep(0.05)
            else:
                if process.poll() is None:
                    pytest.fail(f"redis-server did not answer PING in 10 s:\n{log.read_text()}")
                continue  # it exited: the port was taken; another
            client.close()
            yield f"redis://127.0.0.1:{port}"
            return
        finally:
            process.terminate()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    pytest.fail(f"redis-server did not start on a free port:\n{log.read_text()}")


def run_with_database(where: Path, url: str, *options: str) -> subprocess.CompletedProcess:
    args = ("-q", "-k", PROPERTY, "--kv-database", url, *options)
    return run_pytest(*args, cwd=where, extra_path=where)


def stored(client) -> dict[bytes, set[bytes]]:
    return {key: client.smembers(key) for key in client.scan_iter()}


@pytest.mark.soak  # three runs of pytest of their own: some 30 s on two cores
@pytest.mark.long
def test_a_failure_found_on_one_machine_is_replayed_first_by_a_fresh_checkout(
    tmp_path, redis_server
):
    import redis

    # A fresh checkout, an empty database: the search must draw until it fails (A is the
    # fresh search the others are measured against: the ci profile is derandomized, so a
    # second fresh run would try exactly the same examples).
    fresh = run_with_database(project(tmp_path / "A"), f"{redis_server}/0")
    failed_in_logits(fresh)
    assert "kv example database: redis://127.0.0.1:" in fresh.stdout, fresh.stdout
    searched = caches_before_the_first_corruption(tmp_path / "A")
    written = redis.Redis.from_url(f"{redis_server}/0")
    keys = [key for key in written.scan_iter() if not key.endswith(b".secondary")]
    assert len(keys) == 1, keys  # the failure, under the test that found it
    assert b"test_x::TestX::test_logits_match_uncached[OftenRightCache]" in keys[0], keys
    # A copy of what A wrote, for a read-only run beside the read-write one.
    for key in written.scan_iter():
        written.copy(key, key, destination_db=1)
    shared = redis.Redis.from_url(f"{redis_server}/1")
    before = stored(shared)

    # Two other fresh checkouts: one reads and writes the database, the other only reads
    # its copy, and runs its test in a pytest-xdist worker (which connects on its own).
    with ThreadPoolExecutor(2) as runs:
        verbose = "--hypothesis-verbosity=verbose"
        again = runs.submit(
            run_with_database, project(tmp_path / "B"), f"{redis_server}/0", verbose
        )
        read_only = runs.submit(
            run_with_database,
            project(tmp_path / "C"),
            f"{redis_server}/1",
            "--kv-database-read-only",
            verbose,
            "-n",
            "1",
        )
        again, read_only = again.result(), read_only.result()
    for run, checkout in ((again, "B"), (read_only, "C")):
        failed_in_logits(run)
        # The kit's pinned inputs first (they pass), then the replayed failure: the first
        # other example tried, and fewer caches built before it than the fresh search built.
        pinned, tried = tried_up_to_the_first_failure(run.stdout)
        assert pinned >= 1, run.stdout
        assert tried == 1, f"{tried} examples tried up to the first failure:\n{run.stdout}"
        replayed = caches_before_the_first_corruption(tmp_path / checkout)
        assert replayed < searched, f"caches built before it: {replayed}, fresh: {searched}"
    assert "(read-only)" in read_only.stdout, read_only.stdout
    assert stored(shared) == before, "a read-only run changed the shared database"
    assert any((tmp_path / "C" / ".hypothesis" / "examples").rglob("*")), (
        "the failure was not kept in the local .hypothesis directory"
    )
    assert stored(written)  # what B replayed is still there


# --- with a shared directory ----------------------------------------------------------------


@pytest.fixture
def home_directory():
    """Where Hypothesis keeps its local database (``.hypothesis``), put back afterwards: an
    in-process run's would else be this process's."""
    before = getattr(hypothesis_configuration, "__hypothesis_home_directory")
    yield hypothesis_configuration.set_hypothesis_home_dir
    hypothesis_configuration.set_hypothesis_home_dir(before)


@pytest.mark.long  # two runs of pytest, in this process: some 4 s
def test_a_failure_kept_in_a_shared_directory_is_replayed_first_by_a_fresh_checkout(
    pytester, monkeypatch, home_directory
):
    # torch.testing.assert_close imports torch.distributed.tensor on its first call (a failing
    # comparison of the kit's): once in this process, not again in each run, whose imports
    # pytester takes back after it (a second import cannot register torch's operators again).
    torch.testing.assert_close(torch.zeros(1), torch.zeros(1))
    # A seed forced on this process (--hypothesis-seed) turns Hypothesis's example database
    # off in every search it runs, the two runs below included: their own runs choose none.
    monkeypatch.setattr(hypothesis.core, "global_force_seed", None)
    # Without shrinking (what the Redis test keeps), the failure saved is the first found.
    quick = settings(
        kvprofiles.PROFILES["ci"], phases=[Phase.explicit, Phase.reuse, Phase.generate]
    )
    monkeypatch.setitem(kvprofiles.PROFILES, "ci", quick)
    shared = pytester.path / "shared"
    found = {}
    # A names the directory with the option, B with the environment variable.
    for name, option in (("A", ["--kv-database", str(shared)]), ("B", [])):
        checkout = project(pytester.path / name)
        home_directory(checkout / ".hypothesis")  # a fresh checkout: nothing of its own
        monkeypatch.chdir(checkout)
        if not option:
            monkeypatch.setenv("KV_DATABASE", str(shared))
        result = run_in_process(pytester, "-q", "-k", PROPERTY, *option)
        failed_in_logits(result)
        assert f"kv example database: {shared} (read and written)" in result.stdout
        found[name] = caches_before_the_first_corruption(checkout)
        assert any(shared.rglob("*")), "nothing was written to the shared directory"
    assert found["B"] < found["A"], f"caches built before the first failure: {found}"


# --- what the options refuse ----------------------------------------------------------------

LIGHT_TEST = """
import sys


def test_x():
    assert "kvcheck.database" in sys.modules  # the option was read
    assert "redis" not in sys.modules and "torch" not in sys.modules
"""


@pytest.mark.long  # a process of its own
def test_a_directory_database_imports_neither_redis_nor_torch(tmp_path):
    (tmp_path / "test_light.py").write_text(LIGHT_TEST)
    result = run_pytest("--kv-database", str(tmp_path / "db"), cwd=tmp_path, extra_path=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--kv-database-read-only"], "--kv-database-read-only: no database named; name it"),
        (["--kv-database", "{file}"], "--kv-database {file}: not a directory"),
    ],
    ids=["read-only-alone", "a-file"],
)
def test_an_option_that_cannot_be_used_stops_the_run_at_start(pytester, args, error):
    (pytester.path / "test_light.py").write_text("def test_x():\n    pass\n")
    (pytester.path / "file").write_text("")
    file = str(pytester.path / "file")
    result = run_in_process(pytester, *[arg.format(file=file) for arg in args])
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, result.stdout + result.stderr
    assert f"ERROR: {error.format(file=file)}" in result.stderr, result.stderr


def test_an_unreachable_redis_server_stops_the_run_at_start_naming_the_url(pytester):
    pytest.importorskip("redis", reason="the redis package is not installed")
    (pytester.path / "test_light.py").write_text("def test_x():\n    pass\n")
    url = f"redis://:secret@127.0.0.1:{free_port()}/0"  # nothing listens there
    result = run_in_process(pytester, "--kv-database", url)
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, result.stdout + result.stderr
    shown = url.replace(":secret@", ":***@")
    assert f"ERROR: --kv-database {shown}: the Redis server does not answer" in result.stderr
    assert "secret" not in result.stdout + result.stderr


def test_a_redis_url_without_the_package_says_to_install_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "redis", None)  # import redis: ImportError
    with pytest.raises(kvdatabase.DatabaseError, match=r"kvcache-verify\[redis\]"):
        kvdatabase.for_run("redis://127.0.0.1:6379/0")


def test_each_test_keeps_its_examples_apart_under_a_key_the_same_on_every_machine():
    shared = InMemoryExampleDatabase()
    one = kvdatabase.Keyed(shared, kvdatabase.key_of("kvcheck.test_conformance", "a::T::t[x]"))
    other = kvdatabase.Keyed(shared, kvdatabase.key_of("kvcheck.test_conformance", "T::t[y]"))
    one.save(b"digest", b"failure")
    assert list(one.fetch(b"digest")) == [b"failure"]
    assert list(other.fetch(b"digest")) == []
    one.move(b"digest", b"digest.secondary", b"failure")
    assert list(one.fetch(b"digest.secondary")) == [b"failure"]
    # Only the node id's path differs: --pyargs finds the kit in each machine's site-packages.
    assert kvdatabase.key_of("m", "/venv/a/test_x.py::T::t") == kvdatabase.key_of(
        "m", "../b/test_x.py::T::t"
    )
