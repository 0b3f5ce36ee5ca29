"""Model FLOPs of one training iteration, Megatron's way (counted matmuls, recompute separate).

This one formula serves the training log's ``TFLOPs:`` figure and the planner, so predicted and
measured numbers compare directly. Attention scores are counted in full (no causal halving), as
Megatron and torch's flop counter both do.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.config import ModelConfig


@dataclass
class IterationFlops:
    model: float
    """Forward + backward (3x forward): the useful work that MFU is measured on."""
    recompute: float
    """Extra forward FLOPs spent recomputing activations (0 without recomputation)."""

    @property
    def total(self) -> float:
        return self.model + self.recompute


def forward_flops_per_token(cfg: ModelConfig, vocab_size: int | None = None) -> tuple[float, float]:
    """(transformer layers, output logits) forward FLOPs for one token at sequence length cfg.seq_length.
    An MoE layer counts what one token runs through: its gate and top-k experts (PR-MoE: and the dense MLP with its
    mixing coefficient), the active parameters of ModelConfig.active_layer_parameters."""
    h, s, f = cfg.hidden_size, cfg.seq_length, cfg.ffn_hidden_size
    kv = cfg.num_key_value_heads * cfg.head_dim
    v = vocab_size if vocab_size is not None else cfg.padded_vocab_size()
    qkv = 2 * h * (h + 2 * kv)
    scores = 2 * 2 * s * h  # QK^T and attention @ V, each s*h MACs per token
    proj = 2 * h * h
    mlp = 2 * h * f * (3 if cfg.swiglu else 2)
    layers = 0
    for n in cfg.layer_experts():
        layer_mlp = mlp
        if n > 1:
            layer_mlp = cfg.moe.topk * mlp + 2 * h * n
            if cfg.moe.mlp_type == "residual":
                layer_mlp += mlp + 2 * h * 2
        layers += qkv + scores + proj + layer_mlp
    return layers, 2 * h * v


def iteration_flops(cfg: ModelConfig, global_batch_size: int, vocab_size: int | None = None,
                    recompute_granularity: str | None = None, recompute_layers: int | None = None) -> IterationFlops:
    """FLOPs of one iteration of ``global_batch_size`` sequences.

    Full recompute re-runs the forward of ``recompute_layers`` layers (default all); selective
    recompute re-runs only the attention core (QK^T, softmax, AV).
    """
    tokens = global_batch_size * cfg.seq_length
    layers_f, logits_f = forward_flops_per_token(cfg, vocab_size)
    model = 3 * tokens * (layers_f + logits_f)
    recompute = 0.0
    if recompute_granularity == "full":
        n = cfg.num_layers if recompute_layers is None else min(recompute_layers, cfg.num_layers)
        recompute = tokens * layers_f * n / cfg.num_layers
    elif recompute_granularity == "selective":
        recompute = tokens * cfg.num_layers * 4 * cfg.seq_length * cfg.hidden_size
    return IterationFlops(model=float(model), recompute=float(recompute))
