"""--profile / --profile_steps / --profile-ranks (upstream's PyTorch profiler window), in-process on CPU."""

import glob
import gzip
import json

import pytest
import torch

from megatron.config import ProfileConfig
from megatron.errors import ConfigError
from megatron.training.profiler import StepProfiler


def _args(tmp_path, **kw):
    base = {"mode": "pt", "steps": "2,3", "ranks": None, "tensorboard_dir": str(tmp_path)}
    return ProfileConfig(**{**base, **kw})


def profile_window(profile: ProfileConfig):
    return profile.validate().window


def _run(profiler, steps=5):
    x = torch.randn(16, 16)
    for _ in range(steps):
        profiler.begin()
        x = torch.tanh(x @ x)
        profiler.end()


def test_the_window_is_traced_into_the_tensorboard_dir(tmp_path):
    _run(StepProfiler(_args(tmp_path), rank=0, device_name="cpu"))
    traces = glob.glob(str(tmp_path / "*.pt.trace.json.gz"))
    assert len(traces) == 1
    with gzip.open(traces[0]) as f:
        names = {e.get("name", "") for e in json.load(f)["traceEvents"]}
    steps = sorted(n for n in names if n.startswith("ProfilerStep#"))
    assert len(steps) == 2 and "aten::mm" in names  # steps 2 and 3 of 5, with the work inside them


def test_other_ranks_and_no_flag_trace_nothing(tmp_path):
    _run(StepProfiler(_args(tmp_path, ranks=(0,)), rank=1, device_name="cpu"))
    _run(StepProfiler(_args(tmp_path, mode=None), rank=0, device_name="cpu"))
    assert not glob.glob(str(tmp_path / "*"))


@pytest.mark.parametrize("steps,match", [("3", "START,END"), ("3,2", "1 <= START <= END"), ("0,1", "1 <= START")])
def test_bad_windows_are_one_line(tmp_path, steps, match):
    with pytest.raises(ConfigError, match=match):
        profile_window(_args(tmp_path, steps=steps))
    with pytest.raises(ConfigError, match="--tensorboard-dir"):
        profile_window(_args(tmp_path, tensorboard_dir=None))
