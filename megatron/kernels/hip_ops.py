"""Loader and autograd wrappers for the HIP kernels compiled from csrc/ (built on ROCm or CUDA torch)."""

from __future__ import annotations

import functools
import importlib
import math
from types import ModuleType

import torch

_MODULES = {"attention": "megatron.kernels._flash_attn_hip", "norm": "megatron.kernels._fused_norm_hip"}


@functools.cache
def _ext(op: str) -> ModuleType | None:
    try:
        return importlib.import_module(_MODULES[op])
    except ImportError:
        return None


def built(op: str) -> bool:
    """Whether setup.py built the extension for op ("attention" | "norm")."""
    return _ext(op) is not None


def attention_unsupported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> str | None:
    """Why the HIP flash-attention kernel cannot run these inputs, or None."""
    if dropout_p > 0.0:
        return "attention dropout > 0"
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtype {q.dtype} (HIP kernel takes float16/bfloat16)"
    if q.shape[-1] not in (64, 128):
        return f"head dim {q.shape[-1]} (HIP kernel takes 64 or 128)"
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:] or q.shape[1] % k.shape[1]:
        return f"shapes q={tuple(q.shape)}, k={tuple(k.shape)}"
    return None


def norm_unsupported(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str | None:
    """Why the HIP norm kernel cannot run these inputs, or None."""
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"dtype {x.dtype}"
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        return f"weight/bias dtype differs from input dtype {x.dtype}"
    return None


class HipFlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
        o, lse = _ext("attention").fwd(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale = causal, scale
        return o

    @staticmethod
    def backward(ctx, do: torch.Tensor):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = _ext("attention").bwd(do, q, k, v, o, lse, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None


class HipNorm(torch.autograd.Function):
    """LayerNorm (bias may be None) or RMSNorm (rms=True) over the last dim."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
                rms: bool) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        y, mean, rstd = _ext("norm").fwd(x2, weight, bias, eps, rms)
        ctx.save_for_backward(x2, weight, mean, rstd)
        ctx.has_bias, ctx.rms, ctx.shape = bias is not None, rms, x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = _ext("norm").bwd(dy.reshape(x2.shape), x2, weight, mean, rstd, ctx.has_bias, ctx.rms)
        return dx.view(ctx.shape), dw, db if ctx.has_bias else None, None, None


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                    softmax_scale: float | None = None) -> torch.Tensor:
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return HipFlashAttention.apply(q, k, v, causal, scale)
