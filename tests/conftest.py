"""This repository's own tests run as the kit's tests do: the kit sets its
Hypothesis settings and torch threads only around its own tests (``kvcheck.profiles``), so
its host, here, sets the same for everything else."""

import pytest
import torch
from hypothesis import settings


@pytest.hookimpl(trylast=True)  # after the kit's plugin has read --kv-profile
def pytest_configure(config: pytest.Config) -> None:
    from kvcheck import profiles

    settings.register_profile("kvcheck", profiles.current())
    settings.load_profile("kvcheck")
    torch.set_num_threads(1)  # tiny tensors; see kvcheck.profiles
