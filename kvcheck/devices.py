"""The device the kit's caches, models and rows live on (``--kv-device``), and the dtypes
drawn there.

Chosen once per run by the plugin (default ``cpu``). A device this machine does not have
(``cuda`` without a GPU, ``cuda:7`` on a one-GPU machine, ``mps`` off a Mac) is not an error
of the cache under test: ``unavailable()`` says why, and the kit's tests skip with that
reason. A dtype the device cannot compute in is dropped from the draws (``usable``).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

_chosen = [torch.device("cpu")]


def choose(value: str | None) -> torch.device:
    """Set the kit's device from ``--kv-device`` (None: cpu); refuse a malformed name."""
    if value is None or not value.strip():
        device = torch.device("cpu")
    else:
        try:
            device = torch.device(value.strip())
        except RuntimeError as error:
            raise ValueError(
                f"{value!r} is not a torch device (e.g. cpu, cuda, cuda:1, mps): {error}"
            ) from None
    if device.type == "meta":
        raise ValueError("'meta' tensors hold no values: the kit needs a device that computes")
    _chosen[:] = [device]
    return device


def dtype_name(dtype: torch.dtype) -> str:
    """``float64`` for ``torch.float64``: a dtype as messages show it."""
    return str(dtype).removeprefix("torch.")


def current() -> torch.device:
    return _chosen[0]


def placed(plan):
    """``plan`` (a frozen dataclass with a ``spec``) with its spec on the run's device: a
    pinned plan is written before the run chooses one, a drawn one is there already."""
    if plan.spec.device == current():
        return plan
    return dataclasses.replace(plan, spec=dataclasses.replace(plan.spec, device=current()))


def describe() -> str:
    """The device and the dtypes drawn on it, for the run header."""
    device = current()
    if reason := unavailable(device):
        return f"{device} (unavailable: {reason})"
    return f"{device} ({', '.join(dtype_name(d) for d in usable(ALL_DTYPES))})"


def unavailable(device: torch.device | None = None) -> str | None:
    """Why the kit cannot run on ``device`` (default: the chosen one) here, or None."""
    return _unavailable(current() if device is None else device)


@functools.cache
def _unavailable(device: torch.device) -> str | None:
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = "" if torch.version.cuda else "; this torch build has no CUDA"
            return f"no CUDA device on this machine (torch.cuda.is_available() is False{build})"
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            return f"{device} does not exist: this machine has {count} CUDA device(s)"
    if device.type == "mps" and not torch.backends.mps.is_available():
        return "no MPS device on this machine (torch.backends.mps.is_available() is False)"
    try:
        torch.zeros(1, device=device)
    except Exception as error:  # whatever the backend raises, the device is not usable
        return f"cannot allocate a tensor on {device}: {type(error).__name__}: {error}"
    return None


ALL_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def supports(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``device`` computes what the reference model needs in ``dtype`` (MPS has no
    float64, for one)."""
    if unavailable(device):
        return False
    try:
        square = torch.ones(2, 2, dtype=dtype, device=device)
        (square @ square).softmax(-1).rsqrt().sum().item()
    except Exception:  # an unsupported dtype fails in a backend-specific way
        return False
    return True


def usable(dtypes: tuple[torch.dtype, ...]) -> tuple[torch.dtype, ...]:
    """``dtypes`` the chosen device supports, in order (all of them where it is unavailable:
    its tests skip before drawing)."""
    device = current()
    if unavailable(device):
        return dtypes
    return tuple(dtype for dtype in dtypes if supports(dtype, device))
