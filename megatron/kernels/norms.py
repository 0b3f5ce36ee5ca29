"""Norm ops behind one seam: torch (always), Triton or HIP fused kernels when available."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.kernels import select


def _pick(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, backend: str) -> str:
    """The backend that runs this norm call: the chosen one if it takes these inputs, else the next."""
    chosen = select.choose("norm", backend, x.device)
    for candidate in select.fallback_order(chosen):
        if candidate == "hip":
            from megatron.kernels import hip_ops

            why = hip_ops.norm_unsupported(x, weight, bias)
        elif candidate == "triton":
            if not select.available("triton", "norm", x.device)[0]:
                continue
            from megatron.kernels import triton_norms

            why = triton_norms.unsupported_reason(x, weight, bias)
        else:
            return "torch"
        if why is None:
            return candidate
        select.once(f"norm:{candidate}:{why}", f"norm: {candidate} kernel cannot take {why}; falling back")
    return "torch"


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
               backend: str = "auto") -> torch.Tensor:
    """LayerNorm over the last dim; statistics in fp32."""
    picked = _pick(x, weight, bias, backend)
    if picked == "hip":
        from megatron.kernels import hip_ops

        return hip_ops.HipNorm.apply(x, weight, bias, eps, False)
    if picked == "triton":
        from megatron.kernels import triton_norms

        return triton_norms.layer_norm(x, weight, bias, eps)
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, backend: str = "auto") -> torch.Tensor:
    """RMSNorm over the last dim; statistics in fp32, output in x's dtype."""
    picked = _pick(x, weight, None, backend)
    if picked == "hip":
        from megatron.kernels import hip_ops

        return hip_ops.HipNorm.apply(x, weight, None, eps, True)
    if picked == "triton":
        from megatron.kernels import triton_norms

        return triton_norms.rms_norm(x, weight, eps)
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return y.to(x.dtype) * weight
