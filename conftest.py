"""This repository's own settings for its own tests; a user of the kit gets none of them.

- The tests outside the kit's classes run as the kit's do: the kit sets its Hypothesis
  settings and torch threads only around its own tests (``kvcheck.profiles``), so this host
  sets the same for everything else (``examples/`` included).
- ``kv_device``: a test with this mark builds on the kit's device (``--kv-device``) and is
  skipped where this machine lacks it, as the kit's own tests are.

The caches that the kit's classes without a factory test here are named in pyproject.toml
(``kv_impl``). The kit's options and ini keys are the plugin's (``kvcheck.plugin``).
"""

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def ours(config: pytest.Config) -> bool:
    """Whether this is a run of this repository's tests. pytest also loads this file where
    another project's run collects ``kvcheck/test_conformance.py`` from this checkout (an
    editable install, ``pytest --pyargs kvcheck``): that run is left as it is."""
    return config.rootpath.resolve() == HERE


@pytest.hookimpl(trylast=True)  # after the kit's plugin has read its options
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "kv_device: a test that runs on --kv-device (skipped where it is unavailable)"
    )
    if not ours(config) or not config.pluginmanager.has_plugin("kvcheck"):
        return
    import torch
    from hypothesis import settings

    from kvcheck import plugin, profiles

    plugin.prepare(config)  # the kit's profile and device, before any test module imports
    settings.register_profile("kvcheck", profiles.current())
    settings.load_profile("kvcheck")
    torch.set_num_threads(1)  # tiny tensors; see kvcheck.profiles


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("kv_device") and ours(item.config):
        from kvcheck import plugin

        plugin.skip_where_the_device_is_unavailable()
