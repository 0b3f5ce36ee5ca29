"""Causal self-attention with tensor-parallel heads and grouped-query attention."""

from __future__ import annotations

import torch
from torch import nn

from megatron.config import ModelConfig
from megatron.core.parallel_state import GroupInfo
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.layers import scaled_init_std
from megatron.core.tensor_parallel.random import get_rng_tracker
from megatron.core.tensor_parallel.recompute import checkpoint
from megatron.core.ulysses import heads_to_seq, seq_to_heads
from megatron.kernels.attention import dot_product_attention
from megatron.model.rotary import apply_rotary, rotary_cos_sin


class SelfAttention(nn.Module):
    """QKV (column-parallel) -> attention core -> output projection (row-parallel).

    The fused QKV weight is laid out per KV group: [q_1 .. q_g, k, v] for each of the nkv groups
    (g = heads / kv heads), so a contiguous TP split hands each rank whole groups.

    DeepSpeed-Ulysses (``ulysses`` of size > 1): the input holds 1/SP of the sequence; the fused QKV goes through one
    all-to-all (whole KV groups per SP rank, so GQA stays intact), attention runs over the whole sequence on
    1/SP of this TP rank's heads, and a second all-to-all brings the context back to the sequence shard.
    """

    def __init__(self, cfg: ModelConfig, layer_number: int, *, tp: GroupInfo, sequence_parallel: bool,
                 init_seed: int, ulysses: GroupInfo | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        self.ulysses = ulysses if ulysses is not None else GroupInfo([0], 0, None)
        self.heads = cfg.num_attention_heads // tp.size
        self.kv_heads = cfg.num_key_value_heads // tp.size
        self.head_dim = cfg.head_dim
        qkv_size = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
        common = dict(tp=tp, bias=cfg.add_bias_linear, seed=init_seed, use_cpu_init=cfg.use_cpu_initialization,
                      sequence_parallel=sequence_parallel, init_method=cfg.init_method)
        self.query_key_value = ColumnParallelLinear(
            cfg.hidden_size, qkv_size, init_std=cfg.init_method_std,
            init_key=f"layers.{layer_number}.attention.qkv", **common)
        proj_std = scaled_init_std(cfg.init_method_std, cfg.num_layers) if cfg.apply_residual_scaling \
            else cfg.init_method_std
        self.dense = RowParallelLinear(
            cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, init_std=proj_std,
            init_key=f"layers.{layer_number}.attention.dense", skip_bias_add=cfg.bias_dropout_fusion, **common)
        self.selective_recompute = cfg.recompute_granularity == "selective"

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        dropout = self.cfg.attention_dropout if self.training else 0.0
        # Heads are TP-sharded, so each rank must draw its own dropout mask: fork the TP RNG.
        with get_rng_tracker().fork():
            return dot_product_attention(q, k, v, causal=True, dropout_p=dropout,
                                         backend=self.cfg.attention_backend)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x: [s(/tp with SP), b, h] -> ([s(/tp), b, h], the projection's bias [h] if left un-added for
        the fused bias-dropout-add, else None)."""
        mixed, _ = self.query_key_value(x)  # [s/SP, b, (nq + 2 nkv)/tp * d]
        g = self.heads // self.kv_heads
        mixed = mixed.view(mixed.shape[0], mixed.shape[1], self.kv_heads, g + 2, self.head_dim)
        mixed = seq_to_heads(mixed, self.ulysses)  # [s, b, nkv/tp/SP, g + 2, d]: the whole sequence, whole KV groups
        s, b, kv_heads = mixed.shape[:3]
        heads = kv_heads * g
        q = mixed[:, :, :, :g].reshape(s, b, heads, self.head_dim)  # [s, b, nq/tp/SP, d]
        k, v = mixed[:, :, :, g], mixed[:, :, :, g + 1]  # [s, b, nkv/tp/SP, d]
        if self.cfg.position_embedding_type == "rope":
            cos, sin = rotary_cos_sin(s, self.cfg.rotary_dim, self.cfg.rotary_base, q.device, q.dtype)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # [s, b, n, d] -> [b, n, s, d] for the kernel seam.
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        if self.selective_recompute and self.training:
            ctx = checkpoint(self._core, q, k, v)  # drops the [b, n, s, s] scores/probs
        else:
            ctx = self._core(q, k, v)
        ctx = heads_to_seq(ctx.permute(2, 0, 1, 3), self.ulysses)  # [b, n, s, d] -> [s/SP, b, nq/tp, d]
        return self.dense(ctx.reshape(ctx.shape[0], b, self.heads * self.head_dim))  # [s/SP, b, nq/tp * d]
