"""Transformer MLP: GeLU, SwiGLU or squared ReLU, column-parallel up-projection, row-parallel down-projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron.config import ModelConfig
from megatron.core.parallel_state import GroupInfo
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.layers import scaled_init_std
from megatron.model.fusions import bias_gelu


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_number: int, *, tp: GroupInfo, sequence_parallel: bool,
                 init_seed: int, init_prefix: str | None = None) -> None:
        """``init_prefix``: the key its weights are drawn under (default ``layers.N.mlp``; each expert of an MoE
        layer has its own)."""
        super().__init__()
        prefix = init_prefix or f"layers.{layer_number}.mlp"
        self.swiglu, self.squared_relu = cfg.swiglu, cfg.squared_relu
        # "tanh": OpenAI GPT-2's approximation (HF gelu_new / gelu_pytorch_tanh), so imported weights match.
        self.gelu_approximate = "tanh" if cfg.openai_gelu else "none"
        common = dict(tp=tp, bias=cfg.add_bias_linear, seed=init_seed, use_cpu_init=cfg.use_cpu_initialization,
                      sequence_parallel=sequence_parallel, init_method=cfg.init_method)
        # SwiGLU's fc1 is [gate; up] stacked: stride 2 keeps each rank's gate and up rows aligned.
        fc1_out = 2 * cfg.ffn_hidden_size if cfg.swiglu else cfg.ffn_hidden_size
        # fc1's bias leaves the matmul only when torch.compile can fuse it into the GeLU: in eager mode a
        # separate add costs a pass over [s, b, ffn] that addmm's bias epilogue does for free (measured on
        # CPU: 6% of the step, bench/RESULTS.md).
        self.dense_h_to_4h = ColumnParallelLinear(
            cfg.hidden_size, fc1_out, init_std=cfg.init_method_std, stride=2 if cfg.swiglu else 1,
            init_key=f"{prefix}.fc1",
            skip_bias_add=cfg.bias_gelu_fusion and cfg.torch_compile and not (cfg.swiglu or cfg.squared_relu),
            **common)
        out_std = scaled_init_std(cfg.init_method_std, cfg.num_layers) if cfg.apply_residual_scaling \
            else cfg.init_method_std
        self.dense_4h_to_h = RowParallelLinear(
            cfg.ffn_hidden_size, cfg.hidden_size, init_std=out_std,
            init_key=f"{prefix}.fc2", skip_bias_add=cfg.bias_dropout_fusion, **common)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x: [s(/tp), b, h] -> ([s(/tp), b, h], fc2's bias [h] or None), Megatron's (output, output_bias):
        the bias comes back un-added with --bias-dropout-fusion. The intermediate is [s, b, ffn/tp]."""
        h, fc1_bias = self.dense_h_to_4h(x)  # fc1_bias: not None only with bias-GeLU fusion
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        elif self.squared_relu:  # upstream's squared_relu: pow(relu(x), 2), fc1's bias already added
            h = torch.pow(F.relu(h), 2)
        else:
            h = bias_gelu(h, fc1_bias, self.gelu_approximate)  # erf or tanh GeLU (--openai-gelu) alike
        return self.dense_4h_to_h(h)
