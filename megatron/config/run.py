"""``RunConfig``: everything one training run needs, validated together (one ConfigError line naming the flags)."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron.config.checkpoint import CheckpointSettings
from megatron.config.data import DataConfig
from megatron.config.log import LogOptions, ProfileConfig
from megatron.config.model import ModelConfig
from megatron.config.optimizer import OptimizerConfig, PrecisionConfig
from megatron.config.parallel import ParallelConfig
from megatron.config.runtime import DeepSpeedSettings, RuntimeConfig
from megatron.config.training import TrainingConfig
from megatron.errors import ConfigError

# The schedule's own arithmetic (its lengths, --train-samples -> iterations under a batch ramp) checks the config,
# so that the rule that validates and the scheduler that runs can never drift apart (megatron/optim sits below).
from megatron.optim.schedule_config import validate_schedule


@dataclass
class RunConfig:
    """Everything one training run needs, validated together."""

    model: ModelConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
    logging: LogOptions = field(default_factory=LogOptions)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    deepspeed: DeepSpeedSettings = field(default_factory=DeepSpeedSettings)
    notes: list[str] = field(default_factory=list)
    """Flags accepted as provable no-ops for this run: printed once on rank 0 (megatron/engine.py log_notes)."""
    flags: dict = field(default_factory=dict)
    """The command line as parsed (flag dest -> value), kept only for the records upstream writes (a checkpoint's
    'args', TensorBoard's text tab). Nothing reads a setting from it: the fields above are the settings."""

    def validate(self) -> RunConfig:
        self.parallel.validate()
        self.model.validate(self.parallel.tp)
        self._validate_sequence_parallel()
        self._validate_moe()
        self.precision.validate()
        self.optimizer.validate()
        self.training.validate(self.parallel.dp)
        validate_schedule(self)  # --train-samples / token / ramp arithmetic and upstream's schedule checks
        for part in (self.data, self.checkpoint, self.logging, self.profile, self.runtime):
            part.validate()
        return self

    def _validate_moe(self) -> None:
        """Mixture of experts on this layout: the experts split evenly over the expert-parallel ranks, which the
        data-parallel group holds; what is not built with MoE is refused, one line each."""
        moe, p = self.model.moe, self.parallel
        moe.validate(self.model.num_layers, self.training.micro_batch_size * self.model.seq_length)
        flag = f"--moe-expert-parallel-size {p.ep}"
        if not moe.enabled:
            if p.ep > 1:
                self.notes.append(f"> {flag} has no effect: no layer has experts (--num-experts), as upstream")
            return
        if p.dp % p.ep:
            raise ConfigError(f"{flag} does not divide the data-parallel size {p.dp} (world {p.world_size} / TP "
                              f"{p.tp} / PP {p.pp}): the expert-parallel ranks are data-parallel ranks; use a divisor "
                              f"of {p.dp}")
        uneven = sorted({n for n in moe.num_experts if n > 1 and n % p.ep})
        if uneven:
            raise ConfigError(f"--num-experts {uneven[0]} is not divisible by {flag}: every expert-parallel rank holds "
                              "the same number of experts; use a multiple of it")
        self._validate_moe_stages()
        refused = (
            (p.sp > 1, f"--ds-sequence-parallel-size {p.sp}: each Ulysses rank would gate 1/SP of a sequence, another "
                       "capacity than one process's; use --sequence-parallel (Megatron's) or SP 1"),
            (bool(p.zero_hierarchy), "--zero-hierarchy: hierarchical ZeRO reduces every gradient over the whole "
                                     "data-parallel group, not the experts' own replicas; use --zero-stage 1 or 2"),
            (p.zero_stage == 3, "--zero-stage 3: DeepSpeed's ZeRO-3 does not shard expert parameters (its engine "
                                "refuses MoE); use --zero-stage 1 or 2"),
        )
        for bad, why in refused:
            if bad:
                raise ConfigError(f"mixture of experts (--num-experts) with {why}")

    def _validate_moe_stages(self) -> None:
        """With PP > 1 every stage holds a layer with experts (GPTModelPipe's default partition)."""
        p, experts, first = self.parallel, self.model.layer_experts(), 0
        if p.pp == 1 or self.model.num_layers < p.pp:  # too few layers: the partition says so in its own words
            return
        for stage, n in enumerate(self.model.stage_layer_counts(p.pp)):
            if all(e == 1 for e in experts[first:first + n]):
                raise ConfigError(
                    f"mixture of experts (--num-experts) with --pipeline-model-parallel-size {p.pp}: stage {stage} "
                    f"(layers {first}-{first + n - 1}) has no layer with experts, and DeepSpeed's engine then runs "
                    "other collectives there (ZeRO's gradient norm goes per parameter group) and saves it in another "
                    "checkpoint layout; choose --expert-interval / --num-experts so that every stage has an MoE layer")
            first += n

    def _validate_sequence_parallel(self) -> None:
        """Ulysses splits the sequence into SP chunks and each TP rank's heads (query and KV) into SP groups."""
        m, p = self.model, self.parallel
        if p.sp == 1:
            return
        flag = f"--ds-sequence-parallel-size {p.sp}"
        for name, heads in (("--num-attention-heads", m.num_attention_heads),
                            ("--num-key-value-heads", m.num_key_value_heads)):
            if (heads // p.tp) % p.sp:
                raise ConfigError(f"{flag}: {name} {heads} gives {heads // p.tp} heads per TP rank, which SP cannot "
                                  f"split; use an SP size that divides {heads // p.tp}")
        chunks = p.sp * (p.tp if p.sequence_parallel else 1)
        if m.seq_length % chunks:
            why = f" x TP {p.tp} (--sequence-parallel)" if p.sequence_parallel else ""
            raise ConfigError(f"{flag}: --seq-length {m.seq_length} is not divisible by SP {p.sp}{why}; use a "
                              f"multiple of {chunks}")
