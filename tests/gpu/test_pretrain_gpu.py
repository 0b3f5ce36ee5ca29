"""pretrain_gpt.py end to end on one GPU, each run against a reference run (tests/gpu/helpers.py).

The reference is the fp32 ZeRO-0 run of the same model and data (same initial weights: --use-cpu-initialization);
every other precision / ZeRO stage / recompute mode must learn and land within bf16 tolerance of it at
iteration 30. Recompute replays the same forward, so it must equal the run without recompute much more tightly.
The bf16 ZeRO stages agree with each other at every iteration (assert_same_trajectory).
"""

from __future__ import annotations

import pytest

from tests.models import LLAMA
from tests.gpu.helpers import BF16_REL, assert_same_trajectory, assert_trains_like, train

FP32_REF = ["--zero-stage", "0"]


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_bf16_zero_stages_match_fp32_reference(zero):
    assert_trains_like(train(["--bf16", "--zero-stage", str(zero)]), train(FP32_REF), BF16_REL, f"bf16 ZeRO-{zero}")


def test_bf16_zero_stages_agree_with_each_other():
    """All four bf16 stages hold fp32 master weights: tighter among themselves than against fp32."""
    ref = train(["--bf16", "--zero-stage", "0"])
    for zero in (1, 2, 3):
        assert_same_trajectory(train(["--bf16", "--zero-stage", str(zero)]), ref, f"bf16 ZeRO-{zero}")


def test_fp16_zero1_matches_fp32_reference():
    # A loss scale this tiny model never overflows: no skipped step, so the trajectories are comparable.
    got = train(["--fp16", "--zero-stage", "1", "--initial-loss-scale", "1024"])
    assert_trains_like(got, train(FP32_REF), BF16_REL, "fp16 ZeRO-1")


def test_fp32_zero1_matches_fp32_zero0():
    assert_trains_like(train(["--zero-stage", "1"]), train(FP32_REF), 1e-3, "fp32 ZeRO-1")


@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_recompute_matches_no_recompute(granularity):
    base = ["--bf16", "--zero-stage", "1"]
    got = train(base + ["--recompute-granularity", granularity])
    assert_trains_like(got, train(base), 2e-3, f"recompute {granularity}")


def test_llama_variant_matches_its_fp32_reference():
    ref = train(LLAMA + FP32_REF)
    assert_trains_like(train(LLAMA + ["--bf16", "--zero-stage", "1"]), ref, BF16_REL, "llama bf16 ZeRO-1")


def test_default_kernel_backend_matches_torch_kernels():
    """The default (``auto``: measured on the device) against torch's own kernels everywhere."""
    base = ["--bf16", "--zero-stage", "1"]
    default = train(base, env={"MEGATRON_KERNEL_SELECT": "measure"})
    torch_kernels = train(base, env={"MEGATRON_KERNEL_SELECT": "torch"})
    assert_trains_like(default, torch_kernels, 1e-2, "default kernels")


def test_triton_attention_flag_matches_torch_kernels():
    base = ["--bf16", "--zero-stage", "1"]
    got = train(base + ["--use-flash-attn-triton"])
    assert_trains_like(got, train(base, env={"MEGATRON_KERNEL_SELECT": "torch"}), 1e-2, "--use-flash-attn-triton")
