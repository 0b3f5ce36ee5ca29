"""One parallel layout as the performance model sees it: the run's ParallelConfig (TP x PP x [Ulysses SP x] DP, ZeRO,
expert parallelism) with the batch, recompute and precision choices its estimates need.

The checks are the trainer's own (ParallelConfig's, the global batch's), so a layout the planner proposes can be
launched.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron.config import ModelConfig, ParallelConfig, RunConfig
from megatron.config.model import check_recompute_granularity
from megatron.config.training import check_global_batch
from megatron.errors import ConfigError
from megatron.flag_bounds import check_fields

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class Layout(ParallelConfig):
    """How a run is spread over GCDs (ParallelConfig: rank order TP innermost, then DP, then PP outermost), and what
    the step time and memory depend on beyond it. Built validated; ``Layout.of`` counts in TP x PP x DP ranks."""

    micro_batch_size: int = 1
    global_batch_size: int | None = None
    """None: micro-batch x DP (one micro-batch per step), as the trainer's default."""
    recompute_granularity: str | None = None
    """None, 'full' (checkpoint every layer) or 'selective' (recompute only the attention core)."""
    flash_attention: bool = True
    """Flash attention keeps no s x s score/softmax/dropout tensors for the backward."""
    dtype: str = "bf16"
    """Weight/activation dtype: 'bf16', 'fp16' (mixed precision with fp32 master weights) or 'fp32'."""
    zero_hpz_partition_size: int | None = None
    """ZeRO++ hpZ secondary partition size (ZeRO-3 only): a second weight shard over this many ranks."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.validate()
        if self.global_batch_size is None:
            object.__setattr__(self, "global_batch_size", self.micro_batch_size * self.dp)

    @classmethod
    def of(cls, tp: int = 1, pp: int = 1, dp: int = 1, **fields) -> Layout:
        """The layout of TP x PP x DP ranks (x ``ds_sequence_parallel_size`` among ``fields``, default 1)."""
        ulysses = fields.get("ds_sequence_parallel_size", 1)
        return cls(world_size=tp * pp * ulysses * dp, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                   **fields)

    @classmethod
    def from_run(cls, run: RunConfig, **fields) -> Layout:
        """``run``'s layout (a dense model's expert-parallel size counts as 1: it splits nothing), batch, recompute,
        attention kernel and precision; ``fields`` add the knobs a run does not hold (e.g. the hpZ size)."""
        p, m, t = run.parallel, run.model, run.training
        parallel = {f.name: getattr(p, f.name) for f in dataclasses.fields(ParallelConfig)}
        parallel["moe_expert_parallel_size"] = p.ep if m.moe.enabled else 1
        flash = m.attention_backend in ("triton", "hip")
        return cls(**parallel, micro_batch_size=t.micro_batch_size, global_batch_size=t.global_batch_size,
                   recompute_granularity=m.recompute_granularity, flash_attention=flash, dtype=run.precision.name,
                   **fields)

    @property
    def shard_dp(self) -> int:
        """Ranks ZeRO partitions over and gradients are reduced over: SP x DP."""
        return self.ulysses * self.dp

    @property
    def expert_dp(self) -> int:
        """Replicas of each expert: the ranks ZeRO shards the experts' states over (DeepSpeed's expert data group)."""
        return self.shard_dp // self.ep

    @property
    def num_microbatches(self) -> int:
        """Gradient-accumulation steps: micro-batches each pipeline runs per optimizer step."""
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def validate(self) -> None:
        super().validate()
        check_fields(self, {"micro_batch_size": "--micro-batch-size", "global_batch_size": "--global-batch-size"})
        if self.global_batch_size is not None:
            check_global_batch(self.global_batch_size, self.micro_batch_size, self.dp)
        if self.ep > 1:  # set only for a model with experts
            self.validate_expert_parallel()
        check_recompute_granularity(self.recompute_granularity)
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError(f"dtype {self.dtype!r}: choose one of {', '.join(DTYPE_BYTES)}")
        hpz = self.zero_hpz_partition_size
        if hpz is not None:
            if self.zero_stage != 3:
                raise ConfigError("--zero-hpz-partition-size needs --zero-stage 3")
            if self.zero_hierarchy:
                raise ConfigError("--zero-hpz-partition-size with --zero-hierarchy: both are secondary partitions; "
                                  "pick one")
            if hpz < 1 or self.dp % hpz:
                raise ConfigError(f"--zero-hpz-partition-size {hpz} must divide the data-parallel size {self.dp}")

    def validate_for(self, model: ModelConfig) -> None:
        """Checks that need the model shape: TP divides heads and widths, PP has layers to split."""
        model.validate(self.tp)
        u = self.ulysses
        if u > 1 and ((model.num_key_value_heads // self.tp) % u or (model.num_attention_heads // self.tp) % u
                      or model.seq_length % (u * (self.tp if self.sequence_parallel else 1))):
            raise ConfigError(f"--ds-sequence-parallel-size {u} cannot split this model's heads per TP rank or its "
                              f"sequence length {model.seq_length}")
        stages = self.pp - (1 if self.standalone_embedding_stage and self.pp > 1 else 0)
        if stages > model.num_layers:
            raise ConfigError(
                f"--pipeline-model-parallel-size {self.pp} exceeds --num-layers {model.num_layers}: "
                "every stage needs at least one layer"
            )

    def describe(self) -> str:
        extras = []
        if self.sequence_parallel:
            extras.append("SP")
        if self.recompute_granularity:
            extras.append(f"recompute={self.recompute_granularity}")
        if self.zero_hpz_partition_size:
            extras.append(f"hpZ={self.zero_hpz_partition_size}")
        if self.ulysses > 1:
            extras.append(f"Ulysses SP={self.ulysses}")
        if self.zero_hierarchy:
            extras.append("hierarchical ZeRO" + (" int8" if self.zero_hierarchy_int8 else ""))
        if self.ep > 1:
            extras.append(f"EP={self.ep}")
        if self.pipeline_schedule != "1f1b":
            n = self.num_layers_per_virtual_pipeline_stage
            extras.append(self.pipeline_schedule + (f" {n} layers/chunk" if n else ""))
        tail = f" ({', '.join(extras)})" if extras else ""
        return (f"TP={self.tp} PP={self.pp} DP={self.dp} MBS={self.micro_batch_size} ZeRO={self.zero_stage}"
                f"{tail}")
