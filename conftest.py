"""This repository's own settings for its own tests; a user of the kit gets none of them.

- The tests outside the kit's classes run as the kit's do: the kit sets its Hypothesis
  settings and torch threads only around its own tests (``kvcheck.profiles``), so this host
  sets the same for everything else (``examples/`` included).
- ``kv_device``: a test with this mark builds on the kit's device (``--kv-device``) and is
  skipped where this machine lacks it, as the kit's own tests are.
- ``long``: a test of a second or more (pytest in a process of its own, a search of
  hundreds of draws); these are handed out first.
- ``--soak``: this repository's kit classes search at their full depth (``tests.depth``), and
  the tests marked ``soak`` run (else they are skipped, saying so): what the default run
  leaves to ``.ci/run`` to stay within a minute on two cores.

The caches that the kit's classes without a factory test here are named in pyproject.toml
(``kv_impl``). The kit's options and ini keys are the plugin's (``kvcheck.plugin``).
"""

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
pytest_plugins = ["pytester"]  # runs of pytest in this process (tests/pytest_run.py)


def ours(config: pytest.Config) -> bool:
    """Whether this is a run of this repository's tests. pytest also loads this file where
    another project's run collects ``kvcheck/test_conformance.py`` from this checkout (an
    editable install, ``pytest --pyargs kvcheck``): that run is left as it is."""
    return config.rootpath.resolve() == HERE


SOAK_ONLY = "runs with --soak only, as .ci/run runs it"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--soak",
        action="store_true",
        help="this repository's kit classes search at their full depth, not the default "
        "run's share of it (tests/depth.py); .ci/run runs it",
    )


def controls_workers(config: pytest.Config) -> bool:
    """Whether this process is pytest-xdist's controller, whose workers run the tests."""
    return not hasattr(config, "workerinput") and getattr(config.option, "dist", "no") != "no"


@pytest.hookimpl(trylast=True)  # after the kit's plugin has read its options
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "kv_device: a test that runs on --kv-device (skipped where it is unavailable)"
    )
    config.addinivalue_line("markers", f"soak: {SOAK_ONLY} (tests/depth.py)")
    config.addinivalue_line("markers", "long: takes a second or more: handed out first")
    if not ours(config) or not config.pluginmanager.has_plugin("kvcheck"):
        return
    if controls_workers(config):  # it runs no test: torch, some 2 s, only in the workers
        return
    import torch
    from hypothesis import settings

    from kvcheck import plugin, profiles
    from tests import depth

    depth.SOAK = config.getoption("--soak")
    plugin.prepare(config)  # the kit's profile and device, before any test module imports
    settings.register_profile("kvcheck", profiles.current())
    settings.load_profile("kvcheck")
    torch.set_num_threads(1)  # tiny tensors; see kvcheck.profiles


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not ours(config):
        return
    # The longest tests first: started last, one would keep a worker busy seconds after the
    # other had run out of tests (pytest-xdist hands tests out in this order).
    items.sort(key=lambda item: item.get_closest_marker("long") is None)
    if config.getoption("--soak"):
        return
    skip = pytest.mark.skip(reason=f"soak tier: {SOAK_ONLY}")
    for item in items:
        if item.get_closest_marker("soak") or on_processes_beyond_the_builtins(item):
            item.add_marker(skip)


def on_processes_beyond_the_builtins(item: pytest.Item) -> bool:
    """The sharded runtime of a cache other than the built-ins: its group of processes costs
    some 0.7 s to start, so the default run starts it for the built-ins only."""
    prop = item.get_closest_marker("kv_property")
    return (
        prop is not None
        and prop.args[0] == "sharded runtime"
        and item.path.name != ("test_builtins.py")
    )


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("kv_device") and ours(item.config):
        from kvcheck import plugin

        plugin.skip_where_the_device_is_unavailable()


def pytest_sessionfinish(session: pytest.Session) -> None:
    # pytest's unraisable-exception plugin ends each process with five full collections,
    # some 0.2 s each over a heap holding torch: a second of every worker's run. What is
    # alive now is frozen out of them; the tests' own objects were collected as they ran.
    if ours(session.config):
        import gc

        gc.freeze()
