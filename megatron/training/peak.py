"""Peak FLOP rate of one device, for MFU: the datasheet figure of the device the run is on (FRONTIER.md's for the
MI250X), or measured once on CPU."""

from __future__ import annotations

import time

import torch
from deepspeed.accelerator import get_accelerator

from megatron.perf.peaks import MI250X_GCD_PEAK_TFLOPS, peak_by_name

def measure_cpu_matmul_tflops(n: int = 512, seconds: float = 0.3, dtype=torch.float32) -> float:
    """Best observed rate of an n x n matmul on this process's threads (a practical peak)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    torch.mm(a, b)  # warm up
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        for _ in range(4):
            torch.mm(a, b)
        dt = time.perf_counter() - t0
        best = max(best, 4 * 2 * n**3 / dt / 1e12)
    return best


def device_peak_tflops(precision: str, override: float | None = None) -> tuple[float, str]:
    """(peak TFLOP/s, where the figure came from)."""
    if override:
        return override, "--peak-tflops"
    acc = get_accelerator()
    if acc.device_name() == "cpu":
        return measure_cpu_matmul_tflops(), "measured fp32 matmul on this CPU process"
    dev = torch.device(acc.current_device_name())
    name = torch.get_device_module(dev.type).get_device_name(dev)
    known = peak_by_name(name)
    if known is None:  # the MFU figure would be against another device's peak: say so, and how to fix it
        return MI250X_GCD_PEAK_TFLOPS[precision], (f"MI250X GCD {precision} peak: {name!r} has no datasheet figure "
                                                   "here, pass --peak-tflops")
    key, peak = known
    if key == "MI250X":
        return MI250X_GCD_PEAK_TFLOPS[precision], f"MI250X GCD {precision} peak"
    if precision == "fp32":  # only the 16-bit tensor-core figures are tabled: no fp32 MFU against them
        return peak, f"{key} 16-bit dense datasheet peak (an fp32 run's MFU is against it; pass --peak-tflops)"
    return peak, f"{key} {precision} dense datasheet peak"
