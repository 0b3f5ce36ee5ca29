"""Validated configuration dataclasses: the single source of truth for a run.

Model and data code take these objects explicitly; only the entry point turns CLI flags into them
(``megatron/arguments.py``). Every check a user can fail raises ``ConfigError`` naming the flags.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megatron.errors import ConfigError


@dataclass
class ModelConfig:
    """Shape and variant of a GPT. Field names follow Megatron's flags (dashes -> underscores)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int
    """Vocabulary size *before* padding; see ``padded_vocab_size``."""
    ffn_hidden_size: int | None = None
    """MLP width; default 4h, or Megatron's 2/3 * 4h rounded down to a multiple of 64 with SwiGLU."""
    num_key_value_heads: int | None = None
    """Grouped-query attention; default = num_attention_heads (plain multi-head attention)."""
    max_position_embeddings: int | None = None
    make_vocab_size_divisible_by: int = 128
    normalization: str = "layernorm"
    """'layernorm' or 'rmsnorm'."""
    layernorm_epsilon: float = 1e-5
    swiglu: bool = False
    openai_gelu: bool = False
    """GeLU with the tanh approximation (Megatron's --openai-gelu; HF GPT-2's gelu_new), else the exact erf GeLU."""
    position_embedding_type: str = "learned_absolute"
    """'learned_absolute' or 'rope'."""
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0
    """--rotary-percent: the fraction of each head's channels that rotate (upstream: int(head_dim x percent))."""
    untie_embeddings_and_output_weights: bool = False
    add_bias_linear: bool = True
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    apply_residual_scaling: bool = True
    """Scale the std of output projections by 1/sqrt(2L), as Megatron's scaled_init_method_normal."""
    use_cpu_initialization: bool = False
    """Initialise full weights on CPU from per-parameter seeds, then slice: the same seed gives the
    same full model for every TP/PP layout."""
    attention_backend: str = "auto"
    """Fused-kernel backend for attention and norms: 'auto', 'torch', 'triton' or 'hip' (megatron/kernels)."""
    recompute_granularity: str | None = None
    """None, 'full' or 'selective'."""
    recompute_num_layers: int | None = None
    """How many layers (per pipeline stage) get full recompute, the first ones; None: all."""
    checkpoint_chunk_layers: int = 1
    """Layers recomputed as one checkpoint (upstream's --recompute-method uniform with --recompute-num-layers N,
    or --deepspeed-activation-checkpointing with --checkpoint-num-layers N): only every N-th layer input is kept."""
    recompute_partition: bool = False
    """Keep 1/TP of each checkpointed input (--partition-activations, --distribute-saved-activations, JSON
    activation_checkpointing.partition_activations); all-gathered for the recompute."""
    recompute_on_cpu: bool = False
    """Keep checkpointed inputs in host memory (--checkpoint-in-cpu, JSON cpu_checkpointing)."""
    recompute_synchronize: bool = False
    """Accelerator synchronize around each checkpoint (--synchronize-each-layer, synchronize_checkpoint_boundary)."""
    recompute_profile: bool = False
    """Print each checkpoint's forward/backward time on rank 0 (--profile-backward, JSON profile)."""
    bias_gelu_fusion: bool = True
    """With --compile, fc1 skips its bias add and GeLU(y + bias) runs as one function that torch.compile
    fuses into one kernel (megatron/model/fusions.py), as Megatron's default (--no-bias-gelu-fusion turns it
    off). Without --compile the bias stays in fc1's matmul, which is cheaper than a separate add."""
    bias_dropout_fusion: bool = True
    """Output projections hand back their bias and bias add + dropout + residual add run as one function
    (Megatron's default; --no-bias-dropout-fusion turns it off). Same arithmetic as the unfused path."""
    torch_compile: bool = False
    """--compile: torch.compile each transformer layer (megatron/model/compile.py); ignored on CPU."""

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.ffn_hidden_size is None:
            if self.swiglu:
                self.ffn_hidden_size = int((4 * self.hidden_size * 2 / 3) / 64) * 64 or 4 * self.hidden_size
            else:
                self.ffn_hidden_size = 4 * self.hidden_size
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """Channels of a head that rotary embeddings rotate (the first ones), as upstream computes it."""
        return int(self.head_dim * self.rotary_percent) if self.rotary_percent < 1.0 else self.head_dim

    @property
    def tie_embeddings(self) -> bool:
        return not self.untie_embeddings_and_output_weights

    def padded_vocab_size(self, tp_size: int = 1) -> int:
        """Megatron pads the vocab to a multiple of make_vocab_size_divisible_by * TP."""
        multiple = self.make_vocab_size_divisible_by * tp_size
        return ((self.vocab_size + multiple - 1) // multiple) * multiple

    def num_parameters(self, tp_size: int = 1) -> int:
        """Exact count of the full (unsharded) model's parameters."""
        h, f, nl = self.hidden_size, self.ffn_hidden_size, self.num_layers
        kv = self.num_key_value_heads * self.head_dim
        bias = 1 if self.add_bias_linear else 0
        norm = 2 * h if self.normalization == "layernorm" else h
        qkv = h * (h + 2 * kv) + bias * (h + 2 * kv)
        proj = h * h + bias * h
        fc1_out = 2 * f if self.swiglu else f
        mlp = h * fc1_out + bias * fc1_out + f * h + bias * h
        layer = qkv + proj + mlp + 2 * norm
        v = self.padded_vocab_size(tp_size)
        emb = v * h + (self.max_position_embeddings * h if self.position_embedding_type == "learned_absolute" else 0)
        out = 0 if self.tie_embeddings else v * h
        return nl * layer + emb + norm + out

    def validate(self, tp_size: int = 1) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads "
                f"{self.num_attention_heads}: pick a head count that divides the hidden size"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"--num-key-value-heads {self.num_key_value_heads} does not divide --num-attention-heads "
                f"{self.num_attention_heads}: use a divisor of the head count"
            )
        if self.num_attention_heads % tp_size:
            raise ConfigError(
                f"--num-attention-heads {self.num_attention_heads} is not divisible by "
                f"--tensor-model-parallel-size {tp_size}: use a TP size that divides the head count"
            )
        if self.num_key_value_heads % tp_size:
            raise ConfigError(
                f"--num-key-value-heads {self.num_key_value_heads} is not divisible by "
                f"--tensor-model-parallel-size {tp_size}: use a TP size that divides the KV head count"
            )
        if self.ffn_hidden_size % tp_size:
            raise ConfigError(
                f"--ffn-hidden-size {self.ffn_hidden_size} is not divisible by --tensor-model-parallel-size {tp_size}"
            )
        if self.seq_length > self.max_position_embeddings:
            raise ConfigError(
                f"--seq-length {self.seq_length} exceeds --max-position-embeddings {self.max_position_embeddings}: "
                "raise --max-position-embeddings or shorten --seq-length"
            )
        if self.openai_gelu and self.swiglu:
            raise ConfigError("--openai-gelu with --swiglu: SwiGLU's MLP has no GeLU; drop one of them")
        if self.normalization not in ("layernorm", "rmsnorm"):
            raise ConfigError(f"--normalization {self.normalization!r}: choose 'layernorm' or 'rmsnorm'")
        if self.position_embedding_type not in ("learned_absolute", "rope"):
            raise ConfigError(f"position embedding {self.position_embedding_type!r}: use 'learned_absolute' or 'rope'")
        if self.position_embedding_type == "rope" and self.head_dim % 2:
            raise ConfigError(f"rotary embeddings need an even head dim, got {self.head_dim}")
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ConfigError(f"--rotary-percent {self.rotary_percent:g} must be in (0, 1]")
        if self.position_embedding_type == "rope" and (self.rotary_dim % 2 or self.rotary_dim == 0):
            raise ConfigError(f"--rotary-percent {self.rotary_percent:g} of head dim {self.head_dim} rotates "
                              f"{self.rotary_dim} channels: it must be an even number > 0; pick a percent giving one")
        if self.recompute_granularity not in (None, "full", "selective"):
            raise ConfigError(f"--recompute-granularity {self.recompute_granularity!r}: choose 'full' or 'selective'")
        if self.checkpoint_chunk_layers < 1 or (self.recompute_num_layers or 1) < 1:
            raise ConfigError("--checkpoint-num-layers / --recompute-num-layers must be >= 1")

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)


@dataclass
class ParallelConfig:
    """How ranks are laid out. Megatron's order: TP innermost, then DP, then PP outermost."""

    world_size: int = 1
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    sequence_parallel: bool = False
    zero_stage: int = 0
    zero_hierarchy: str | None = None
    """Hierarchical ZeRO-3 tiers, e.g. 'package,node,network' (megatron/core/hierarchical_zero); None = off."""
    zero_hierarchy_weights: str | None = None
    """Tier whose ranks share one copy of the 16-bit weights: 'node' or 'package' (default: node if listed)."""
    zero_hierarchy_int8: bool = False
    """Block-wise int8 on the network stage of hierarchical ZeRO (weights all-gather and gradient reduce)."""
    ds_sequence_parallel_size: int = 1
    """DeepSpeed-Ulysses sequence parallelism: SP ranks inside the data-parallel dimension each hold 1/SP of
    the sequence; attention switches to head-sharded with two all-to-alls (megatron/core/ulysses.py)."""

    @property
    def tp(self) -> int:
        return self.tensor_model_parallel_size

    @property
    def pp(self) -> int:
        return self.pipeline_model_parallel_size

    @property
    def sp(self) -> int:
        return self.ds_sequence_parallel_size

    @property
    def dp(self) -> int:
        """Pure data parallelism: ranks that load different samples (SP ranks share theirs)."""
        return self.world_size // (self.tp * self.pp * self.sp)

    def validate(self) -> None:
        for name, v in (("--tensor-model-parallel-size", self.tp), ("--pipeline-model-parallel-size", self.pp),
                        ("--ds-sequence-parallel-size", self.sp)):
            if v < 1:
                raise ConfigError(f"{name} must be >= 1, got {v}")
        if self.sp > 1 and self.world_size % (self.tp * self.pp * self.sp):
            raise ConfigError(
                f"world size {self.world_size} is not divisible by TP {self.tp} x PP {self.pp} x "
                f"--ds-sequence-parallel-size {self.sp} = {self.tp * self.pp * self.sp}: launch a multiple of "
                f"{self.tp * self.pp * self.sp} ranks or shrink the sizes")
        if self.world_size % (self.tp * self.pp):
            raise ConfigError(
                f"world size {self.world_size} is not divisible by --tensor-model-parallel-size {self.tp} x "
                f"--pipeline-model-parallel-size {self.pp} = {self.tp * self.pp}: launch a multiple of "
                f"{self.tp * self.pp} ranks or shrink TP/PP"
            )
        if self.sequence_parallel and self.tp == 1:
            # Megatron silently turns it off; we do the same but keep the flag honest.
            self.sequence_parallel = False
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"--zero-stage {self.zero_stage}: choose 0, 1, 2 or 3")


@dataclass
class OptimizerConfig:
    lr: float = 1e-4
    min_lr: float = 0.0
    lr_decay_style: str = "cosine"
    lr_warmup_iters: int = 0
    lr_warmup_fraction: float | None = None
    lr_decay_iters: int | None = None
    weight_decay: float = 0.01
    start_weight_decay: float | None = None
    end_weight_decay: float | None = None
    weight_decay_incr_style: str = "constant"
    """constant (--weight-decay throughout), or linear / cosine from --start-weight-decay to --end-weight-decay
    over the run's samples (upstream's OptimizerParamScheduler.get_wd)."""
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    optimizer: str = "adam"
    """'adam' (AdamW, as upstream's default FusedAdam with adam_w_mode) or 'sgd' (with ``sgd_momentum``)."""
    sgd_momentum: float = 0.9
    cpu_optimizer: bool = False
    """--cpu-optimizer: DeepSpeed's CPU Adam (AdamW mode), as upstream; also used for ZeRO-Offload JSONs."""
    cpu_torch_adam: bool = False
    """--cpu_torch_adam: with --cpu-optimizer, torch's AdamW instead of DeepSpeed's CPU Adam (as upstream)."""
    # Sample- and token-based schedule lengths and checkpoint semantics (megatron/optim/lr_schedule.py).
    lr_warmup_samples: int = 0
    lr_decay_samples: int | None = None
    lr_warmup_tokens: int | None = None
    lr_decay_tokens: int | None = None
    override_opt_param_scheduler: bool = False
    """On resume, the schedule's shape comes from the flags (upstream's --override-opt_param-scheduler)."""
    use_checkpoint_opt_param_scheduler: bool = False
    """On resume, the schedule's shape comes from the checkpoint. Neither flag: they must agree."""

    def weight_decay_range(self) -> tuple[float, float]:
        """(start, end) of the weight decay; both --weight-decay when constant."""
        if self.weight_decay_incr_style == "constant":
            return self.weight_decay, self.weight_decay
        return self.start_weight_decay, self.end_weight_decay

    def _validate_weight_decay(self) -> None:
        """Upstream's rules (validate_args and the scheduler's assertions), as one line each."""
        style, start, end = self.weight_decay_incr_style, self.start_weight_decay, self.end_weight_decay
        if style not in ("constant", "linear", "cosine"):
            raise ConfigError(f"--weight-decay-incr-style {style!r}: choose constant, linear or cosine")
        given = [f for f, v in (("--start-weight-decay", start), ("--end-weight-decay", end)) if v is not None]
        if style == "constant":
            if given:
                raise ConfigError(f"{' and '.join(given)} with --weight-decay-incr-style constant: a constant decay "
                                  "is --weight-decay; add --weight-decay-incr-style linear (or cosine) to ramp it")
            return
        missing = [f for f in ("--start-weight-decay", "--end-weight-decay") if f not in given]
        if missing:
            raise ConfigError(f"--weight-decay-incr-style {style} needs {' and '.join(missing)}")
        if start < 0 or end < start or start != start or end != end:
            raise ConfigError(f"--start-weight-decay {start:g} and --end-weight-decay {end:g}: need "
                              "0 <= start <= end (the decay only increases, as upstream's)")

    def validate(self) -> None:
        """Refuse what torch's AdamW would only refuse after the model is built (a traceback, then)."""
        self._validate_weight_decay()
        if self.optimizer not in ("adam", "sgd"):
            raise ConfigError(f"--optimizer {self.optimizer!r}: choose adam or sgd")
        if self.cpu_optimizer and self.optimizer != "adam":
            raise ConfigError("--cpu-optimizer with --optimizer sgd: CPU offloading is for Adam (as upstream); "
                              "drop one of them")
        if self.cpu_torch_adam and not self.cpu_optimizer:
            raise ConfigError("--cpu_torch_adam without --cpu-optimizer: add --cpu-optimizer or drop it")
        bad = []
        for flag, value, ok, want in (
                ("--lr", self.lr, self.lr >= 0, ">= 0"), ("--min-lr", self.min_lr, self.min_lr >= 0, ">= 0"),
                ("--adam-beta1", self.adam_beta1, 0 <= self.adam_beta1 < 1, "in [0, 1)"),
                ("--adam-beta2", self.adam_beta2, 0 <= self.adam_beta2 < 1, "in [0, 1)"),
                ("--adam-eps", self.adam_eps, self.adam_eps > 0, "> 0"),
                ("--weight-decay", self.weight_decay, self.weight_decay >= 0, ">= 0"),
                ("--sgd-momentum", self.sgd_momentum, self.sgd_momentum >= 0, ">= 0"),
                ("--clip-grad", self.clip_grad, self.clip_grad >= 0, ">= 0 (0 disables clipping)")):
            if not ok or value != value:  # value != value: NaN passes every comparison above
                bad.append(f"{flag} {value:g} must be {want}")
        if bad:
            raise ConfigError(f"{'; '.join(bad)}: fix the optimizer flags (e.g. --lr 3e-4 --adam-beta2 0.95 "
                              "--adam-eps 1e-8 --weight-decay 0.1)")


@dataclass
class PrecisionConfig:
    """The loss-scale fields are the flags as given (None: not on the command line). Under --fp16 they fill
    what the DeepSpeed JSON leaves out (megatron/engine.py); with bf16/fp32 they have no effect."""

    fp16: bool = False
    bf16: bool = False
    loss_scale: float | None = None
    """--loss-scale: a static loss scale (None: dynamic)."""
    initial_loss_scale: float | None = None
    loss_scale_window: int | None = None
    hysteresis: int | None = None
    min_loss_scale: float | None = None

    def validate(self) -> None:
        if self.fp16 and self.bf16:
            raise ConfigError("--fp16 and --bf16 are both set: pick one (bf16 is advised on MI250X)")

    @property
    def name(self) -> str:
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"


@dataclass
class TrainingConfig:
    micro_batch_size: int = 1
    global_batch_size: int | None = None
    train_iters: int | None = 10
    """Derived from ``train_samples`` (as upstream) when that is given."""
    train_samples: int | None = None
    train_tokens: int | None = None
    """Training also stops once this many tokens are consumed (upstream's --train-tokens)."""
    rampup_batch_size: tuple[int, int, int] | None = None
    """--rampup-batch-size START INCR SAMPLES (megatron/optim/microbatches.py)."""
    eval_interval: int = 1000
    eval_iters: int = 10
    log_interval: int = 100
    seed: int = 1234
    tensorboard_dir: str | None = None
    peak_tflops: float | None = None
    """Peak of one device for MFU; default: 191.5 (MI250X GCD bf16) on GPUs, measured on CPU."""

    def grad_accumulation_steps(self, dp: int) -> int:
        return self.global_batch_size // (self.micro_batch_size * dp)

    def validate(self, dp: int) -> None:
        for flag, value in (("--micro-batch-size", self.micro_batch_size), ("--global-batch-size",
                            self.global_batch_size), ("--log-interval", self.log_interval),
                            ("--eval-interval", self.eval_interval)):
            if value is not None and value < 1:
                raise ConfigError(f"{flag} {value} must be >= 1")
        if self.global_batch_size is None:
            self.global_batch_size = self.micro_batch_size * dp
        if self.global_batch_size % (self.micro_batch_size * dp):
            raise ConfigError(
                f"--global-batch-size {self.global_batch_size} is not divisible by --micro-batch-size "
                f"{self.micro_batch_size} x data-parallel size {dp} = {self.micro_batch_size * dp}: "
                f"use a multiple of {self.micro_batch_size * dp}"
            )


@dataclass
class RunConfig:
    """Everything one training run needs, validated together."""

    model: ModelConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    notes: list[str] = field(default_factory=list)
    """Flags accepted as provable no-ops for this run: printed once on rank 0 (megatron/engine.py log_notes)."""

    def validate(self) -> RunConfig:
        self.parallel.validate()
        self.model.validate(self.parallel.tp)
        self._validate_sequence_parallel()
        self.precision.validate()
        self.optimizer.validate()
        self.training.validate(self.parallel.dp)
        from megatron.optim.schedule_config import validate_schedule

        validate_schedule(self)  # --train-samples / token / ramp arithmetic and upstream's schedule checks
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
