"""One parallel layout (TP x PP x [Ulysses SP x] DP, batch, ZeRO, recompute) as the performance model sees it.

The checks here are the ones the trainer and DeepSpeed enforce, so a layout the planner proposes can be launched.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.config import ModelConfig
from megatron.errors import ConfigError

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass
class Layout:
    """How a run is spread over GCDs. Rank order is Megatron's: TP innermost, then DP, then PP outermost."""

    tp: int
    pp: int
    dp: int
    micro_batch_size: int
    global_batch_size: int
    zero_stage: int
    sequence_parallel: bool = False
    """Megatron sequence parallelism; a no-op (normalised to False) at TP=1, as Megatron does."""
    recompute_granularity: str | None = None
    """None, 'full' (checkpoint every layer) or 'selective' (recompute only the attention core)."""
    flash_attention: bool = True
    """Flash attention keeps no s x s score/softmax/dropout tensors for the backward."""
    dtype: str = "bf16"
    """Weight/activation dtype: 'bf16', 'fp16' (mixed precision with fp32 master weights) or 'fp32'."""
    zero_hierarchy: int | None = None
    """ZeRO++ hpZ secondary partition size (ZeRO-3 only): a second weight shard over this many ranks."""
    hierarchical_zero: bool = False
    """Our hierarchical ZeRO-3 (package -> node -> network; megatron/perf/hzero.py), instead of DeepSpeed's."""
    hierarchical_zero_int8: bool = False
    """Block-wise int8 on its network stage."""
    ds_sequence_parallel_size: int = 1
    """DeepSpeed-Ulysses: ranks sharing one sequence, inside the data-parallel dimension (``dp`` counts the rest).
    Activations shrink by it; two all-to-alls per layer appear; ZeRO shards over SP x DP."""
    ep: int = 1
    """--moe-expert-parallel-size: a model with experts splits each MoE layer's experts over ``ep`` consecutive
    data-parallel ranks; their replicas (``expert_dp``) reduce and shard the experts' gradients and states."""

    def __post_init__(self) -> None:
        if self.tp == 1:
            self.sequence_parallel = False
        self.validate()

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.ulysses * self.dp

    @property
    def ulysses(self) -> int:
        return self.ds_sequence_parallel_size

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
        for flag, value in (("--tensor-model-parallel-size", self.tp), ("--pipeline-model-parallel-size", self.pp),
                            ("data-parallel size", self.dp), ("--micro-batch-size", self.micro_batch_size),
                            ("--global-batch-size", self.global_batch_size)):
            if value < 1:
                raise ConfigError(f"{flag} must be >= 1, got {value}")
        if self.global_batch_size % (self.micro_batch_size * self.dp):
            raise ConfigError(
                f"--global-batch-size {self.global_batch_size} is not divisible by --micro-batch-size "
                f"{self.micro_batch_size} x data-parallel size {self.dp}: use a multiple of "
                f"{self.micro_batch_size * self.dp}"
            )
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"--zero-stage {self.zero_stage}: choose 0, 1, 2 or 3")
        if self.zero_stage >= 2 and self.pp > 1:
            # DeepSpeed's pipeline engine asserts ZeRO stage < 2.
            raise ConfigError(
                f"--zero-stage {self.zero_stage} with --pipeline-model-parallel-size {self.pp}: DeepSpeed's pipeline "
                "engine supports ZeRO 0/1 only; use --zero-stage 1 or PP=1"
            )
        if self.recompute_granularity not in (None, "full", "selective"):
            raise ConfigError(
                f"--recompute-granularity {self.recompute_granularity!r}: choose 'full' or 'selective'"
            )
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError(f"dtype {self.dtype!r}: choose one of {', '.join(DTYPE_BYTES)}")
        if self.zero_hierarchy is not None:
            if self.zero_stage != 3:
                raise ConfigError("--zero-hpz-partition-size needs --zero-stage 3")
            if self.zero_hierarchy < 1 or self.dp % self.zero_hierarchy:
                raise ConfigError(
                    f"--zero-hpz-partition-size {self.zero_hierarchy} must divide the data-parallel size {self.dp}"
                )

        if self.ep < 1 or self.shard_dp % self.ep:
            raise ConfigError(f"--moe-expert-parallel-size {self.ep} does not divide the data-parallel size "
                              f"{self.shard_dp}: use a divisor of it")
        if self.ulysses < 1:
            raise ConfigError(f"--ds-sequence-parallel-size must be >= 1, got {self.ulysses}")
        if self.ulysses > 1 and (self.hierarchical_zero or self.hierarchical_zero_int8):
            raise ConfigError(f"--ds-sequence-parallel-size {self.ulysses} with --zero-hierarchy: the trainer "
                              "refuses it (its engine reduces over DP only)")
        if self.hierarchical_zero or self.hierarchical_zero_int8:
            if self.zero_stage != 3 or self.zero_hierarchy is not None:
                raise ConfigError("--zero-hierarchy needs --zero-stage 3 and no --zero-hpz-partition-size")
            if self.pp > 1:
                raise ConfigError(f"--zero-hierarchy with --pipeline-model-parallel-size {self.pp}: use PP=1")

    def validate_for(self, model: ModelConfig) -> None:
        """Checks that need the model shape: TP divides heads and widths, PP has layers to split."""
        model.validate(self.tp)
        u = self.ulysses
        if u > 1 and ((model.num_key_value_heads // self.tp) % u or (model.num_attention_heads // self.tp) % u
                      or model.seq_length % (u * (self.tp if self.sequence_parallel else 1))):
            raise ConfigError(f"--ds-sequence-parallel-size {u} cannot split this model's heads per TP rank or its "
                              f"sequence length {model.seq_length}")
        if self.pp > model.num_layers:
            raise ConfigError(
                f"--pipeline-model-parallel-size {self.pp} exceeds --num-layers {model.num_layers}: "
                "every stage needs at least one layer"
            )

    def stage_layers(self, num_layers: int) -> list[int]:
        """Layers per pipeline stage; an uneven remainder goes to the first stages (the worst case for memory)."""
        base, extra = divmod(num_layers, self.pp)
        return [base + (1 if i < extra else 0) for i in range(self.pp)]

    def describe(self) -> str:
        extras = []
        if self.sequence_parallel:
            extras.append("SP")
        if self.recompute_granularity:
            extras.append(f"recompute={self.recompute_granularity}")
        if self.zero_hierarchy:
            extras.append(f"hpZ={self.zero_hierarchy}")
        if self.ulysses > 1:
            extras.append(f"Ulysses SP={self.ulysses}")
        if self.hierarchical_zero or self.hierarchical_zero_int8:
            extras.append("hierarchical ZeRO" + (" int8" if self.hierarchical_zero_int8 else ""))
        if self.ep > 1:
            extras.append(f"EP={self.ep}")
        tail = f" ({', '.join(extras)})" if extras else ""
        return (f"TP={self.tp} PP={self.pp} DP={self.dp} MBS={self.micro_batch_size} ZeRO={self.zero_stage}"
                f"{tail}")
