"""The model's shape and variant (GPT-2 or Llama), and the one parameter-count formula the planner, the pipeline
partitioner, the layout report and the FLOPs count share (mixture-of-experts layers included)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megatron.config.moe import MoEConfig
from megatron.config.parallel import split_layers
from megatron.errors import ConfigError
from megatron.flag_bounds import check_fields

# Fields with a row in megatron/flag_bounds.py, and the flag that sets each.
_BOUNDED = {f: "--" + f.replace("_", "-") for f in (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_key_value_heads", "seq_length",
    "max_position_embeddings", "make_vocab_size_divisible_by", "layernorm_epsilon", "rotary_base", "rotary_percent",
    "hidden_dropout", "attention_dropout", "init_method_std", "recompute_num_layers")}
_BOUNDED["checkpoint_chunk_layers"] = "--checkpoint-num-layers=checkpoint_num_layers"


@dataclass(frozen=True)
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
    squared_relu: bool = False
    """--squared-relu: the MLP's activation is relu(x)^2 (upstream's ``squared_relu``; HF's ``relu2``)."""
    apply_layernorm_1p: bool = False
    """--apply-layernorm-1p: every LayerNorm (the final one too) stores its weight zero-centred, computing with
    1 + weight (upstream's CUDA MixedFusedLayerNorm, Nemotron's LayerNorm1P)."""
    apply_residual_connection_post_layernorm: bool = False
    """--apply-residual-connection-post-layernorm: the residual added around attention and MLP is their input
    norm's output, not the layer's input (upstream's original-BERT ordering); the layer stays pre-norm."""
    fp32_residual_connection: bool = False
    """--fp32-residual-connection: the residual stream (the embedding's output, every residual add, the tensors
    between pipeline stages) is fp32 under --bf16/--fp16; the norms compute in fp32 and hand attention and MLP the
    run's dtype."""
    embedding_weights_in_fp32: bool = False
    """--embedding-weights-in-fp32: the word-embedding lookup (and its TP reduction and gradient) runs on an fp32
    copy of the table, rounded to the run's dtype after; no effect in fp32 runs."""
    init_method_xavier_uniform: bool = False
    """--init-method-xavier-uniform: every weight --init-method-std would draw (QKV, projections, MLPs, experts,
    embeddings, positions, the untied output layer) is torch's xavier_uniform_ of the full matrix instead, with no
    1/sqrt(2L) output scaling (upstream's intent)."""
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
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Mixture of experts (megatron/config/moe.py); the default is the dense model."""

    def __post_init__(self) -> None:
        """The defaults that follow from other fields, filled once (the config is frozen after)."""
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.ffn_hidden_size is None:
            ffn = (int((4 * self.hidden_size * 2 / 3) / 64) * 64 or 4 * self.hidden_size) if self.swiglu \
                else 4 * self.hidden_size
            object.__setattr__(self, "ffn_hidden_size", ffn)
        if self.max_position_embeddings is None:
            object.__setattr__(self, "max_position_embeddings", self.seq_length)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """Channels of a head that rotary embeddings rotate (the first ones), as upstream computes it."""
        return int(self.head_dim * self.rotary_percent) if self.rotary_percent < 1.0 else self.head_dim

    @property
    def init_method(self) -> str:
        """How the tensor-parallel layers draw their weights: 'normal' (N(0, std)) or 'xavier_uniform'."""
        return "xavier_uniform" if self.init_method_xavier_uniform else "normal"

    @property
    def tie_embeddings(self) -> bool:
        return not self.untie_embeddings_and_output_weights

    def padded_vocab_size(self, tp_size: int = 1) -> int:
        """Megatron pads the vocab to a multiple of make_vocab_size_divisible_by * TP."""
        multiple = self.make_vocab_size_divisible_by * tp_size
        return ((self.vocab_size + multiple - 1) // multiple) * multiple

    def norm_parameters(self) -> int:
        """One norm's parameters (LayerNorm: weight and bias; RMSNorm: weight)."""
        return 2 * self.hidden_size if self.normalization == "layernorm" else self.hidden_size

    def mlp_parameters(self) -> int:
        """One whole MLP (a dense layer's, or one expert): fc1 and fc2 with their biases."""
        h, f = self.hidden_size, self.ffn_hidden_size
        fc1_out = 2 * f if self.swiglu else f  # SwiGLU's fc1 holds the gate and the up projection
        bias = 1 if self.add_bias_linear else 0
        return h * fc1_out + bias * fc1_out + f * h + bias * h

    def layer_parameters(self, tp: int = 1, num_experts: int = 1, ep: int = 1) -> int:
        """Parameters of one transformer layer held by one TP rank: the QKV, projection and MLP matrices (and their
        column-parallel biases) are split over TP, the row-parallel biases and the two norms are replicated.

        ``num_experts`` > 1: an MoE layer (megatron/model/moe.py), whose experts are split over ``ep`` expert-parallel
        ranks and, only with --enable-expert-tensor-parallelism, over TP; its gate (and PR-MoE's mixing
        coefficient) is replicated, PR-MoE's dense MLP split over TP like the experts."""
        return sum(self.layer_parameter_kinds(tp, num_experts, ep))

    def layer_parameter_kinds(self, tp: int = 1, num_experts: int = 1, ep: int = 1) -> tuple[int, int, int, int]:
        """``layer_parameters`` by kind, as the optimizer groups them (megatron/optim/optimizer.py: weight decay on
        matrices, none on vectors; experts in groups of their own, which ZeRO shards over the experts' replicas):
        (dense matrices, dense vectors, expert matrices, expert vectors) of one TP rank."""
        h = self.hidden_size
        kv = self.num_key_value_heads * self.head_dim
        bias = 1 if self.add_bias_linear else 0
        f, fc1_out = self.ffn_hidden_size, (2 if self.swiglu else 1) * self.ffn_hidden_size
        matrices = (h * (h + 2 * kv) + h * h) // tp  # QKV and the projection
        vectors = bias * (h + 2 * kv) // tp + bias * h + 2 * self.norm_parameters()  # proj bias, norms replicated
        # An MLP split over ``t`` ranks: fc1 and fc2 (and fc1's bias) split, fc2's row-parallel bias replicated.
        def mlp_matrices(t: int) -> int:
            return h * fc1_out // t + f * h // t

        def mlp_vectors(t: int) -> int:
            return bias * fc1_out // t + bias * h

        if num_experts == 1:
            return matrices + mlp_matrices(tp), vectors + mlp_vectors(tp), 0, 0
        # An expert under TP is the dense MLP's split; without, whole on every TP rank. The gate [E, h] is replicated.
        expert_tp = tp if self.moe.enable_expert_tensor_parallelism else 1
        local = num_experts // ep
        matrices += num_experts * h
        if self.moe.mlp_type == "residual":  # PR-MoE's dense MLP and its mixing coefficient Linear(h, 2)
            matrices += mlp_matrices(expert_tp) + 2 * h
            vectors += mlp_vectors(expert_tp) + 2
        return matrices, vectors, local * mlp_matrices(expert_tp), local * mlp_vectors(expert_tp)

    def active_layer_parameters(self, num_experts: int = 1) -> int:
        """Parameters one token passes through in one layer (full model): a dense layer's all; an MoE layer's gate
        and its top-k experts (PR-MoE: plus the dense MLP), what its FLOPs follow."""
        if num_experts == 1:
            return self.layer_parameters()
        one = self.layer_parameters(num_experts=num_experts, ep=num_experts)  # exactly one expert held
        return one + (self.moe.topk - 1) * self.mlp_parameters()

    def position_parameters(self) -> int:
        """The learned position table (replicated over TP, as Megatron's); rotary embeddings have none."""
        return self.max_position_embeddings * self.hidden_size if self.position_embedding_type == "learned_absolute" \
            else 0

    def word_embedding_parameters(self, tp: int = 1) -> int:
        """One TP rank's rows of the padded word embedding (the untied output layer has as many)."""
        return self.padded_vocab_size(tp) * self.hidden_size // tp

    def layer_experts(self) -> list[int]:
        """Expert count of every layer (1: dense)."""
        return self.moe.experts_per_layer(self.num_layers)

    def stage_layer_counts(self, pp: int, standalone_embedding: bool = False) -> list[int]:
        """Transformer layers of each pipeline stage under GPTModelPipe's default partition ('type:TransformerLayer'):
        an even split, the remainder on the first stages (``standalone_embedding``: none on stage 0)."""
        return split_layers(self.num_layers, pp, standalone_embedding)

    def num_parameters(self, tp_size: int = 1, active: bool = False) -> int:
        """Exact count of the full (unsharded) model's parameters, with the vocabulary padded for ``tp_size``.
        ``active``: an MoE layer counts only what one token passes through (``active_layer_parameters``)."""
        words = self.word_embedding_parameters(tp_size) * tp_size
        out = 0 if self.tie_embeddings else words
        layers = sum(self.active_layer_parameters(n) if active else self.layer_parameters(num_experts=n)
                     for n in self.layer_experts())
        return layers + words + self.position_parameters() + self.norm_parameters() + out

    def validate(self, tp_size: int = 1) -> None:
        check_fields(self, _BOUNDED)
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
        if self.squared_relu and (self.swiglu or self.openai_gelu):
            other = "--swiglu" if self.swiglu else "--openai-gelu"
            raise ConfigError(f"--squared-relu with {other}: upstream silently runs {other[2:]} then (its order is "
                              "openai-gelu, swiglu, squared-relu); drop one of them")
        if self.apply_layernorm_1p and self.normalization != "layernorm":
            raise ConfigError("--apply-layernorm-1p with --normalization rmsnorm: upstream ignores it for RMSNorm, "
                              "Megatron-LM applies it; drop it or use --normalization layernorm")
        if self.normalization not in ("layernorm", "rmsnorm"):
            raise ConfigError(f"--normalization {self.normalization!r}: choose 'layernorm' or 'rmsnorm'")
        if self.position_embedding_type not in ("learned_absolute", "rope"):
            raise ConfigError(f"position embedding {self.position_embedding_type!r}: use 'learned_absolute' or 'rope'")
        if self.position_embedding_type == "rope" and self.head_dim % 2:
            raise ConfigError(f"rotary embeddings need an even head dim, got {self.head_dim}")
        if self.position_embedding_type == "rope" and (self.rotary_dim % 2 or self.rotary_dim == 0):
            raise ConfigError(f"--rotary-percent {self.rotary_percent:g} of head dim {self.head_dim} rotates "
                              f"{self.rotary_dim} channels: it must be an even number > 0; pick a percent giving one")
        check_recompute_granularity(self.recompute_granularity)

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)


def check_recompute_granularity(granularity: str | None) -> None:
    """The model's recompute, and the planner's (megatron/perf/layout.py)."""
    if granularity not in (None, "full", "selective"):
        raise ConfigError(f"--recompute-granularity {granularity!r}: choose 'full' or 'selective'")
