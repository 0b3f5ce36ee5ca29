"""Which backend runs a kernel call: the HIP extension, Triton, or torch. Decided per call, logged once.

Availability: "hip" needs the csrc extension built (ROCm or CUDA torch) and a GPU tensor; "triton" needs triton
importable and either a GPU tensor or TRITON_INTERPRET=1 (the CPU interpreter used by the tests). "auto"
takes the first available of hip > triton > torch. An explicit request that is unavailable here falls
back to the "auto" choice with a one-time warning, so a flag never makes a run fail on a CPU machine.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os

import torch

from megatron.errors import ConfigError
from megatron.kernels import hip_ops

BACKENDS = ("auto", "torch", "triton", "hip")
PREFERENCE = ("hip", "triton", "torch")
_PREFERENCE = PREFERENCE

log = logging.getLogger(__name__)
_said: set[str] = set()


def once(key: str, msg: str, level: int = logging.WARNING) -> None:
    """Log msg the first time key is seen in this process."""
    if key not in _said:
        _said.add(key)
        log.log(level, msg)


@functools.cache
def triton_importable() -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton.language  # noqa: F401
    except (ImportError, OSError, RuntimeError, AttributeError):  # a broken triton must not break torch
        return False
    return True


def _is_gpu(device: torch.device) -> bool:
    # ROCm torch exposes MI250X GCDs as device type "cuda".
    return device.type == "cuda"


def available(backend: str, op: str, device: torch.device) -> tuple[bool, str]:
    """(usable, reason-if-not) for one backend, op ("attention" | "norm") and device."""
    if backend == "torch":
        return True, ""
    if backend == "triton":
        # Device first: on a plain CPU run, triton is never imported.
        if not (_is_gpu(device) or os.environ.get("TRITON_INTERPRET") == "1"):
            return False, f"device is {device.type} and TRITON_INTERPRET is not 1"
        if not triton_importable():
            return False, "triton is not installed"
        return True, ""
    if backend == "hip":

        if not hip_ops.built(op):
            return False, "the csrc HIP extension is not built (needs ROCm or CUDA torch at install time)"
        if not _is_gpu(device):
            return False, f"device is {device.type}"
        return True, ""
    raise ConfigError(f"kernel backend {backend!r}: choose one of {', '.join(BACKENDS)}")


def choose(op: str, requested: str, device: torch.device) -> str:
    """The backend that will run op on device, given the requested one."""
    if requested not in BACKENDS:
        raise ConfigError(f"kernel backend {requested!r}: choose one of {', '.join(BACKENDS)}")
    if requested == "torch":
        return "torch"
    best = next(b for b in _PREFERENCE if available(b, op, device)[0])
    if requested == "auto":
        once(f"auto:{op}:{device.type}", f"{op}: backend 'auto' uses {best!r} on {device.type}", logging.INFO)
        return best
    ok, why = available(requested, op, device)
    if ok:
        return requested
    once(f"unavail:{op}:{requested}:{device.type}", f"{op}: backend {requested!r} unavailable ({why}); using {best!r}")
    return best


def fallback_order(chosen: str) -> tuple[str, ...]:
    """chosen, then the lower-preference backends to try when it cannot take the inputs."""
    return _PREFERENCE[_PREFERENCE.index(chosen):]
