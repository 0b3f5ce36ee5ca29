"""Two GPUs (torchrun, one process per device, NCCL/RCCL): every parallel layout against the 1-GPU run of the same
model, data and initial weights (bf16, ZeRO-1 unless the layout needs otherwise): the same loss at every iteration,
within half the reference's mean loss drop per iteration (tests/gpu/helpers.py assert_same_trajectory)."""

from __future__ import annotations

import pytest

from tests.gpu.helpers import assert_same_trajectory, train

BF16 = ["--bf16"]

LAYOUTS = {
    "TP=2": ["--zero-stage", "1", "--tensor-model-parallel-size", "2"],
    "TP=2 SP": ["--zero-stage", "1", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "PP=2": ["--zero-stage", "1", "--pipeline-model-parallel-size", "2"],
    "DP=2 ZeRO-1": ["--zero-stage", "1"],
    "DP=2 ZeRO-3": ["--zero-stage", "3"],
    "DP=2 hierarchical ZeRO": ["--zero-stage", "3", "--zero-hierarchy", "package,node,network"],
}


@pytest.mark.gpus(2)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_two_gpu_layout_matches_one_gpu(name):
    ref = train(BF16 + ["--zero-stage", "1"])
    assert_same_trajectory(train(BF16 + LAYOUTS[name], nproc=2), ref, name)
