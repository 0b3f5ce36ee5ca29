"""Peak FLOP rate of one device, for MFU: FRONTIER.md's MI250X figures, or measured once on CPU."""

from __future__ import annotations

import time

import torch
from deepspeed.accelerator import get_accelerator

# One MI250X GCD: 1024 flop/clk/CU x 110 CU x 1.7 GHz for bf16/fp16 matrix ops; 47.9 for fp32 matrix.
MI250X_GCD_PEAK_TFLOPS = {"bf16": 191.5, "fp16": 191.5, "fp32": 47.9}


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
    if get_accelerator().device_name() == "cpu":
        return measure_cpu_matmul_tflops(), "measured fp32 matmul on this CPU process"
    return MI250X_GCD_PEAK_TFLOPS[precision], f"MI250X GCD {precision} peak"
