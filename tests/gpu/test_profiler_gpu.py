"""--profile on a GPU: the trace holds the device's kernels for the profiled steps (CUDA and ROCm torch both
report as the CUDA activity). The CPU twin is tests/unit/test_profiler.py."""

from __future__ import annotations

import glob
import gzip
import json

import torch

from megatron.config import ProfileConfig
from megatron.training.profiler import StepProfiler


def test_trace_holds_device_kernels(tmp_path):
    from deepspeed.accelerator import get_accelerator

    profile = ProfileConfig(mode="pt", steps="2,3", ranks=None, tensorboard_dir=str(tmp_path))
    profiler = StepProfiler(profile, rank=0, device_name=get_accelerator().device_name())
    x = torch.randn(256, 256, device=get_accelerator().current_device_name())
    for _ in range(4):
        profiler.begin()
        x = torch.tanh(x @ x)
        profiler.end()
    torch.cuda.synchronize()
    (trace,) = glob.glob(str(tmp_path / "*.pt.trace.json.gz"))
    with gzip.open(trace) as f:
        events = json.load(f)["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events), "no device kernel in the trace"
