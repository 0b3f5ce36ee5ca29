"""Step time of one layout on Frontier: calibrated compute + pipeline bubble + communication not overlapped.

Model, per optimizer step with m micro-batches and p pipeline stages (1F1B, or the layout's zero-bubble or
interleaved schedule: megatron/perf/schedules.py gives each one's bubble):

* Each stage's time per micro-batch is its forward + backward (+ recompute) FLOPs at
  ``COMPUTE_EFFICIENCY`` x peak, plus its TP collectives and its pipeline sends (both on the critical path:
  Megatron's TP all-reduces block the next matmul; DeepSpeed's pipeline sends are synchronous).
* Under 1F1B the pipeline takes (m + p - 1) times the slowest stage's micro-batch time; the (p - 1) part is the
  bubble, (p - 1) / (m + p - 1) of the pipeline time. The other schedules split that time into forward, input-
  gradient and weight-gradient parts (a third each without recomputation; the recomputed forward runs in the
  input-gradient part) and take their bubble from ``pipeline_time``; interleaving sends v times per micro-batch.
* After the flush, the DP gradient reduction (ZeRO-0/1; DeepSpeed's pipeline engine reduces after the last
  micro-batch), the tied-embedding all-reduce and the optimizer step are exposed. ZeRO-2/3 communicate every
  micro-batch, overlapped with compute: ``ZERO_OVERLAP`` of whichever is shorter is hidden.
* The optimizer step is memory-bound: ``ADAM_BYTES_PER_PARAM`` of HBM traffic per locally updated parameter.

Calibration: ``COMPUTE_EFFICIENCY`` is the one constant fitted to a measurement, the ORNL GPT 22B run that
reached 38.38% of peak, 73.5 TFLOP/s per GCD (FRONTIER.md). The layout is the public ORNL launch script's
(launch_gpt22b_bf16.slurm in sajal-vt/Megatron-DeepSpeed-ORNL): 48 layers, hidden 6144, 48 heads, seq 2048,
2 nodes = 16 GCDs, TP=1, PP=8, DP=2, micro-batch 1, global batch 640, full activation checkpointing, flash
attention v2; ZeRO-1 as FRONTIER.md reports. That script's log figure (Megatron-DeepSpeed's
``throughput_calculator``) counts the recomputed forward (factor 4 instead of 3), so the reported
``tflops_per_gcd`` here counts ``IterationFlops.total`` (model + recompute) the same way; ``mfu`` counts
model FLOPs only. ``calibrate_efficiency()`` re-derives the constant; a unit test keeps the two in step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron.config import ModelConfig
from megatron.config.sizes import named_model
from megatron.errors import ConfigError
from megatron.perf.comm import CommEstimate, estimate_comm
from megatron.perf.flops import IterationFlops, forward_flops_per_token, iteration_flops
from megatron.perf.layout import Layout
from megatron.perf.memory import local_partition, stage_parameters, zbh1_caps
from megatron.perf.schedules import pipeline_time
from megatron.topology import GCDS_PER_NODE

PEAK_FLOPS = {"bf16": 191.5e12, "fp16": 191.5e12, "fp32": 47.9e12}
"""Dense matrix peak of one MI250X GCD (FRONTIER.md)."""
COMPUTE_EFFICIENCY = 0.4203
"""Fraction of peak the matmuls reach while computing; fitted by ``calibrate_efficiency`` (see module doc)."""
ZERO_OVERLAP = 0.5
"""Share of per-micro-batch ZeRO-2/3 traffic (or of the compute, if shorter) hidden; an assumption."""
HBM_BW = 1.6e12
ADAM_BYTES_PER_PARAM = 34
"""fp32 master/m/v read + written (24), gradient read (4), 16-bit weight written (2), slack (4)."""
OPTIMIZER_HBM_EFFICIENCY = 0.5

CALIBRATION_TARGET = 0.3838
"""ORNL's measured fraction of peak for GPT 22B (73.5 / 191.5 TFLOP/s)."""


def calibration_case() -> tuple[ModelConfig, Layout]:
    """The measured ORNL GPT 22B run the efficiency is fitted to."""

    layout = Layout.of(tp=1, pp=8, dp=2, micro_batch_size=1, global_batch_size=640, zero_stage=1,
                       recompute_granularity="full", flash_attention=True, dtype="bf16")
    return named_model("gpt-22b"), layout


@dataclass
class StepTime:
    """Seconds per optimizer step, by term; the terms add up to ``total``."""

    compute: float
    bubble: float
    tp_comm: float
    pp_comm: float
    dp_comm: float
    """Exposed DP / ZeRO / tied-embedding communication."""
    optimizer: float
    flops: IterationFlops
    world_size: int
    peak: float
    bottleneck_stage: int

    @property
    def total(self) -> float:
        return self.compute + self.bubble + self.tp_comm + self.pp_comm + self.dp_comm + self.optimizer

    @property
    def tflops_per_gcd(self) -> float:
        """Hardware TFLOP/s per GCD (recompute counted), as Megatron-DeepSpeed's training log reports it."""
        return self.flops.total / (self.total * self.world_size) / 1e12

    @property
    def model_tflops_per_gcd(self) -> float:
        return self.flops.model / (self.total * self.world_size) / 1e12

    @property
    def percent_of_peak(self) -> float:
        return 100.0 * self.tflops_per_gcd * 1e12 / self.peak

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation (recompute not counted), in percent."""
        return 100.0 * self.model_tflops_per_gcd * 1e12 / self.peak

    def terms(self) -> dict[str, float]:
        return {"compute": self.compute, "bubble": self.bubble, "tp_comm": self.tp_comm, "pp_comm": self.pp_comm,
                "dp_comm": self.dp_comm, "optimizer": self.optimizer}


def stage_flops_per_microbatch(model: ModelConfig, layout: Layout, stage: int) -> float:
    """Forward + backward (+ recompute) FLOPs of one micro-batch on one GCD of ``stage``."""
    layers_f, logits_f = forward_flops_per_token(model, model.padded_vocab_size(layout.tp))
    per_layer = layers_f / model.num_layers
    n = layout.stage_layers(model.num_layers)[stage]
    per_token = 3 * n * per_layer
    if layout.recompute_granularity == "full":
        per_token += n * per_layer
    elif layout.recompute_granularity == "selective":
        per_token += n * 4 * model.seq_length * model.hidden_size  # same as flops.iteration_flops
    if stage == layout.pp - 1:
        per_token += 3 * logits_f
    # DeepSpeed-Ulysses: 1/SP of the tokens outside attention, 1/SP of the heads (whole sequence) inside it.
    return per_token * model.seq_length * layout.micro_batch_size / layout.tp / layout.ulysses


def _worst_middle_stage(layout: Layout) -> int | None:
    """A middle stage whose pipeline neighbours are furthest away (sends cross the slowest link)."""
    if layout.pp < 3:
        return None
    block = layout.tp * layout.shard_dp

    def crosses_node(i: int, j: int) -> bool:
        return (i * block) // GCDS_PER_NODE != (j * block) // GCDS_PER_NODE

    for stage in range(1, layout.pp - 1):
        if crosses_node(stage, stage + 1) or crosses_node(stage, stage - 1):
            return stage
    return 1


def _exposed_overlapped(comm: float, compute: float) -> float:
    return comm - ZERO_OVERLAP * min(comm, compute)


def estimate_step_time(model: ModelConfig, layout: Layout, efficiency: float = COMPUTE_EFFICIENCY) -> StepTime:
    peak = PEAK_FLOPS[layout.dtype]
    m, p = layout.num_microbatches, layout.pp
    # a standalone embedding stage leaves stage 0 without layers: the first stage of layers may be the slowest
    first_layers = {1} if layout.standalone_embedding_stage and p > 1 else set()
    stages = sorted({0, p - 1} | first_layers | ({_worst_middle_stage(layout)} - {None}))
    best: tuple[float, int, float, float, float] | None = None
    comms: dict[int, CommEstimate] = {}
    for stage in stages:
        comm = estimate_comm(model, layout, stage)
        comms[stage] = comm
        compute = stage_flops_per_microbatch(model, layout, stage) / (efficiency * peak)
        # TP collectives, Ulysses' and the experts' all-to-alls: inside every layer, on the critical path
        tp = comm.seconds(groups=("tp", "ulysses", "ep")) / m
        pp = comm.seconds(groups=("pp",)) / m
        t_mb = compute + tp + pp
        if best is None or t_mb > best[0]:
            best = (t_mb, stage, compute, tp, pp)
    t_mb, bottleneck, compute, tp, pp = best

    dp_exposed = 0.0
    optimizer = 0.0
    for stage, comm in comms.items():
        per_step = comm.seconds(groups=("embedding",))
        per_step += sum(c.seconds for c in comm.collectives if c.group == "dp" and c.calls == 1)
        per_micro = sum(c.seconds for c in comm.collectives if c.group == "dp" and c.calls > 1)
        compute_all = m * stage_flops_per_microbatch(model, layout, stage) / (efficiency * peak)
        dp_exposed = max(dp_exposed, per_step + _exposed_overlapped(per_micro, compute_all))
        z = layout.zero_stage
        local = local_partition(model, layout, stage) if z in (1, 2) else \
            stage_parameters(model, layout, stage) / (layout.shard_dp if z >= 1 else 1)
        optimizer = max(optimizer, local * ADAM_BYTES_PER_PARAM / (HBM_BW * OPTIMIZER_HBM_EFFICIENCY))

    flops = iteration_flops(model, layout.global_batch_size, model.padded_vocab_size(layout.tp),
                            layout.recompute_granularity)
    schedule, v = layout.pipeline_schedule, layout.virtual_stages(model.num_layers)
    # Forward, input-gradient and weight-gradient shares of the micro-batch (recomputation runs in the backward).
    plain = dataclasses.replace(layout, recompute_granularity=None)
    third = (compute + tp) * stage_flops_per_microbatch(model, plain, bottleneck) / (
        3 * stage_flops_per_microbatch(model, layout, bottleneck))
    piped = pipeline_time(schedule, p, m, third, compute + tp - 2 * third, third, v, t_pp=pp,
                          caps=zbh1_caps(model, layout))
    return StepTime(compute=m * compute, bubble=piped.bubble, tp_comm=m * tp, pp_comm=m * pp * v,
                    dp_comm=dp_exposed, optimizer=optimizer, flops=flops, world_size=layout.world_size,
                    peak=peak, bottleneck_stage=bottleneck)


def calibrate_efficiency(target: float = CALIBRATION_TARGET, tol: float = 1e-6) -> float:
    """The efficiency at which the calibration case predicts ``target`` of peak (bisection; it is monotonic)."""
    model, layout = calibration_case()
    lo, hi = 0.01, 1.0
    while hi - lo > tol:
        mid = (lo + hi) / 2
        if estimate_step_time(model, layout, mid).percent_of_peak / 100 < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


ZERO_MODES: dict[str, dict] = {"zero0": {"zero_stage": 0}, "zero1": {"zero_stage": 1}, "zero2": {"zero_stage": 2},
                               "zero3": {"zero_stage": 3}}
"""Name -> Layout fields of each ZeRO mode compared by ``step_time_by_zero_mode``. Callers add their own modes
(e.g. ``{"zero3-hpz8": {"zero_stage": 3, "zero_hpz_partition_size": 8}}``) through its ``modes`` argument."""


def step_time_by_zero_mode(model: ModelConfig, layout: Layout,
                           modes: dict[str, dict] | None = None) -> dict[str, StepTime]:
    """Predicted step time of ``layout`` under each ZeRO mode (same TP/PP/DP, batch and recompute).

    The hook for comparing ZeRO variants on one layout: a mode is a set of Layout field overrides, so a new
    variant (a hierarchy field on Layout, say) needs only a new entry. Modes the layout cannot run (ZeRO-2/3 with
    a pipeline, hpZ sizes that do not divide DP) are left out rather than raising.
    """

    out = {}
    for name, fields in (ZERO_MODES if modes is None else modes).items():
        try:
            variant = dataclasses.replace(layout, **fields)
        except ConfigError:
            continue
        out[name] = estimate_step_time(model, variant)
    return out
