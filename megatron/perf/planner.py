"""Search the parallel layouts of a model on N GCDs: keep those that fit in 64 GB, rank by predicted speed."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from megatron.config import ModelConfig
from megatron.errors import ConfigError
from megatron.perf.layout import Layout
from megatron.perf.memory import GCD_MEMORY_BYTES, GIB, MemoryEstimate, estimate_memory
from megatron.perf.step_time import StepTime, estimate_step_time
from megatron.topology import GCDS_PER_NODE


@dataclass
class SearchSpace:
    """The choices the planner tries. TP stays inside a node (FRONTIER.md: TP across nodes is latency-bound)."""

    tp: tuple[int, ...] = (1, 2, 4, 8)
    micro_batch_size: tuple[int, ...] = (1, 2, 4, 8)
    zero_stage: tuple[int, ...] = (0, 1, 2, 3)
    recompute_granularity: tuple[str | None, ...] = (None, "full")
    """Selective recompute is left out by default: with flash attention it saves nothing."""
    sequence_parallel: tuple[bool, ...] = (False, True)
    flash_attention: bool = True
    dtype: str = "bf16"
    max_stage_imbalance: float = 0.1
    """A PP size that does not divide the layers is kept if its biggest stage is at most this much over average."""
    pp: tuple[int, ...] | None = None
    """Restrict PP sizes (default: every divisor of GCDs / TP that splits the layers sensibly)."""
    ds_sequence_parallel_size: tuple[int, ...] = (1,)
    """DeepSpeed-Ulysses sizes to try (each must split the heads per TP rank and the sequence)."""
    ep: tuple[int, ...] | None = None
    """Expert-parallel sizes to try for a model with experts (default: every divisor of its expert counts); as the
    trainer, such a model gets no pipeline, no ZeRO-3 and no Ulysses."""
    schedules: tuple[str, ...] = ("1f1b", "zbh1", "interleaved")
    """Pipeline schedules to try with PP > 1 (megatron/perf/schedules.py): DeepSpeed's 1F1B, zero-bubble H1
    (--enable-zbh1-pipeline; its exact variant costs the same in our engine) and interleaved 1F1B."""
    virtual_stages: tuple[int, ...] = (2, 3, 4, 6)
    """Chunks per rank the interleaved schedule tries (each must split the layers evenly: L % (PP x v) == 0, and
    the micro-batches per pipeline must be a multiple of PP)."""


@dataclass
class Candidate:
    layout: Layout
    memory: MemoryEstimate
    time: StepTime
    capacity: float = field(default=GCD_MEMORY_BYTES)

    @property
    def fits(self) -> bool:
        return self.memory.fits(self.capacity)

    def sort_key(self) -> tuple[float, float]:
        # Rank by useful (model) TFLOP/s, i.e. by step time for a fixed model and batch: the hardware figure
        # would reward recomputation, which adds FLOPs but never speed. Less memory breaks ties.
        return (-self.time.model_tflops_per_gcd, self.memory.total)


def pp_splits_sensibly(num_layers: int, pp: int, max_imbalance: float = 0.1) -> bool:
    if pp > num_layers:
        return False
    return num_layers % pp == 0 or math.ceil(num_layers / pp) <= (1 + max_imbalance) * num_layers / pp


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(model: ModelConfig, gcds: int, global_batch_size: int,
                      space: SearchSpace | None = None) -> list[Layout]:
    """Every valid layout: TP <= 8 dividing heads/KV heads/FFN, PP a sensible split, Ulysses SP from the space,
    DP = gcds / (TP x PP x SP),
    the micro-batch dividing the per-replica batch, ZeRO >= 2 only without a pipeline."""
    space = space or SearchSpace()
    # Without DP every ZeRO stage costs the same: keep one (ZeRO-1, as the ORNL runs used, when allowed).
    zero_without_dp = 1 if 1 in space.zero_stage else space.zero_stage[0]
    out = []
    for tp in space.tp:
        if tp > GCDS_PER_NODE or gcds % tp:
            continue
        if (model.num_attention_heads % tp or model.num_key_value_heads % tp or model.ffn_hidden_size % tp):
            continue
        for pp in _divisors(gcds // tp):
            if space.pp is not None and pp not in space.pp:
                continue
            if model.moe.enabled and pp > 1 and not _every_stage_has_experts(model, pp):
                continue  # the trainer refuses a pipeline stage without an MoE layer (RunConfig._validate_moe_stages)
            if not pp_splits_sensibly(model.num_layers, pp, space.max_stage_imbalance):
                continue
            for u in space.ds_sequence_parallel_size:
                if u > 1 and model.moe.enabled:
                    continue  # ... and Ulysses with experts
                if u > 1 and ((gcds // (tp * pp)) % u or (model.num_attention_heads // tp) % u
                              or (model.num_key_value_heads // tp) % u or model.seq_length % u):
                    continue  # Ulysses: SP must split the heads per TP rank and the sequence
                out += _batch_layouts(model, tp, pp, u, gcds // (tp * pp * u), global_batch_size, space,
                                      zero_without_dp)
    return out


def _batch_layouts(model: ModelConfig, tp: int, pp: int, u: int, dp: int, global_batch_size: int,
                   space: SearchSpace, zero_without_dp: int) -> list[Layout]:
    out = []
    for mbs in space.micro_batch_size:
        if global_batch_size % (mbs * dp):
            continue
        for zero in space.zero_stage:
            if (zero >= 2 and pp > 1) or (dp * u == 1 and zero != zero_without_dp):
                continue  # DeepSpeed's pipeline engine takes ZeRO 0/1 only
            if zero == 3 and model.moe.enabled:
                continue  # DeepSpeed's ZeRO-3 does not shard experts: refused
            for rc in space.recompute_granularity:
                for seq_par in space.sequence_parallel if tp > 1 else (False,):
                    if seq_par and u > 1 and model.seq_length % (u * tp):
                        continue
                    for ep in _expert_parallel_sizes(model, dp * u, space):
                        for schedule in _schedules(model, pp, global_batch_size // (mbs * dp), space):
                            out.append(Layout.of(tp=tp, pp=pp, dp=dp, micro_batch_size=mbs,
                                                 global_batch_size=global_batch_size, zero_stage=zero,
                                                 sequence_parallel=seq_par, recompute_granularity=rc,
                                                 flash_attention=space.flash_attention, dtype=space.dtype,
                                                 ds_sequence_parallel_size=u, moe_expert_parallel_size=ep,
                                                 **schedule))
    return out


def _schedules(model: ModelConfig, pp: int, microbatches: int, space: SearchSpace) -> list[dict]:
    """The Layout fields of each pipeline schedule the space tries at this PP (1F1B alone without a pipeline)."""
    out: list[dict] = [{}]
    if pp == 1:
        return out
    if "zbh1" in space.schedules:
        out.append({"enable_zbh1_pipeline": True})
    if "interleaved" in space.schedules and microbatches % pp == 0:
        out += [{"num_layers_per_virtual_pipeline_stage": model.num_layers // (pp * v)}
                for v in space.virtual_stages if model.num_layers % (pp * v) == 0]
    return out if "1f1b" in space.schedules else out[1:]


def _every_stage_has_experts(model: ModelConfig, pp: int) -> bool:
    experts, first = model.layer_experts(), 0
    for n in model.stage_layer_counts(pp):
        if all(e == 1 for e in experts[first:first + n]):
            return False
        first += n
    return True


def _expert_parallel_sizes(model: ModelConfig, shard_dp: int, space: SearchSpace) -> list[int]:
    """EP sizes for a layout of ``shard_dp`` data-parallel ranks: [1] for a dense model; else those of the space (or
    every divisor of the expert counts) that divide the data-parallel size and every MoE layer's experts."""
    counts = {n for n in model.layer_experts() if n > 1}
    if not counts:
        return [1]
    tried = space.ep or _divisors(min(counts))
    return [e for e in tried if shard_dp % e == 0 and all(n % e == 0 for n in counts)]


def evaluate(model: ModelConfig, layout: Layout, capacity: float = GCD_MEMORY_BYTES) -> Candidate:
    layout.validate_for(model)
    return Candidate(layout, estimate_memory(model, layout), estimate_step_time(model, layout), capacity)


def plan(model: ModelConfig, gcds: int, global_batch_size: int, space: SearchSpace | None = None,
         capacity: float = GCD_MEMORY_BYTES) -> tuple[list[Candidate], list[Candidate]]:
    """(layouts that fit, best first; every layout evaluated). Raises ConfigError when none fits."""
    model.validate()
    layouts = enumerate_layouts(model, gcds, global_batch_size, space)
    if not layouts:
        raise ConfigError(
            f"no valid layout of {gcds} GCDs for --global-batch-size {global_batch_size}: the batch must be "
            "divisible by data-parallel size x micro-batch for some TP x PP; try a batch that is a multiple of "
            f"{gcds}"
        )
    everything = [evaluate(model, layout, capacity) for layout in layouts]
    fitting = sorted((c for c in everything if c.fits), key=Candidate.sort_key)
    if not fitting:
        smallest = min(everything, key=lambda c: c.memory.total)
        raise ConfigError(
            f"no layout fits in {capacity / GIB:.0f} GiB per GCD on {gcds} GCDs (smallest: "
            f"{smallest.layout.describe()} needs {smallest.memory.total / GIB:.1f} GiB): add GCDs (--nodes) "
            "or shrink the model / sequence length"
        )
    return fitting, everything
