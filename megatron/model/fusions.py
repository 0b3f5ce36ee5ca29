"""Megatron's elementwise fusions as plain functions: bias-GeLU and bias-dropout-add.

Why plain functions: each is one producer-consumer chain (add -> GeLU, add -> dropout -> add) that
torch.compile (``--compile``) turns into a single kernel, saving a read and a write of the [s, b, ffn]
or [s, b, h] activation per op; in eager mode they run the same ops as the unfused path, so the CPU
numerics stay those of the unfused model (tests/unit/test_fast_step.py checks both).
Megatron jit-scripts the tanh GeLU only; here the form follows the model (exact erf, or tanh with
--openai-gelu), so a fused run computes exactly the GeLU the weights were trained or converted with.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def bias_gelu(y: torch.Tensor, bias: torch.Tensor | None, approximate: str = "none") -> torch.Tensor:
    """GeLU(y + bias) over [s, b, ffn/tp]; ``approximate`` is "none" (erf) or "tanh"."""
    return F.gelu(y if bias is None else y + bias, approximate=approximate)


def bias_dropout_add(y: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, p: float,
                     training: bool) -> torch.Tensor:
    """residual + dropout(y + bias) over [s, b, h] (dropout only when training and p > 0)."""
    if bias is not None:
        y = y + bias
    if training and p > 0.0:
        y = F.dropout(y, p=p, training=True)
    return residual + y
