"""Float64 references, error measure, tolerances and output poisoning shared by the kernel tests."""

from __future__ import annotations

import torch

# Tolerances of issue 6: fp32 <= 1e-5 relative, bf16 <= 1e-2; fp16 (3 more mantissa bits) in between.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def rel_err(out: torch.Tensor, ref: torch.Tensor, floor_rms: float = 0.0) -> float:
    """Norm-wise relative error ||out - ref||_F / max(||ref||_F, floor_rms * sqrt(numel)), in float64.

    floor_rms guards exact-zero references (dq when each row sees a single key), where fp32 rounding of
    terms that cancel exactly would otherwise be an infinite relative error; callers pass a fraction of
    the natural scale of the quantity (gradients are linear in the incoming gradient).
    """
    ref = ref.double()
    denom = max(ref.norm().item(), floor_rms * max(ref.numel(), 1) ** 0.5)
    return ((out.double() - ref).norm() / denom).item()


def nan_alloc(shape, dtype, device) -> torch.Tensor:
    """Stand-in for a kernel module's _alloc: every output starts as NaN, so an unwritten element shows."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) in float64, written out naively: materialised scores, explicit mask, explicit GQA."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = q @ k.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1) @ v, torch.logsumexp(s, dim=-1)


def layer_norm_ref(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, eps: float,
                   rms: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, mean, rstd) in float64."""
    x = x.double()
    mean = torch.zeros(x.shape[:-1], dtype=torch.float64) if rms else x.mean(-1)
    xc = x - mean[..., None]
    rstd = torch.rsqrt(xc.pow(2).mean(-1) + eps)
    y = xc * rstd[..., None] * w.double()
    if b is not None:
        y = y + b.double()
    return y, mean, rstd
