"""Norm ops behind one seam: torch (always), Triton or HIP fused kernels when available."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from megatron.kernels import hip_ops, measure, select


def _why_not(candidate: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str | None:
    """Why ``candidate`` cannot run this norm call here, or None."""
    if candidate == "hip":
        return hip_ops.norm_unsupported(x, weight, bias)
    if candidate == "triton":
        ok, why = select.available("triton", "norm", x.device)
        if not ok:
            return why
        from megatron.kernels import triton_norms  # lazy: triton is optional and slow to import

        return triton_norms.unsupported_reason(x, weight, bias)
    return None


def _pick(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, backend: str, eps: float,
          rms: bool) -> str:
    """The backend that runs this norm call: ``auto`` on an accelerator by measurement (megatron/kernels/
    measure.py); otherwise the chosen one if it takes these inputs, else the next in preference."""
    backend = measure.resolve(backend)
    if backend == "auto" and measure.enabled(x.device):
        usable = [b for b in select.PREFERENCE if b == "torch" or (
            select.available(b, "norm", x.device)[0] and _why_not(b, x, weight, bias) is None)]
        if len(usable) == 1:
            return "torch"
        key = measure.key_of("rmsnorm" if rms else "layernorm", (x, weight, bias))
        thunks = lambda: {b: measure.fwd_bwd(functools.partial(_run, b, eps=eps, rms=rms), x, weight, bias)  # noqa: E731
                          for b in usable}
        return measure.fastest(key, thunks, x.device)
    chosen = select.choose("norm", backend, x.device)
    for candidate in select.fallback_order(chosen):
        if candidate == "torch":
            return "torch"
        why = _why_not(candidate, x, weight, bias)
        if why is None:
            return candidate
        if candidate != "triton" or select.available("triton", "norm", x.device)[0]:
            select.once(f"norm:{candidate}:{why}", f"norm: {candidate} kernel cannot take {why}; falling back")
    return "torch"


def _run(picked: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
         rms: bool) -> torch.Tensor:
    if picked == "hip":
        return hip_ops.HipNorm.apply(x, weight, bias, eps, rms)
    if picked == "triton":
        from megatron.kernels import triton_norms  # lazy: triton is optional and slow to import

        return triton_norms.rms_norm(x, weight, eps) if rms else triton_norms.layer_norm(x, weight, bias, eps)
    if rms:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return y.to(x.dtype) * weight
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
               backend: str = "auto") -> torch.Tensor:
    """LayerNorm over the last dim; statistics in fp32."""
    return _run(_pick(x, weight, bias, backend, eps, rms=False), x, weight, bias, eps, rms=False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, backend: str = "auto") -> torch.Tensor:
    """RMSNorm over the last dim; statistics in fp32, output in x's dtype."""
    return _run(_pick(x, weight, None, backend, eps, rms=True), x, weight, None, eps, rms=True)
