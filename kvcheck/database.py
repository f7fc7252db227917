"""Where the kit's searches keep the examples that failed: ``--kv-database`` (contract 11.3).

Hypothesis already replays a saved counterexample first and shrinks from it; the kit only
chooses where it lives:

- ``--kv-database DIR`` (or ``KV_DATABASE``): a ``DirectoryBasedExampleDatabase`` there, a
  directory on a filesystem the machines share;
- ``--kv-database redis://host:port/db``: Hypothesis's ``RedisExampleDatabase`` on that
  server (the ``redis`` package, extra ``kvcache-verify[redis]``), pinged once when the run
  starts, so that one the run cannot reach stops it there with the URL;
- ``--kv-database-read-only``: what it holds is replayed, nothing is written to it, and
  nothing is deleted from it.

The local ``.hypothesis/examples`` directory (Hypothesis's default database) is kept beside
it, written as usual, so a developer's own failures still replay. With no database named the
kit keeps Hypothesis's default database (none in the ``ci`` profile), as it did before.

Hypothesis keys an example by the test function it failed, and every property of the kit
runs through the same function (``kvcheck.kit.search``): the kit keys each example by the
pytest test that ran it as well (``Keyed``; module, class, test and its parameters: the
cache's label, path and case), in a shared database and in the local one alike, so that the
failure of one property on one cache is replayed there, and not tried and deleted by every
other test of the run.

Nothing here imports torch; ``redis`` is imported only for a Redis URL.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from hypothesis import settings
from hypothesis.database import (
    DirectoryBasedExampleDatabase,
    ExampleDatabase,
    MultiplexedDatabase,
    ReadOnlyDatabase,
)

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
EXTRA = "kvcache-verify[redis]"
# How long the start-up ping (and any later connect) waits for the server, and any reply
# after, unless the URL says otherwise (?socket_connect_timeout=, ?socket_timeout=).
CONNECT_TIMEOUT_S = 10
REPLY_TIMEOUT_S = 60
# A failure not seen again for this long is dropped by the server: above a week, so that a
# weekly thorough job keeps what the last one found (Hypothesis's own default).
EXPIRE_AFTER = timedelta(days=8)


class DatabaseError(ValueError):
    """A database named that cannot be used; the message says why, and names it."""


def is_redis(where: str) -> bool:
    return where.startswith(REDIS_SCHEMES)


def describe(where: str) -> str:
    """``where`` as the run's lines and errors name it: a Redis URL without its password."""
    if not is_redis(where):
        return where
    parts = urlsplit(where)
    if parts.password is None:
        return where
    user = f"{parts.username}:" if parts.username else ":"
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}***@{host}"))


def shared(where: str, *, read_only: bool = False) -> ExampleDatabase:
    """The database ``where`` names (a directory, or a Redis URL), read-only if asked."""
    if not where.strip():
        raise DatabaseError("--kv-database / KV_DATABASE: empty; name a directory or redis://")
    database = redis_database(where) if is_redis(where) else directory_database(where)
    return ReadOnlyDatabase(database) if read_only else database


def directory_database(where: str) -> ExampleDatabase:
    path = Path(where).expanduser()
    if path.exists() and not path.is_dir():
        raise DatabaseError(f"--kv-database {where}: not a directory")
    return DirectoryBasedExampleDatabase(path)


def redis_database(url: str) -> ExampleDatabase:
    """Hypothesis's ``RedisExampleDatabase`` on the server at ``url``, which answered a
    ping; a ``DatabaseError`` naming the URL where the package is missing, the URL is not
    one, or the server does not answer."""
    shown = describe(url)
    try:
        import redis
    except ImportError:
        raise DatabaseError(
            f"--kv-database {shown}: a Redis database needs the redis package; install the "
            f"extra: pip install '{EXTRA}'"
        ) from None
    from hypothesis.extra.redis import RedisExampleDatabase

    try:
        client = redis.Redis.from_url(
            url, socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=REPLY_TIMEOUT_S
        )
    except ValueError as error:
        raise DatabaseError(f"--kv-database {shown}: not a Redis URL ({error})") from None
    try:
        client.ping()
    except redis.RedisError as error:
        client.close()
        raise DatabaseError(
            f"--kv-database {shown}: the Redis server does not answer ({error})"
        ) from None
    return RedisExampleDatabase(client, expire_after=EXPIRE_AFTER)


def for_run(where: str, *, read_only: bool = False) -> ExampleDatabase:
    """The database of a run given ``--kv-database where``: the local ``.hypothesis``
    examples (written as usual) and the one named (read-only if asked)."""
    local = settings.get_profile("default").database  # Hypothesis's own: .hypothesis/examples
    return MultiplexedDatabase(local, shared(where, read_only=read_only))


class Keyed(ExampleDatabase):
    """``database`` with every key prefixed by ``prefix``: the examples of one test."""

    def __init__(self, database: ExampleDatabase, prefix: bytes) -> None:
        super().__init__()
        self._wrapped = database
        self._prefix = prefix

    def __repr__(self) -> str:
        return f"Keyed({self._wrapped!r}, {self._prefix!r})"

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Keyed)
            and self._wrapped == other._wrapped
            and self._prefix == other._prefix
        )

    def __hash__(self) -> int:
        return hash((type(self), self._prefix))

    def fetch(self, key: bytes) -> Iterable[bytes]:
        yield from self._wrapped.fetch(self._prefix + key)

    def save(self, key: bytes, value: bytes) -> None:
        self._wrapped.save(self._prefix + key, value)

    def delete(self, key: bytes, value: bytes) -> None:
        self._wrapped.delete(self._prefix + key, value)

    def move(self, src: bytes, dest: bytes, value: bytes) -> None:
        self._wrapped.move(self._prefix + src, self._prefix + dest, value)

    # Nothing of the kit listens for changes (Hypothesis's observability does, not a run).
    def _start_listening(self) -> None:
        pass

    def _stop_listening(self) -> None:
        pass


def key_of(module: str, nodeid: str) -> bytes:
    """The prefix of a test's examples: its module's name and its id within the module
    (class, test, parameters), the same on every machine and checkout (a node id's path
    is not: ``--pyargs`` finds the kit in each machine's site-packages)."""
    within = nodeid.split("::", 1)[1] if "::" in nodeid else nodeid
    return f"kvcheck:{module}::{within}:".encode()
