"""The GPU suite's own logic on CPU (tests/gpu/helpers.py), so a GPU run fails only on what needs a GPU; and that
``pytest tests/gpu`` on a machine without one skips everything and passes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.checkpointing.common import BASE
from tests.functional.cli import REPO
from tests.gpu.helpers import ITERS, assert_trains_like, device_args


def test_device_args_drop_only_the_gloo_backend():
    assert "--distributed-backend" in BASE
    got = device_args(BASE)
    assert "--distributed-backend" not in got and "gloo" not in got
    assert len(got) == len(BASE) - 2 and [a for a in BASE if a not in ("--distributed-backend", "gloo")] == got
    assert device_args(["--distributed-backend", "nccl", "--x"]) == ["--distributed-backend", "nccl", "--x"]


def test_assert_trains_like_accepts_close_and_refuses_far_flat_or_missing():
    ref = {i: 6.0 - 3.0 * i / ITERS for i in range(1, ITERS + 1)}  # the suite's run length
    assert_trains_like({i: v * 1.01 for i, v in ref.items()}, ref, 3e-2, "close")
    with pytest.raises(AssertionError, match="far: loss"):
        assert_trains_like({i: v * 1.2 for i, v in ref.items()}, ref, 3e-2, "far")
    with pytest.raises(AssertionError, match="did not learn"):
        assert_trains_like({i: 6.0 for i in ref}, {i: 6.0 for i in ref}, 3e-2, "flat")
    with pytest.raises(AssertionError, match="logged iterations"):
        assert_trains_like({i: v for i, v in ref.items() if i != 5}, ref, 3e-2, "gap")


def test_gpu_suite_skips_cleanly_without_a_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: tests/gpu/run.sh runs the suite for real")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu"], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    tail = proc.stdout.strip().splitlines()[-1]
    assert "skipped" in tail and "passed" not in tail and "failed" not in tail and "error" not in tail, tail
