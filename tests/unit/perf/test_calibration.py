"""The step-time model reproduces the measured ORNL GPT 22B point (38.38% of peak, 73.5 TFLOP/s per GCD)."""

from __future__ import annotations

import dataclasses

import pytest

from megatron.perf.step_time import (
    CALIBRATION_TARGET,
    COMPUTE_EFFICIENCY,
    calibrate_efficiency,
    calibration_case,
    ZERO_MODES,
    estimate_step_time,
    step_time_by_zero_mode,
)


def test_22b_reproduces_measured_percent_of_peak():
    model, layout = calibration_case()
    assert (model.num_layers, model.hidden_size, model.num_attention_heads, model.seq_length) == (48, 6144, 48, 2048)
    assert (layout.tp, layout.pp, layout.dp, layout.world_size) == (1, 8, 2, 16)
    st = estimate_step_time(model, layout)
    assert st.percent_of_peak == pytest.approx(38.38, abs=1.0)
    assert st.tflops_per_gcd == pytest.approx(73.5, abs=0.01 * 191.5)


def test_constant_matches_the_fit():
    # The constant in step_time.py is what calibrate_efficiency() derives; they must not drift apart.
    assert COMPUTE_EFFICIENCY == pytest.approx(calibrate_efficiency(), abs=1e-3)
    model, layout = calibration_case()
    assert estimate_step_time(model, layout, calibrate_efficiency()).percent_of_peak == pytest.approx(
        100 * CALIBRATION_TARGET, abs=1e-3)


def test_terms_add_up_and_bubble_fraction():
    model, layout = calibration_case()
    st = estimate_step_time(model, layout)
    assert st.total == pytest.approx(sum(st.terms().values()))
    m, p = layout.num_microbatches, layout.pp
    pipeline = st.compute + st.bubble + st.tp_comm + st.pp_comm
    assert st.bubble / pipeline == pytest.approx((p - 1) / (m + p - 1))
    # Full recompute: hardware FLOPs exceed model FLOPs by the recomputed forward of the layers.
    assert 1.25 < st.tflops_per_gcd / st.model_tflops_per_gcd < 1.34


def test_more_microbatches_shrink_the_bubble():
    model, layout = calibration_case()
    small = estimate_step_time(model, dataclasses.replace(layout, global_batch_size=16))
    big = estimate_step_time(model, layout)
    assert small.bubble / small.total > big.bubble / big.total
    assert small.percent_of_peak < big.percent_of_peak


def test_step_time_by_zero_mode_hook():
    """Same layout, one prediction per ZeRO mode; invalid modes (ZeRO-2/3 under a pipeline) are left out."""
    model, layout = calibration_case()
    piped = step_time_by_zero_mode(model, layout)
    assert set(piped) == {"zero0", "zero1"}
    assert piped["zero1"].total == pytest.approx(estimate_step_time(model, layout).total)
    flat = dataclasses.replace(layout, pipeline_model_parallel_size=1, global_batch_size=64)  # the same 16 ranks
    assert flat.dp == 16
    modes = step_time_by_zero_mode(model, flat, {**ZERO_MODES,
                                                 "zero3-hpz8": {"zero_stage": 3, "zero_hpz_partition_size": 8},
                                                 "bad-hpz": {"zero_stage": 3, "zero_hpz_partition_size": 3}})
    assert set(modes) == {"zero0", "zero1", "zero2", "zero3", "zero3-hpz8"}
    # ZeRO-3 moves more bytes per step than ZeRO-1 (weights every micro-batch); hpZ moves its backward
    # re-gather (if any) inside the node, so it is never slower than plain ZeRO-3.
    assert modes["zero3"].dp_comm > modes["zero1"].dp_comm
    assert modes["zero3-hpz8"].total <= modes["zero3"].total + 1e-12
