"""``RunConfig``: everything one training run needs, validated together (one ConfigError line naming the flags)."""

from __future__ import annotations

import dataclasses
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


@dataclass(frozen=True)
class RunConfig:
    """Everything one training run needs, validated together when it is built (one ConfigError line naming the
    flags) and frozen from then on, like every config inside it: a variant is ``dataclasses.replace(run, ...)``,
    validated in turn."""

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
    notes: tuple[str, ...] = ()
    """Flags accepted as provable no-ops for this run: printed once on rank 0 (megatron/engine.py log_notes)."""
    flags: dict = field(default_factory=dict)
    """The command line as parsed (flag dest -> value), kept only for the records upstream writes (a checkpoint's
    'args', TensorBoard's text tab). Nothing reads a setting from it, nothing writes it after configure: the fields
    above are the settings."""

    def __post_init__(self) -> None:
        """Validate everything together; the only values filled here follow from the others (the global batch
        without --global-batch-size, the iterations of --train-samples)."""
        p = self.parallel
        p.validate()
        self.model.validate(p.tp)
        self._validate_sequence_parallel()
        self._validate_moe()
        self._validate_pipeline_schedule()
        self.precision.validate()
        if self.model.fp32_residual_connection and not (self.precision.bf16 or self.precision.fp16):
            raise ConfigError("--fp32-residual-connection needs --bf16 or --fp16 (upstream asserts it too): an fp32 "
                              "run's residual stream is fp32 already; drop the flag")
        if p.zero_hierarchy and self.precision.fp16:
            raise ConfigError("--zero-hierarchy with --fp16: this mode has no loss scaler; use --bf16 (advised on "
                              "MI250X)")
        self.optimizer.validate()
        self.training.validate(p.dp)
        if self.training.global_batch_size is None:
            self._fill("training", global_batch_size=self.training.micro_batch_size * p.dp)
        train_iters = validate_schedule(self)  # --train-samples / token / ramp arithmetic, upstream's checks
        if train_iters is not None:
            self._fill("training", train_iters=train_iters)
        for part in (self.data, self.checkpoint, self.logging, self.profile, self.runtime):
            part.validate()
        if self.data.per_split and self.data.train_data_path is None and not self.logging.skip_train:
            raise ConfigError("--valid-data-path / --test-data-path without --train-data-path: give the train split's "
                              "corpora too (or --skip-train to only evaluate a --load'ed checkpoint)")

    def _fill(self, part: str, **values) -> None:
        object.__setattr__(self, part, dataclasses.replace(getattr(self, part), **values))

    def _validate_moe(self) -> None:
        """Mixture of experts on this layout: the experts split evenly over the expert-parallel ranks, which the
        data-parallel group holds; what is not built with MoE is refused, one line each."""
        moe, p, ds = self.model.moe, self.parallel, self.deepspeed
        moe.validate(self.model.num_layers, self.training.micro_batch_size * self.model.seq_length)
        if not moe.enabled:
            return
        p.validate_expert_parallel()
        uneven = sorted({n for n in moe.num_experts if n > 1 and n % p.ep})
        if uneven:
            raise ConfigError(f"--num-experts {uneven[0]} is not divisible by --moe-expert-parallel-size {p.ep}: every "
                              "expert-parallel rank holds the same number of experts; use a multiple of it")
        self._validate_moe_stages()
        moe_with = "mixture of experts (--num-experts) with"
        if p.ulysses > 1:
            raise ConfigError(f"{moe_with} --ds-sequence-parallel-size {p.ulysses}: each Ulysses rank would gate 1/SP "
                              "of a sequence, another capacity than one process's; use --sequence-parallel "
                              "(Megatron's) or SP 1")
        if p.zero_hierarchy:  # the flag, or the JSON's megatron_frontier section
            what, engine = (f"hierarchical ZeRO ({ds.source}) with --num-experts", "its engine") \
                if ds.hierarchy_from_json else (f"{moe_with} --zero-hierarchy", "hierarchical ZeRO")
            raise ConfigError(f"{what}: {engine} reduces every gradient over the whole data-parallel group, not the "
                              "experts' own replicas; use --zero-stage 1 or 2")
        if p.zero_stage == 3:  # --zero-stage 3, or the JSON's stage
            what, fix = (f"{ds.source} sets zero_optimization.stage=3 with --num-experts", "stage") \
                if ds.zero_stage_from_json else (f"{moe_with} --zero-stage 3", "--zero-stage")
            raise ConfigError(f"{what}: DeepSpeed's ZeRO-3 does not shard expert parameters (its engine refuses MoE); "
                              f"use {fix} 1 or 2")

    def _validate_pipeline_schedule(self) -> None:
        """What the zero-bubble and interleaved schedules (megatron/core/pipeline) cannot serve, one line each."""
        p, m, t = self.parallel, self.model, self.training
        schedule = p.pipeline_schedule
        layer_stages = p.pp - 1 if p.standalone_embedding_stage else p.pp  # stage 0 holds the embedding alone
        if m.num_layers < layer_stages:
            raise ConfigError(f"--pipeline-model-parallel-size {p.pp} with --num-layers {m.num_layers}: a pipeline "
                              f"stage would hold no transformer layer; use at most {m.num_layers} stages")
        if schedule in ("zbh1", "zbh1-exact") and m.torch_compile:
            raise ConfigError("--enable-zbh1-pipeline with --compile: torch.compile cannot trace the deferred weight "
                              "gradients; drop one")
        if schedule != "interleaved":
            return
        n, flag = p.num_layers_per_virtual_pipeline_stage, "--num-layers-per-virtual-pipeline-stage"
        if p.standalone_embedding_stage:
            raise ConfigError(f"{flag} {n} with --standalone-embedding-stage: the interleaved layout splits the layers "
                              "evenly over every rank's chunks, stage 0's included; drop one of the two")
        if m.num_layers % (p.pp * n):
            raise ConfigError(f"{flag} {n}: --num-layers {m.num_layers} is not a multiple of {n} x "
                              f"--pipeline-model-parallel-size {p.pp}; use an N with N x {p.pp} dividing "
                              f"{m.num_layers}")
        if t.global_batch_size is None:
            return
        block = t.micro_batch_size * p.dp
        batches = [t.global_batch_size]
        if t.rampup_batch_size is not None:  # every step of the ramp runs the schedule
            start, incr, _ = t.rampup_batch_size
            batches = list(range(start, t.global_batch_size, max(incr, 1))) + batches
        for gbs in batches:
            if (gbs // block) % p.pp:
                raise ConfigError(f"{flag}: {gbs // block} micro-batches per pipeline (global batch {gbs} / "
                                  f"(--micro-batch-size {t.micro_batch_size} x DP {p.dp})) is not a multiple of "
                                  f"--pipeline-model-parallel-size {p.pp}, as the interleaved schedule needs; "
                                  "choose the batch sizes accordingly")

    def _validate_moe_stages(self) -> None:
        """With PP > 1 every stage holds a layer with experts (GPTModelPipe's default partition; interleaved: in one
        of the rank's chunks)."""
        p, experts = self.parallel, self.model.layer_experts()
        if p.pp == 1 or self.model.num_layers < p.pp:  # too few layers: the partition says so in its own words
            return
        if p.standalone_embedding_stage:
            raise ConfigError(f"mixture of experts (--num-experts) with --standalone-embedding-stage and "
                              f"--pipeline-model-parallel-size {p.pp}: the embedding-only stage 0 would hold no layer "
                              "with experts, which DeepSpeed's engine needs on every stage; drop the flag")
        chunk = p.num_layers_per_virtual_pipeline_stage if p.pipeline_schedule == "interleaved" else None
        if chunk is not None and self.model.num_layers % (p.pp * chunk):  # the interleaved split's own check says so
            return
        n_virtual = p.pp * p.virtual_stages(self.model.num_layers)
        per_stage = self.model.stage_layer_counts(n_virtual)
        for stage in range(p.pp):
            layers = [i for vs in range(stage, n_virtual, p.pp)
                      for i in range(sum(per_stage[:vs]), sum(per_stage[:vs + 1]))]
            if all(experts[i] == 1 for i in layers):
                raise ConfigError(
                    f"mixture of experts (--num-experts) with --pipeline-model-parallel-size {p.pp}: stage {stage} "
                    f"(layers {_ranges(layers)}) has no layer with experts, and DeepSpeed's engine then runs "
                    "other collectives there (ZeRO's gradient norm goes per parameter group) and saves it in another "
                    "checkpoint layout; choose --expert-interval / --num-experts so that every stage has an MoE layer")

    def _validate_sequence_parallel(self) -> None:
        """Ulysses splits the sequence into SP chunks and each TP rank's heads (query and KV) into SP groups."""
        m, p = self.model, self.parallel
        if p.ulysses == 1:
            return
        flag = f"--ds-sequence-parallel-size {p.ulysses}"
        for name, heads in (("--num-attention-heads", m.num_attention_heads),
                            ("--num-key-value-heads", m.num_key_value_heads)):
            if (heads // p.tp) % p.ulysses:
                raise ConfigError(f"{flag}: {name} {heads} gives {heads // p.tp} heads per TP rank, which SP cannot "
                                  f"split; use an SP size that divides {heads // p.tp}")
        chunks = p.ulysses * (p.tp if p.sequence_parallel else 1)
        if m.seq_length % chunks:
            why = f" x TP {p.tp} (--sequence-parallel)" if p.sequence_parallel else ""
            raise ConfigError(f"{flag}: --seq-length {m.seq_length} is not divisible by SP {p.ulysses}{why}; use a "
                              f"multiple of {chunks}")


def _ranges(layers: list[int]) -> str:
    """'0-3' for a contiguous run; '0-1, 4-5' for an interleaved rank's chunks."""
    runs: list[list[int]] = []
    for i in layers:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(f"{a}-{b}" for a, b in runs)
