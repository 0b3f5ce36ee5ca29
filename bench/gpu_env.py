"""What the GPU benchmarks share: the one-line exit without a GPU, the device/version header, peak FLOP
rates by device name, and accelerator-event timing (deepspeed's get_accelerator(), never a hard-coded
device type)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from megatron.perf.peaks import peak_by_name  # noqa: E402 (after REPO is on sys.path)


def require_gpu(script: str) -> None:
    """Exit with one line (status 2) when torch sees no accelerator; checked before any heavy import."""
    import torch

    acc = getattr(torch, "accelerator", None)
    available = acc.is_available() if acc is not None else False
    if not available:
        print(f"{script}: a GPU is needed (torch sees no accelerator here); nothing was measured")
        sys.exit(2)


def device():
    import torch
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())


def device_name() -> str:
    import torch

    dev = device()
    return torch.get_device_module(dev.type).get_device_name(dev)


def peak_tflops(override: float | None = None) -> tuple[float, str]:
    if override:
        return override, "--peak-tflops"
    name = device_name()
    known = peak_by_name(name)
    if known is not None:
        return known[1], f"{known[0]} bf16 dense datasheet peak"
    raise SystemExit(f"no known bf16 peak for device {name!r}: pass --peak-tflops")


def driver_version() -> str:
    for tool, args in (("nvidia-smi", ["--query-gpu=driver_version", "--format=csv,noheader"]),
                       ("rocm-smi", ["--showdriverversion"])):
        if shutil.which(tool):
            try:
                out = subprocess.run([tool, *args], capture_output=True, text=True, timeout=30).stdout.strip()
                return out.splitlines()[0] if tool == "nvidia-smi" else " ".join(out.split()[-2:])
            except (OSError, subprocess.SubprocessError, IndexError):
                pass
    return "unknown"


def versions() -> dict[str, str]:
    import torch

    out = {"device": device_name(), "torch": torch.__version__,
           "cuda/hip": f"cuda {torch.version.cuda}" if torch.version.hip is None else f"hip {torch.version.hip}",
           "driver": driver_version()}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = "absent"
    import deepspeed

    out["deepspeed"] = deepspeed.__version__
    return out


def header() -> str:
    return "; ".join(f"{k} {v}" for k, v in versions().items())


def time_ms(fn, warmup: int = 3, reps: int = 20) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` runs, accelerator events around each (the same timer
    that ``auto`` kernel selection uses, so bench and selection measure alike)."""
    from megatron.kernels.measure import AcceleratorTimer

    return AcceleratorTimer(warmup, reps)("bench", fn)
