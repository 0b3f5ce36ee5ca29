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
        self.precision.validate()
        self.optimizer.validate()
        self.training.validate(self.parallel.dp)
        validate_schedule(self)  # --train-samples / token / ramp arithmetic and upstream's schedule checks
        for part in (self.data, self.checkpoint, self.logging, self.profile, self.runtime):
            part.validate()
        return self

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
