"""Datasheet peak FLOP rates of the devices a run may land on, by a part of the device's name (no torch needed)."""

from __future__ import annotations

# One MI250X GCD: 1024 flop/clk/CU x 110 CU x 1.7 GHz for bf16/fp16 matrix ops; 47.9 for fp32 matrix.
MI250X_GCD_PEAK_TFLOPS = {"bf16": 191.5, "fp16": 191.5, "fp32": 47.9}
# Dense 16-bit tensor-core peaks (vendor datasheets), TFLOP/s per device, by a part of the device's name. MI250X:
# one GCD (half a package), which is the device a rank drives.
PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "GH200": 989.4, "A100": 312.0, "MI250X": 191.5,
                    "MI250": 181.0, "MI300X": 1307.4, "MI300A": 980.6}


def peak_by_name(name: str) -> tuple[str, float] | None:
    """(table key, 16-bit peak) for a device name such as "NVIDIA H100 80GB HBM3", or None when unknown."""
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):  # "MI250X" before "MI250"
        if key in name:
            return key, PEAK_BF16_TFLOPS[key]
    return None
