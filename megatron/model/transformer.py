"""Pre-norm transformer block: x + Attn(Norm(x)), then x + MLP(Norm(x)), on [s, b, h]; the MLP of an MoE layer is
the mixture of experts (megatron/model/moe.py). With --apply-residual-connection-post-layernorm the residual around
each is the norm's output instead of x (upstream's ordering for original BERT); the layer stays pre-norm."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from megatron.config import ModelConfig
from megatron.core.parallel_state import GroupInfo
from megatron.core.tensor_parallel.random import get_rng_tracker
from megatron.model.attention import SelfAttention
from megatron.model.fusions import bias_dropout_add
from megatron.model.mlp import MLP
from megatron.model.moe import MoE
from megatron.model.norms import Norm


class TransformerLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_number: int, *, tp: GroupInfo, sequence_parallel: bool = False,
                 init_seed: int = 1234, ulysses: GroupInfo | None = None, num_experts: int = 1,
                 ep: GroupInfo | None = None) -> None:
        """``num_experts`` > 1: an MoE layer, its experts split over ``ep`` (default: all on this rank)."""
        super().__init__()
        self.cfg = cfg
        self.layer_number = layer_number
        self.sequence_parallel = sequence_parallel and tp.size > 1
        norm = dict(kind=cfg.normalization, eps=cfg.layernorm_epsilon, tp=tp, sequence_parallel=sequence_parallel,
                    backend=cfg.attention_backend, one_plus=cfg.apply_layernorm_1p)
        self.input_layernorm = Norm(cfg.hidden_size, **norm)
        self.self_attention = SelfAttention(cfg, layer_number, tp=tp, sequence_parallel=sequence_parallel,
                                            init_seed=init_seed, ulysses=ulysses)
        self.post_attention_layernorm = Norm(cfg.hidden_size, **norm)
        self.is_moe = num_experts > 1
        if self.is_moe:
            self.mlp = MoE(cfg, layer_number, num_experts, tp=tp, ep=ep if ep is not None else GroupInfo([0], 0, None),
                           sequence_parallel=sequence_parallel, init_seed=init_seed)
        else:
            self.mlp = MLP(cfg, layer_number, tp=tp, sequence_parallel=sequence_parallel, init_seed=init_seed)

    def _bias_dropout_add(self, y: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor) -> torch.Tensor:
        p = self.cfg.hidden_dropout if self.training else 0.0
        # Sequence-parallel shards hold different tokens on each TP rank: draw different masks.
        ctx = get_rng_tracker().fork() if (self.sequence_parallel and p > 0.0) else contextlib.nullcontext()
        with ctx:
            return bias_dropout_add(y, bias, residual, p, self.training)

    def forward(self, x: torch.Tensor, keys: torch.Tensor | None = None) -> torch.Tensor:
        """x: [s(/tp with SP), b, h] -> same shape. ``keys`` [s, b]: the tokens' random-draw keys (MoE layers)."""
        y = self.input_layernorm(x)
        x = self._bias_dropout_add(*self.self_attention(y), self._residual(x, y))
        y = self.post_attention_layernorm(x)
        return self._bias_dropout_add(*(self.mlp(y, keys) if self.is_moe else self.mlp(y)), self._residual(x, y))

    def _residual(self, x: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        """What attention's or the MLP's output is added to: the stream ``x``, or with a post-norm residual their
        input norm's output, in the stream's dtype (fp32 with --fp32-residual-connection)."""
        return normed.to(x.dtype) if self.cfg.apply_residual_connection_post_layernorm else x
