"""The pytest plugin of the kit, registered by the installed package (entry point ``pytest11``).

It adds, wherever the package is installed:

- ``--kv-impl NAME`` (repeatable), the ``KV_IMPL`` environment variable (comma-separated) and
  the ``kv_impl`` ini option: the caches that the kit's classes without a ``factory`` test.
  NAME is a built-in's short name, ``MODULE:ATTR``, or either after a label
  (``mine=mypkg.caches:MyCache``, test ids ``[mine]``): ``kvcheck.selection``. With none
  named, collecting such a class is a usage error that says how to name one;
- ``--kv-property NAME`` (repeatable): the kit's properties to run, by the names the verdict
  prints; the other kit tests are deselected;
- ``--kv-profile dev|ci|thorough``: how hard the kit's tests search (``kvcheck.profiles``;
  the kit loads no Hypothesis profile for the process);
- ``--kv-torch-threads N|keep``: torch threads while a kit test runs (default 1);
- ``--kv-page N``, ``--kv-head-dim D``, ``--kv-heads H``, ``--kv-max-batch B``: the sizes
  the caches under test are built around (``kvcheck.Sizes``), for the draws to hit on
  purpose; ``--kv-supports FIELD=VALUES``: what they support (``kvcheck.Domain``: nothing is
  drawn outside it); they win over a cache's own ``kv_sizes`` and a test class's ``sizes``;
- ``--kv-device DEVICE`` (or ``KV_DEVICE``, or the ``kv_device`` ini option): where the kit
  builds every model, cache and row (default cpu); on a device this machine lacks, the kit's
  tests skip with the reason (``kvcheck.devices``);
- ``--kv-database DIR|redis://host:port/db`` (or ``KV_DATABASE``): where every search of the
  run keeps the examples that failed and replays them first, beside the local
  ``.hypothesis`` directory; ``--kv-database-read-only`` replays without writing to it
  (``kvcheck.database``, docs/search.md). Built, and a Redis server pinged, when pytest is
  configured, in each pytest-xdist worker too; a database that cannot be used stops the
  run there with a usage error that names it;
- ``--kv-contract VERSION`` (or ``KV_CONTRACT``, or the ``kv_contract`` ini option): the
  version of the contract the caches are held to (``kvcheck.contract``, docs/contract.md
  section 12; default the kit's own): properties and bad-input cases that arrived after it
  run and are reported, as expected failures where they fail, and are not counted;
- after collection, the lines naming the caches under test, the kit's profile, device,
  contract version, sizes and each cache's domain (under pytest-xdist, where only the
  workers collect, at the top of the verdict); and the verdict per cache at the end of the
  run (``--kv-report PATH`` writes it as JSON), which counts each property's tests that ran
  against those collection made (a property some of whose tests were left out is partly run).

A run that collects no kit test pays for importing this module, ``kvcheck.selection``,
``kvcheck.contract`` and ``kvcheck.verdict`` (none of them imports torch, Hypothesis or a
cache), and the plugin prints nothing. The options are checked when pytest is configured as
far as that needs no torch; the rest (the device, the sizes as a whole, the caches named)
when the first kit class (a subclass of ``kvcheck.base.KitTests``) is collected, where a
wrong one stops the run with a usage error (under pytest-xdist, where the workers collect: a
collection error of one line). It changes nothing else in the process that hosts it, and puts
the settings it applied back as they were when the run ends.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest

from kvcheck import contract, selection, verdict

# The names of kvcheck.profiles.PROFILES, to check --kv-profile without importing torch (a
# test checks they agree).
PROFILES = ("dev", "ci", "thorough")


@dataclass
class KitRun:
    """The kit's settings for a run: read and checked when pytest is configured (no torch),
    applied (``prepare``) when the first kit class is collected."""

    profile: str | None
    threads: str | None
    sizes: dict[str, object]  # kvcheck.Sizes's fields; supports: kvcheck.Domain's
    device: str | None
    names: list[str]  # the caches for classes without a factory (kvcheck.selection)
    database: str | None = None  # --kv-database / KV_DATABASE, as given
    read_only: bool = False  # --kv-database-read-only
    built: object = None  # the run's hypothesis ExampleDatabase, where one is named
    prepared: bool = False
    selected: dict[str, selection.Selected] | None = None  # resolved at the first such class
    error: str | None = None  # the first usage error met while collecting
    lines: list[str] | None = None  # the kit's lines after collection (none: no kit test)
    contract: str = contract.VERSION  # the contract version the run is held to
    before: list[tuple[list, list]] | None = None  # the settings prepare() replaced
    exhaustive: int | str | None = None  # --kv-exhaustive: a token count or "auto"
    properties: list[str] = field(default_factory=list)  # --kv-property: names, as printed
    # The kit tests collection made, per (class, cache, property): what a verdict of some of
    # them (a -k, a deselect, a test id) counts the ones that ran against.
    planned: dict[tuple[str, str, str], int] = field(default_factory=dict)
    resume: bool = False  # --kv-exhaustive-resume


RUN = pytest.StashKey[KitRun]()


@pytest.fixture
def kv_block():
    """The block of plans a kit test runs in the bounded-exhaustive mode (the plugin
    parametrizes it there, kvcheck.exhaustive); None, a Hypothesis search, otherwise."""
    return None


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvcheck", "kv cache conformance kit")
    group.addoption(
        "--kv-impl",
        action="append",
        default=[],
        metavar="NAME",
        help="cache for the kit's classes without a factory: a built-in name, MODULE:ATTR, or "
        "LABEL=either, LABEL its test id (repeatable; default: KV_IMPL, comma-separated, else "
        "the kv_impl ini option)",
    )
    group.addoption(
        "--kv-profile",
        metavar="NAME",
        default=None,
        help="how hard the kit searches: dev (20 examples a property), ci (20, derandomized) "
        "or thorough (2,000); default ci where Hypothesis detects CI, else dev",
    )
    group.addoption(
        "--kv-report",
        metavar="PATH",
        default=None,
        help="write the verdict per cache as JSON to PATH",
    )
    group.addoption(
        "--kv-require-reach",
        action="store_true",
        default=False,
        help="fail the run where an edge a property names (kvcheck.reach) was reached by no "
        "test of the run that passed: a draw that stopped reaching a case",
    )
    group.addoption(
        "--kv-property",
        action="append",
        default=[],
        metavar="NAME",
        help="run only this property of the kit, by the name the verdict prints (repeatable, "
        "e.g. --kv-property logits --kv-property 'bad append'); the other kit tests are "
        "deselected, and a property of which some cases did not run reads as partly run",
    )
    group.addoption(
        "--kv-torch-threads",
        metavar="N|keep",
        default=None,
        help="torch threads while a kit test runs (default 1: the kit's tensors are tiny; "
        "keep: torch's own setting); the host's setting is restored after each test",
    )
    group.addoption(
        "--kv-page",
        metavar="N",
        default=None,
        help="rows per page (block, chunk) of the caches under test: lengths k x N - 1, "
        "k x N, k x N + 1 and chunks straddling pages are drawn on purpose",
    )
    for option, metavar, what in (
        ("--kv-head-dim", "D", "a head width the caches have a path for"),
        ("--kv-heads", "H", "a number of kv heads the caches are built for"),
    ):
        group.addoption(
            option,
            action="append",
            default=[],
            metavar=metavar,
            help=f"{what}, drawn often (repeatable, or comma-separated)",
        )
    group.addoption(
        "--kv-max-batch",
        metavar="B",
        default=None,
        help="the largest batch the caches serve: batches up to it are drawn (default 8)",
    )
    group.addoption(
        "--kv-supports",
        action="append",
        default=[],
        metavar="FIELD=VALUES",
        help="what the caches under test support: nothing is drawn outside it (repeatable; "
        "e.g. dtypes=float16,bfloat16 head_dims=64,128 max_batch=8 windows=false; the fields "
        "of kvcheck.Domain, docs/contract.md section 7)",
    )
    group.addoption(
        "--kv-device",
        metavar="DEVICE",
        default=None,
        help="the torch device the kit runs every model, cache and row on, e.g. cpu, cuda, "
        "cuda:1, mps (default: KV_DEVICE, else the kv_device ini option, else cpu); on a "
        "device this machine lacks, the kit's tests skip with the reason",
    )
    group.addoption(
        "--kv-database",
        metavar="DIR|redis://host:port/db",
        default=None,
        help="where every search keeps the examples that failed, replayed first on the next "
        "run that reads it: a directory (on a shared filesystem) or a Redis server (extra "
        "kvcache-verify[redis]); the local .hypothesis directory is kept beside it (default: "
        "KV_DATABASE, else each profile's own)",
    )
    group.addoption(
        "--kv-database-read-only",
        action="store_true",
        default=False,
        help="replay what --kv-database holds without writing to it or deleting from it",
    )
    group.addoption(
        "--kv-contract",
        metavar="VERSION",
        default=None,
        help=f"hold the caches to this version of the contract (default: KV_CONTRACT, else the "
        f"kv_contract ini option, else the kit's own, {contract.VERSION}); what arrived after it "
        "runs and is reported, not counted (docs/contract.md, section 12)",
    )
    group.addoption(
        "--kv-exhaustive",
        metavar="N|auto",
        default=None,
        help="prove within a scope: run every plan of up to N tokens of each property that "
        "enumerates its plans, on the smallest models, instead of a search (auto: each "
        "property's own N, the nightly job's; docs/exhaustive.md)",
    )
    group.addoption(
        "--kv-exhaustive-resume",
        action="store_true",
        default=False,
        help="with --kv-exhaustive: pass over the blocks of plans an earlier run held on the "
        "same cache code (kept in pytest's cache; --cache-clear forgets them)",
    )
    parser.addini("kv_impl", type="linelist", default=[], help="caches to test, as --kv-impl")
    parser.addini("kv_contract", default="", help="the contract version, as --kv-contract")
    parser.addini("kv_device", default="", help="the kit's device, as --kv-device")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "kv_property(name, since): the kit property a test checks, its contract version"
    )
    config.addinivalue_line("markers", "kv_cache(label, name): the cache a test runs on")
    config.addinivalue_line(
        "markers", "kv_path(path, offered): the model's path through the cache, of those offered"
    )
    config.addinivalue_line("markers", "kv_paths: a kit test run once per path of the model")
    config.addinivalue_line(
        "markers",
        "kv_not_counted(since, reason): arrived after the contract version the run holds to",
    )
    config.stash[RUN] = run = read_options(config)
    verdict.configure(config, held_to=run.contract)


def read_options(config: pytest.Config) -> KitRun:
    """The kit's options, checked as far as that needs no torch (a usage error if not)."""
    profile = config.getoption("--kv-profile")
    if profile is not None and profile not in PROFILES:
        raise pytest.UsageError(
            f"--kv-profile: unknown kit profile {profile!r}; choose one of {', '.join(PROFILES)}"
        )
    threads = config.getoption("--kv-torch-threads")
    if threads not in (None, "keep") and not (threads.isdigit() and int(threads) >= 1):
        raise pytest.UsageError(
            f"--kv-torch-threads: {threads!r} is not a positive number of threads or 'keep'"
        )
    try:
        sizes = read_sizes(config)
        sizes["supports"] = read_supports(config.getoption("--kv-supports"))
    except ValueError as error:
        raise pytest.UsageError(f"kv sizes: {error}") from None
    names = selection.names_given(
        config.getoption("--kv-impl"), os.environ.get("KV_IMPL"), config.getini("kv_impl")
    )
    try:
        selection.labelled(names)
    except ValueError as error:
        raise pytest.UsageError(f"--kv-impl / KV_IMPL: {error}") from None
    device = (
        config.getoption("--kv-device") or os.environ.get("KV_DEVICE") or config.getini("kv_device")
    )
    run = KitRun(profile, threads, sizes, device or None, names)
    run.database = config.getoption("--kv-database") or os.environ.get("KV_DATABASE") or None
    run.read_only = config.getoption("--kv-database-read-only")
    try:
        run.contract = contract.held_to(
            config.getoption("--kv-contract"), config.getini("kv_contract")
        )
    except ValueError as error:
        raise pytest.UsageError(str(error)) from None
    run.properties = [name.strip() for name in config.getoption("--kv-property")]
    if run.properties:  # here, on the controller too: a worker's usage error would crash it
        properties_named(run.properties)
    run.exhaustive = config.getoption("--kv-exhaustive")
    run.resume = config.getoption("--kv-exhaustive-resume")
    if run.exhaustive is not None:
        from kvcheck import exhaustive  # no torch

        try:
            run.exhaustive = exhaustive.parse(run.exhaustive)
        except ValueError as error:
            raise pytest.UsageError(str(error)) from None
    if run.resume and run.exhaustive is None:
        raise pytest.UsageError(
            "--kv-exhaustive-resume: the run is not exhaustive; add --kv-exhaustive N or auto"
        )
    if run.read_only and run.database is None:
        raise pytest.UsageError(
            "--kv-database-read-only: no database named; name it with --kv-database or KV_DATABASE"
        )
    if run.database is not None:  # imports Hypothesis (and redis for a URL) only here
        from kvcheck import database

        try:
            run.built = database.for_run(run.database, read_only=run.read_only)
        except database.DatabaseError as error:
            raise pytest.UsageError(str(error)) from None
    return run


def read_sizes(config: pytest.Config) -> dict[str, int | tuple[int, ...] | None]:
    """The fields of ``kvcheck.Sizes`` given by --kv-page, --kv-head-dim, --kv-heads and
    --kv-max-batch, each a positive int (the rest is checked by ``Sizes`` itself)."""

    def numbers(option: str) -> tuple[int, ...]:
        given = ",".join(config.getoption(option)).split(",")
        return tuple(number(option, text) for text in given if text.strip())

    def number(option: str, text: str | None) -> int | None:
        if text is None:
            return None
        if not text.strip().isdigit() or int(text) < 1:
            raise ValueError(f"{option}: {text!r} is not a positive int")
        return int(text)

    return {
        "page": number("--kv-page", config.getoption("--kv-page")),
        "head_dims": numbers("--kv-head-dim"),
        "kv_heads": numbers("--kv-heads"),
        "max_batch": number("--kv-max-batch", config.getoption("--kv-max-batch")),
    }


# The fields of kvcheck.Domain, by how --kv-supports reads their values (no torch here).
SUPPORT_FIELDS = {
    "dtypes": "names",
    "devices": "names",
    "head_dims": "ints",
    "kv_heads": "ints",
    "groups": "ints",
    "pages": "ints",
    "max_batch": "int",
    "max_length": "int",
    "windows": "bool",
    "sinks": "ints",
    "latent": "bool",
    "latent_dims": "ints",
    "rope_dims": "ints",
}


def read_supports(given: list[str]) -> dict:
    """``--kv-supports FIELD=VALUES`` options as a ``kvcheck.Domain``'s fields."""
    fields: dict = {}
    for text in given:
        field, _, values = text.partition("=")
        field = field.strip()
        kind = SUPPORT_FIELDS.get(field)
        if kind is None or not values.strip():
            raise ValueError(
                f"--kv-supports {text!r}: expected FIELD=VALUES, FIELD one of "
                f"{', '.join(SUPPORT_FIELDS)}"
            )
        items = [item.strip() for item in values.split(",") if item.strip()]
        if kind == "bool":
            if values.strip().lower() not in ("true", "false"):
                raise ValueError(f"--kv-supports {text!r}: {field} is true or false")
            fields[field] = values.strip().lower() == "true"
        elif kind == "names":
            fields[field] = tuple(items)
        else:
            if not all(item.isdigit() for item in items) or (kind == "int" and len(items) > 1):
                many = "positive ints" if kind == "ints" else "one positive int"
                raise ValueError(f"--kv-supports {text!r}: {field} takes {many}")
            numbers = tuple(int(item) for item in items)
            fields[field] = numbers[0] if kind == "int" else numbers
    return fields


def prepare(config: pytest.Config) -> None:
    """Apply the run's kit settings: profile, torch threads, sizes and device; once.

    The plugin calls it when the first kit class is collected; a host whose own tests use
    the kit's device or profile earlier may call it from its ``pytest_configure``. Raises
    pytest.UsageError for sizes or a device that cannot be."""
    run = config.stash[RUN]
    if run.prepared:
        return
    from kvcheck import devices, exhaustive, profiles, sizes

    # The settings live in the kit's modules while the run lasts; the ones they replace come
    # back when it ends (pytest_unconfigure), for a host that runs pytest again in the same
    # process (pytester's in-process runs) and keeps its own.
    held = (
        profiles._chosen,
        profiles._threads,
        profiles._database,
        sizes._from_options,
        devices._chosen,
        exhaustive._chosen,
        exhaustive._resume,
    )
    run.before = [(setting, setting[:]) for setting in held]
    profiles.choose(run.profile)
    profiles.choose_threads(run.threads)
    profiles.choose_database(run.built)
    exhaustive.choose(run.exhaustive, config.cache if run.resume else None)
    try:
        sizes.choose_options(sizes.Sizes(**run.sizes))
    except ValueError as error:
        raise pytest.UsageError(f"kv sizes: {error}") from None
    try:
        devices.choose(run.device)
    except ValueError as error:
        raise pytest.UsageError(f"--kv-device / KV_DEVICE: {error}") from None
    run.prepared = True


def pytest_unconfigure(config: pytest.Config) -> None:
    run = config.stash.get(RUN, None)
    if run is not None and run.before is not None:
        for setting, before in run.before:
            setting[:] = before


def selected(config: pytest.Config) -> dict[str, selection.Selected]:
    """The caches named for the kit's classes without a factory, by label, imported once."""
    run = config.stash[RUN]
    if run.selected is None:
        if not run.names:
            raise pytest.UsageError(selection.NO_CACHE)
        # A cache module in the directory pytest runs from imports as it would with
        # `python -m pytest`.
        here = str(config.invocation_params.dir)
        if here not in sys.path:
            sys.path.append(here)
        try:
            run.selected = selection.select(run.names)
        except ValueError as error:
            raise pytest.UsageError(f"--kv-impl / KV_IMPL: {error}") from None
    return run.selected


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # A kit class's module has imported kvcheck.kit: a run without one never does here.
    kit, engines = sys.modules.get("kvcheck.kit"), sys.modules.get("kvcheck.engines")
    cls = metafunc.cls
    if engines is not None and cls is not None and issubclass(cls, engines.EngineTests):
        engine_blocks(metafunc, cls)
        return
    if kit is None or cls is None or not issubclass(cls, kit.KitTests):
        return
    if "cache_factory" not in metafunc.fixturenames:
        return
    with usage_errors_as_collect_errors(metafunc.config):
        prepare(metafunc.config)
        if cls.factory is not None:
            label = cls.cache_name or getattr(cls.factory, "__name__", None) or cls.__name__
            module = getattr(cls.factory, "__module__", "?")
            caches = [(label, f"{module}:{label}", cls.factory)]
        else:
            caches = [(label, name, f) for label, (name, f) in selected(metafunc.config).items()]
        declared = {label: declaration(label, factory, cls) for label, _, factory in caches}
    # Each cache, and for a property run once per path of the model through the cache, each
    # path it offers: append, and attend where it offers it (the id names the path only then).
    per_path = metafunc.definition.get_closest_marker("kv_paths") is not None
    names, params = ["cache_factory", *(["path"] * per_path)], []
    from kvcheck import sizes

    for label, name, factory in caches:
        with sizes.aiming_at(declared[label]):
            paths = kit.paths_offered(factory) if per_path else (None,)
        for path in paths:
            marks = [pytest.mark.kv_cache(label, name)]
            if per_path:
                marks.append(pytest.mark.kv_path(path, paths))
            ident = label if len(paths) == 1 else f"{label}-{path}"
            params.append(([factory, *([path] * per_path)], ident, marks))
    if (blocks := exhaustive_blocks(metafunc, declared, caches)) is not None:
        names.append("kv_block")
        params = [
            ([*values, block], ident if block is None else f"{ident}-{block}", marks)
            for values, ident, marks in params
            for block in blocks[id(values[0])]
        ]
    metafunc.parametrize(
        names if len(names) > 1 else names[0],
        [
            pytest.param(*values, id=ident, marks=marks)
            if len(names) > 1
            else pytest.param(values[0], id=ident, marks=marks)
            for values, ident, marks in params
        ],
    )


@contextmanager
def usage_errors_as_collect_errors(config: pytest.Config) -> Iterator[None]:
    """A usage error while a class is collected, kept for the run's report and raised as
    the collector's error: collection turns any exception into an error of that class, the
    message alone, which a worker of pytest-xdist reports as that; elsewhere a usage error
    (``pytest_make_collect_report``)."""
    try:
        yield
    except pytest.UsageError as error:
        config.stash[RUN].error = str(error)
        raise pytest.Collector.CollectError(str(error)) from None


def engine_blocks(metafunc: pytest.Metafunc, cls: type) -> None:
    """The kit's settings applied for an engine class too, and in the bounded-exhaustive
    mode each engine property's test parametrized with its blocks of plans
    (``EngineTests.exhaustive_blocks``)."""
    if "engine_factory" not in metafunc.fixturenames:
        return
    with usage_errors_as_collect_errors(metafunc.config):
        prepare(metafunc.config)
    if "kv_block" not in metafunc.fixturenames:  # a test of the class's own, or one wrapped
        return  # without the kit's marks: searched
    blocks = cls().exhaustive_blocks(metafunc)
    if blocks not in (None, [None]):  # else the plugin's kv_block fixture: None, a search
        metafunc.parametrize("kv_block", blocks, ids=str)


def exhaustive_blocks(metafunc: pytest.Metafunc, declared: dict, caches: list) -> dict | None:
    """In the bounded-exhaustive mode, the blocks of plans (``kvcheck.exhaustive``) a kit test
    runs per cache: its property's, within each cache's declared domain; one None (a search)
    for a property that enumerates none or a cache that does not offer it. None outside the
    mode, or for a test that runs no property's plans (a hand-picked edge)."""
    from kvcheck import exhaustive, sizes

    setting = exhaustive.setting_for(metafunc.cls)
    mark = metafunc.definition.get_closest_marker("kv_property")
    if setting is None or mark is None or "kv_block" not in metafunc.fixturenames:
        return None
    from kvcheck.properties import BY_NAME
    from kvcheck.scope import Scope

    prop = BY_NAME[mark.args[0]]
    tokens = exhaustive.tokens_for(prop, setting)
    found: dict = {}
    for label, _, factory in caches:
        with sizes.aiming_at(declared[label]):
            if tokens is None or prop.not_offered(factory):
                found[id(factory)] = [None]
            else:
                found[id(factory)] = exhaustive.blocks(
                    prop, Scope.within_domain(tokens, prop.dtypes)
                )
    return found


def declaration(label: str, factory: object, cls: type):
    """The sizes and domain in force for a cache (``kvcheck.sizes.declared_by``); a usage
    error where its declaration cannot be read."""
    from kvcheck import sizes

    try:
        return sizes.declared_by(factory, cls)
    except (TypeError, ValueError) as error:
        raise pytest.UsageError(f"the sizes {label} declares (kv_sizes, sizes): {error}") from None


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    report = yield
    error, config = collector.config.stash[RUN].error, collector.config
    if error is not None and report.failed and not hasattr(config, "workerinput"):
        raise pytest.UsageError(error)  # the class that failed: the run stops, in one line
    return report


@pytest.hookimpl(wrapper=True)
def pytest_pycollect_makeitem(collector: pytest.Collector, name: str, obj: object):
    # Every test a kit test function makes (its caches, paths, cases), counted before a -k, a
    # deselect or a test id leaves some out: the verdict says how many of them ran.
    made = yield
    if isinstance(made, list):
        planned = collector.config.stash[RUN].planned
        for item in made:
            if (key := planned_key(item)) is not None:
                planned[key] = planned.get(key, 0) + 1
    return made


def planned_key(item: pytest.Item) -> tuple[str, str, str] | None:
    """What a kit test is counted under: its class, its cache's label and its property."""
    prop = item.get_closest_marker("kv_property")
    cache = item.get_closest_marker("kv_cache")
    if prop is None or cache is None:
        return None
    return (getattr(item.parent, "nodeid", ""), cache.args[0], prop.args[0])


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Leave out the kit tests of properties --kv-property does not name; mark what arrived
    after the contract version the run is held to: it runs, and a failure there is reported
    as an expected one, not counted (``pytest_runtest_makereport``)."""
    run = config.stash[RUN]
    if run.properties:
        keep = properties_named(run.properties)
        kept, left_out = [], []
        for item in items:
            mark = item.get_closest_marker("kv_property")
            (kept if mark is None or mark.args[0] in keep else left_out).append(item)
        if left_out:
            config.hook.pytest_deselected(items=left_out)
            items[:] = kept
    if run.contract == contract.VERSION:
        return
    for item in items:
        if (since := arrived_in(item)) and (why := contract.not_counted(since, run.contract)):
            item.add_marker(pytest.mark.kv_not_counted(since, reason=why))


def properties_named(names: list[str]) -> set[str]:
    """The kit's properties (a cache's and an engine's) that --kv-property names; a usage
    error that lists them where a name is none of them."""
    from kvcheck.engines import SINCE as engine_properties
    from kvcheck.properties import SINCE as cache_properties

    known = [
        *cache_properties,
        *(name for name in engine_properties if name not in cache_properties),
    ]
    unknown = [name for name in names if name not in known]
    if unknown:
        import difflib

        hints = [
            f"{name!r} (did you mean {' or '.join(map(repr, close))}?)"
            if (close := difflib.get_close_matches(name, known, n=2))
            else repr(name)
            for name in unknown
        ]
        raise pytest.UsageError(
            f"--kv-property: no property of the kit is named {', '.join(hints)}; the kit's "
            f"properties: {', '.join(known)}"
        )
    return set(names)


def arrived_in(item: pytest.Item) -> str | None:
    """The contract version a kit test's property, or its case, arrived in (the later)."""
    mark = item.get_closest_marker("kv_property")
    if mark is None:
        return None
    since = contract.of_property(mark)
    case = item.callspec.params.get("case") if hasattr(item, "callspec") else None
    return max(since, getattr(case, "since", since), key=contract.key)


def pytest_collection_finish(session: pytest.Session) -> None:
    if hasattr(session.config, "workerinput"):  # for the controller's verdict (xdist)
        session.config.workeroutput[verdict.KEY] = kit_lines(session.config, session.items)
        # Each kit test's cache and property: a test whose worker died before it reported
        # is still the kit's, and a crash, in the verdict.
        session.config.workeroutput[verdict.TESTS_KEY] = {
            item.nodeid: [mark.args[0], mark.args[1], prop.args[0]]
            for item in session.items
            if (mark := item.get_closest_marker("kv_cache"))
            and (prop := item.get_closest_marker("kv_property"))
        }
        if properties := sys.modules.get("kvcheck.properties"):  # kit tests were collected
            session.config.workeroutput[verdict.PROPERTIES_KEY] = properties.SINCE


def pytest_report_collectionfinish(config: pytest.Config, items: list[pytest.Item]) -> list[str]:
    return kit_lines(config, items)


def kit_lines(config: pytest.Config, items: list[pytest.Item]) -> list[str]:
    """The caches the kit tests collected run on, the kit's profile, device and sizes; no
    line where no kit test was collected."""
    run = config.stash[RUN]
    if run.lines is not None:
        return run.lines
    caches: dict[str, tuple[str, tuple]] = {}  # label -> (name, (factory, class)), in order
    for item in items:
        mark = item.get_closest_marker("kv_cache")
        callspec = getattr(item, "callspec", None)
        if mark is not None and callspec is not None and mark.args[0] not in caches:
            factory = callspec.params.get("cache_factory")
            caches[mark.args[0]] = (mark.args[1], (factory, getattr(item, "cls", None)))
    run.lines = []
    if not caches:
        return run.lines
    from kvcheck import devices, profiles, sizes

    described = [
        label if label == name else f"{label} ({name})" for label, (name, _) in caches.items()
    ]
    run.lines.append(
        f"kv caches under test: {', '.join(described)}; kit profile: {profiles.current_name()}; "
        f"kv device: {devices.describe()}"
    )
    if run.contract != contract.VERSION:
        run.lines.append(
            f"kv contract: held to {run.contract} (the kit checks {contract.VERSION}: what "
            f"arrived after {run.contract} runs and is reported, not counted)"
        )
    else:
        run.lines.append(f"kv contract: {contract.VERSION}")
    if run.database is not None:
        from kvcheck import database

        mode = "read-only" if run.read_only else "read and written"
        if (seed := sys.modules["hypothesis.core"].global_force_seed) is not None:
            # Hypothesis reads and writes no database in a search whose seed is forced.
            mode = f"unused: --hypothesis-seed {seed} turns every example database off"
        run.lines.append(
            f"kv example database: {database.describe(run.database)} ({mode}), beside the "
            "local .hypothesis directory"
        )
    blocks = [
        block
        for item in items
        if (block := getattr(item, "callspec", None) and item.callspec.params.get("kv_block"))
    ]
    if blocks:  # the bounded-exhaustive mode (kvcheck.exhaustive)
        tokens = "/".join(map(str, sorted({block.scope.tokens for block in blocks})))
        runs = sum(block.stop - block.first for block in blocks)
        run.lines.append(
            f"kv exhaustive: every plan to {tokens} tokens ({blocks[0].scope.describe()}): "
            f"{runs:,} runs in {len(blocks):,} tests of up to {blocks[0].size} plans; a "
            "property that enumerates none is searched"
        )
    if sizes.from_options().aimed:  # where the draws aim; each cache's domain below
        run.lines.append(f"kv sizes from the command line: {sizes.from_options().describe()}")
    aims = [
        f"{label} {own.describe()}"
        for label, (_, (factory, _)) in caches.items()
        if (own := sizes.declared_on(factory)).aimed
    ]
    if aims:
        run.lines.append(f"kv sizes the caches declare: {'; '.join(aims)}")
    for label, (_, (factory, cls)) in caches.items():
        if (domain := sizes.declared_by(factory, cls).supports).declared:
            run.lines.append(f"kv domain of {label}: {domain.describe()}")
    return run.lines


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    # A search keeps its examples under the test that runs it (kvcheck.database.Keyed):
    # every kit search runs through one function of the kit, which Hypothesis keys them by.
    profiles = sys.modules.get("kvcheck.profiles")  # a run without kit tests: none
    module = getattr(getattr(item, "module", None), "__name__", None)
    if profiles is None or module is None or not item.get_closest_marker("kv_property"):
        return (yield)
    from kvcheck import database, reach

    profiles._test_key[:] = [database.key_of(module, item.nodeid)]
    from kvcheck import exhaustive

    # The edges its plans ran (kvcheck.reach) and what an exhaustive block of them did, for
    # its verdict entry.
    with reach.collecting() as item.stash[verdict.REACHED], exhaustive.recording() as record:
        item.stash[verdict.EXHAUSTED] = record
        try:
            return (yield)
        finally:
            profiles._test_key[:] = []


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("kv_property"):
        skip_where_the_device_is_unavailable()


def skip_where_the_device_is_unavailable() -> None:
    """Skip the test, with the reason, where this machine lacks the kit's device: before it
    builds anything there."""
    from kvcheck import devices

    if reason := devices.unavailable():
        pytest.skip(f"--kv-device {devices.current()}: {reason}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    newer = item.get_closest_marker("kv_not_counted")
    if newer is not None and report.failed and call.excinfo is not None:
        # Failed where the run is not held to: an expected failure, as pytest reports an
        # xfail, but by the kit itself, so that no ini (xfail_strict) or --runxfail turns a
        # run held to an earlier contract red for a rule it does not hold.
        report.outcome, report.wasxfail = "skipped", newer.kwargs["reason"]
    if report.failed and call.excinfo is not None and item.get_closest_marker("kv_property"):
        shown_as_read(item.config, report, call.excinfo.value)
    entry = verdict.entry_for(item, call, report)
    if entry is not None and (key := planned_key(item)) is not None:
        # The property's tests on this cache before any was left out, per class: every
        # class's, those of a class none of whose tests ran included.
        planned = item.config.stash[RUN].planned
        entry["planned"] = {
            group: count for (group, of, prop), count in planned.items() if (of, prop) == key[1:]
        }
    if entry is not None:
        # A list of its own: item.user_properties is shared by the setup, call and teardown
        # reports. Values are plain data, so pytest-xdist carries them to the controller.
        report.user_properties = [*report.user_properties, (verdict.KEY, entry)]
    return report


def shown_as_read(config: pytest.Config, report: pytest.TestReport, error: BaseException):
    """A kit test's failure shown message first, then the cache's own frames
    (``kvcheck.tracebacks``), where pytest's --tb style is its default (or short) and
    --full-trace is not given."""
    from kvcheck import tracebacks

    option = config.option
    if option.tbstyle not in tracebacks.STYLES or option.fulltrace or option.showlocals:
        return
    if (text := tracebacks.readable(error, str(config.rootpath))) is not None:
        report.longrepr = text
