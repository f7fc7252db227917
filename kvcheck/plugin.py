"""The pytest plugin of the kit, registered by the installed package (entry point ``pytest11``).

It adds, wherever the package is installed:

- ``--kv-impl NAME`` (repeatable), the ``KV_IMPL`` environment variable (comma-separated) and
  the ``kv_impl`` ini option: the caches that the kit's classes without a ``factory`` test
  (every built-in when none is named); NAME is a built-in, ``MODULE:ATTR``, or either after
  a label (``mine=mypkg.caches:MyCache``, test ids ``[mine]``): ``kvcheck.selection``;
- ``--kv-profile dev|ci|thorough``: how hard the kit's tests search (``kvcheck.profiles``;
  the kit loads no Hypothesis profile for the process);
- ``--kv-torch-threads N|keep``: torch threads while a kit test runs (default 1);
- ``--kv-page N``, ``--kv-head-dim D``, ``--kv-heads H``, ``--kv-max-batch B``: the sizes
  the caches under test are built around (``kvcheck.Sizes``), for the draws to hit on
  purpose; they win over a cache's own ``kv_sizes`` and a test class's ``sizes``;
- ``--kv-device DEVICE`` (or ``KV_DEVICE``, or the ``kv_device`` ini option): where the kit
  builds every model, cache and row (default cpu); on a device this machine lacks, the kit's
  tests skip with the reason (``kvcheck.devices``);
- the run header line naming the caches under test, and the verdict per cache at the end
  of the run (``--kv-report PATH`` writes it as JSON).

It changes nothing else in the process that hosts it.
"""

from __future__ import annotations

import os
import sys

import pytest

from kvcheck import selection

SELECTED = pytest.StashKey[dict]()  # test id -> selection.Selected, resolved once per run


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvcheck", "kv cache conformance kit")
    group.addoption(
        "--kv-impl",
        action="append",
        default=[],
        metavar="NAME",
        help="cache to test: a built-in name, MODULE:ATTR, or LABEL=either, LABEL its test id "
        "(repeatable; default: KV_IMPL, comma-separated, else the kv_impl ini option, else "
        "every built-in)",
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
        "--kv-device",
        metavar="DEVICE",
        default=None,
        help="the torch device the kit runs every model, cache and row on, e.g. cpu, cuda, "
        "cuda:1, mps (default: KV_DEVICE, else the kv_device ini option, else cpu); on a "
        "device this machine lacks, the kit's tests skip with the reason",
    )
    parser.addini("kv_impl", type="linelist", default=[], help="caches to test, as --kv-impl")
    parser.addini("kv_device", default="", help="the kit's device, as --kv-device")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "kv_property(name): the kit property a test checks")
    config.addinivalue_line("markers", "kv_cache(label, name): the cache a test runs on")
    config.addinivalue_line(
        "markers", "kv_device: a test that runs on --kv-device (skipped where it is unavailable)"
    )
    from kvcheck import devices, profiles, verdict

    for option, choose in (
        ("--kv-profile", profiles.choose),
        ("--kv-torch-threads", profiles.choose_threads),
    ):
        try:
            choose(config.getoption(option))
        except ValueError as error:
            raise pytest.UsageError(f"{option}: {error}") from None
    try:
        choose_sizes(config)
    except ValueError as error:
        raise pytest.UsageError(f"kv sizes: {error}") from None
    device = (
        config.getoption("--kv-device") or os.environ.get("KV_DEVICE") or config.getini("kv_device")
    )
    try:
        devices.choose(device)
    except ValueError as error:
        raise pytest.UsageError(f"--kv-device / KV_DEVICE: {error}") from None
    # --kv-impl, else KV_IMPL, else the ini option, else every built-in.
    names = selection.names_given(
        config.getoption("--kv-impl"), os.environ.get("KV_IMPL"), config.getini("kv_impl")
    )
    # A cache module in the directory pytest runs from imports as it would with
    # `python -m pytest`.
    here = str(config.invocation_params.dir)
    if here not in sys.path:
        sys.path.append(here)
    try:
        config.stash[SELECTED] = selection.select(names or list(selection.BUILTINS))
    except ValueError as error:
        raise pytest.UsageError(f"--kv-impl / KV_IMPL: {error}") from None
    verdict.configure(config)


def choose_sizes(config: pytest.Config) -> None:
    """The sizes given by --kv-page, --kv-head-dim, --kv-heads and --kv-max-batch."""
    from kvcheck import sizes

    def numbers(option: str) -> tuple[int, ...]:
        given = ",".join(config.getoption(option)).split(",")
        return tuple(number(option, text) for text in given if text.strip())

    def number(option: str, text: str | None) -> int | None:
        if text is None:
            return None
        if not text.strip().isdigit() or int(text) < 1:
            raise ValueError(f"{option}: {text!r} is not a positive int")
        return int(text)

    sizes.choose_options(
        sizes.Sizes(
            page=number("--kv-page", config.getoption("--kv-page")),
            head_dims=numbers("--kv-head-dim"),
            kv_heads=numbers("--kv-heads"),
            max_batch=number("--kv-max-batch", config.getoption("--kv-max-batch")),
        )
    )


def pytest_report_header(config: pytest.Config) -> list[str]:
    from kvcheck import devices, profiles, sizes

    described = [
        label if label == selected.name else f"{label} ({selected.name})"
        for label, selected in config.stash[SELECTED].items()
    ]
    lines = [
        f"kv caches under test: {', '.join(described)}; kit profile: {profiles.current_name()}; "
        f"kv device: {devices.describe()}"
    ]
    if sizes.from_options() != sizes.NONE:
        lines.append(f"kv sizes from the command line: {sizes.from_options().describe()}")
    declared = [
        f"{label} {sizes.declared_on(selected.factory).describe()}"
        for label, selected in config.stash[SELECTED].items()
        if sizes.declared_on(selected.factory) != sizes.NONE
    ]
    if declared:
        lines.append(f"kv sizes the caches declare: {'; '.join(declared)}")
    return lines


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A kit test (or one marked ``kv_device``) on a device this machine lacks is skipped,
    with the reason, before it builds anything there."""
    if item.get_closest_marker("kv_property") or item.get_closest_marker("kv_device"):
        from kvcheck import devices

        if reason := devices.unavailable():
            pytest.skip(f"--kv-device {devices.current()}: {reason}")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    from kvcheck.base import KitTests

    cls = metafunc.cls
    if cls is None or not issubclass(cls, KitTests) or "cache_factory" not in metafunc.fixturenames:
        return
    if cls.factory is not None:
        label = cls.cache_name or getattr(cls.factory, "__name__", None) or cls.__name__
        module = getattr(cls.factory, "__module__", "?")
        caches = [(label, f"{module}:{label}", cls.factory)]
    else:
        selected = metafunc.config.stash[SELECTED]
        caches = [(label, name, factory) for label, (name, factory) in selected.items()]
    metafunc.parametrize(
        "cache_factory",
        [
            pytest.param(factory, id=label, marks=pytest.mark.kv_cache(label, name))
            for label, name, factory in caches
        ],
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    from kvcheck import verdict

    entry = verdict.entry_for(item, call, report)
    if entry is not None:
        # A list of its own: item.user_properties is shared by the setup, call and teardown
        # reports. Values are plain data, so pytest-xdist carries them to the controller.
        report.user_properties = [*report.user_properties, (verdict.KEY, entry)]
    return report
