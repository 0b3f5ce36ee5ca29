"""The planner knows pipeline schedules: each one's bubble in the step time, its activations in the memory model, the
ranking over layout x schedule, and the chosen schedule's flags and bubble printed (the 175B case of issue 42)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tools"))

import plan_parallelism  # noqa: E402

from megatron.config.sizes import named_model  # noqa: E402
from megatron.errors import run_cli  # noqa: E402
from megatron.perf.layout import Layout  # noqa: E402
from megatron.perf.memory import estimate_stage_memory, stage_micro_batch_bytes, zbh1_caps  # noqa: E402
from megatron.perf.schedules import bubble_fraction, bubble_line, held  # noqa: E402
from megatron.perf.step_time import estimate_step_time  # noqa: E402

MODEL = named_model("gpt-175b")
BASE = Layout.of(tp=4, pp=8, dp=32, micro_batch_size=1, global_batch_size=1536, zero_stage=1, sequence_parallel=True)


def _with(**fields) -> Layout:
    return dataclasses.replace(BASE, **fields)


def test_each_schedule_changes_the_bubble_and_only_the_bubble_and_sends():
    # Without sequence parallelism a stage's weight-gradient inputs are smaller than its activations: ZB-H1's memory
    # cap leaves upstream's order (with it, below, the gathered inputs and full output gradients weigh more).
    plain = dataclasses.replace(BASE, sequence_parallel=False)
    base = estimate_step_time(MODEL, plain)
    zb = estimate_step_time(MODEL, dataclasses.replace(plain, enable_zbh1_pipeline=True))
    inter = estimate_step_time(MODEL, dataclasses.replace(plain, num_layers_per_virtual_pipeline_stage=6))  # v = 2
    assert zbh1_caps(MODEL, dataclasses.replace(plain, enable_zbh1_pipeline=True)) == tuple(range(8))
    assert zb.compute == base.compute == inter.compute and zb.tp_comm == base.tp_comm
    assert zb.bubble < inter.bubble < base.bubble
    assert abs(zb.bubble / base.bubble - 1 / 3) < 0.05  # (p-1)(f + max(b-w, 0)) with f = b = w: a third
    assert abs(inter.pp_comm - 2 * base.pp_comm) < 1e-9  # v sends per micro-batch


def test_zbh1s_memory_cap_costs_bubble_where_the_model_says_it_binds():
    base = estimate_step_time(MODEL, BASE)
    layout = _with(enable_zbh1_pipeline=True)
    zb = estimate_step_time(MODEL, layout)
    caps = zbh1_caps(MODEL, layout)
    assert caps == (0, 0, 0, 1, 2, 2, 3, 3)  # 175B with SP: 336 MiB of W inputs a layer against 204 of activations
    uncapped = estimate_step_time(MODEL, dataclasses.replace(layout, sequence_parallel=False))
    assert uncapped.bubble * 1.3 < zb.bubble < base.bubble  # the cap costs (half of 1F1B's bubble, not a third)
    assert zb.compute == base.compute
    acts, deferred = stage_micro_batch_bytes(MODEL, layout)
    for stage, cap in enumerate(caps):  # within 1F1B's largest stage
        assert held("zbh1", 8, layout.num_microbatches, stage, acts[stage], deferred[stage], cap=cap).peak_bytes <= (
            8 * acts[0])
    assert "memory cap (1F1B's peak): weight passes deferred stage 1 0 of 1" in bubble_line(
        layout, MODEL.num_layers, layout.num_microbatches, caps)


def test_memory_follows_the_schedule():
    one = estimate_stage_memory(MODEL, BASE, 0).terms["activations"]
    inter = estimate_stage_memory(MODEL, _with(num_layers_per_virtual_pipeline_stage=6), 0).terms["activations"]
    assert abs(inter / one - (8 + 7 / 2) / 8) < 1e-9  # rank 0 holds (p + (p-1)/v) of p micro-batches
    last = [estimate_stage_memory(MODEL, layout, 7).terms["activations"]
            for layout in (BASE, _with(enable_zbh1_pipeline=True))]
    assert last[1] > last[0]  # the last stage's pending weight-gradient inputs


def test_the_175b_plan_ranks_schedules_and_prints_the_chosen_ones_flags_and_bubble(capsys):
    rc = run_cli(plan_parallelism.main, ["--model-size", "gpt-175b", "--gcds", "1024", "--global-batch-size", "1536"])
    out = capsys.readouterr().out.splitlines()
    assert rc == 0
    line = next(x for x in out if x.startswith("pipeline schedule: "))
    sbatch = next(x for x in out if x.startswith("sbatch: "))
    schedule = line.split()[2]
    assert schedule != "1f1b" and "predicted bubble" in line  # a schedule beats DeepSpeed's 1F1B at this scale
    flags = line.split("flags: ")[1].split(" |")[0]
    assert flags in sbatch


def test_dry_run_line():
    layout = Layout.of(pp=4, micro_batch_size=1, global_batch_size=8, enable_zbh1_pipeline=True)
    line = bubble_line(layout, 8, 8)
    assert line.startswith("pipeline schedule zbh1: predicted bubble 11.1%")
    assert f"{100 * bubble_fraction('1f1b', 4, 8):.1f}%" in line
