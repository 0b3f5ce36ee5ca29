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


def dtype_id(value) -> str | None:
    """pytest id of a parameter: a dtype by its name (so ``-k bfloat16`` selects its cases), else pytest's own."""
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else None


def record_errors(record_property, errors: dict[str, tuple[float, float]]) -> None:
    """The worst error / tolerance of a check into the JUnit report (``err_over_tol``; tests/gpu/quick reads it)."""
    record_property("err_over_tol", f"{max(err / tol for err, tol in errors.values()):.3g}")


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
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1) @ v, torch.logsumexp(s, dim=-1)


def layer_norm_ref(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, eps: float,
                   rms: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, mean, rstd) in float64."""
    x = x.double()
    mean = torch.zeros(x.shape[:-1], dtype=torch.float64, device=x.device) if rms else x.mean(-1)
    xc = x - mean[..., None]
    rstd = torch.rsqrt(xc.pow(2).mean(-1) + eps)
    y = xc * rstd[..., None] * w.double()
    if b is not None:
        y = y + b.double()
    return y, mean, rstd


# ---- One check per kernel, run by the CPU interpreter tests (tests/unit/kernels) and the GPU suite (tests/gpu) ----


def attention_inputs(b, nq, nkv, s, d, dtype, seed, device="cpu"):
    """q [b, nq, s, d], k, v [b, nkv, s, d], dO like q: drawn on the host, so every device sees the same values."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, nq, s, d, generator=g).to(dtype)
    k = torch.randn(b, nkv, s, d, generator=g).to(dtype)
    v = torch.randn(b, nkv, s, d, generator=g).to(dtype)
    do = torch.randn(b, nq, s, d, generator=g).to(dtype)
    return tuple(t.to(device) for t in (q, k, v, do))


def within(errors: dict[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
    """Assert every (error, tolerance) of ``errors`` (output name -> pair) holds; return them for the record."""
    for name, (err, tol) in errors.items():
        assert err <= tol, f"{name}: relative error {err:.3e} > tolerance {tol:.0e}"
    return errors


def check_attention(ta, b, nq, nkv, s, d, causal, dtype, seed, device="cpu") -> dict[str, tuple[float, float]]:
    """Forward (o, lse) and backward (dq, dk, dv) of ``ta`` (megatron.kernels.triton_attention, its _alloc
    poisoned with nan_alloc) against the float64 reference, within TOL[dtype]; output -> (error, tolerance)."""
    import math

    q, k, v, do = attention_inputs(b, nq, nkv, s, d, dtype, seed, device)
    scale = 1.0 / math.sqrt(d)
    o, lse = ta.attention_forward(q, k, v, causal, scale)
    dq, dk, dv = ta.attention_backward(do, q, k, v, o, lse, causal, scale)
    for t in (o, lse, dq, dk, dv):
        assert not t.isnan().any(), "an output element was never written (still NaN poison)"
    assert o.dtype == dq.dtype == dk.dtype == dv.dtype == dtype and lse.dtype == torch.float32

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    o_ref, lse_ref = attention_ref(q64, k64, v64, causal, scale)
    o_ref.backward(do.double())
    tol = TOL[dtype]
    floor = 0.1 * do.double().pow(2).mean().sqrt().item()  # see rel_err: a tenth of dO's RMS
    return within({"o": (rel_err(o, o_ref), tol),
                    "lse": (rel_err(lse, lse_ref), 1e-5),  # fp32 statistics whatever the input dtype
                    "dq": (rel_err(dq, q64.grad, floor), tol),
                    "dk": (rel_err(dk, k64.grad, floor), tol),
                    "dv": (rel_err(dv, v64.grad, floor), tol)})


def check_norm(tn, shape, rms, bias, dtype, eps, device="cpu") -> dict[str, tuple[float, float]]:
    """norm_forward / norm_backward of ``tn`` (megatron.kernels.triton_norms, _alloc poisoned) against float64;
    output -> (error, tolerance)."""
    g = torch.Generator().manual_seed(sum(shape))
    cols = shape[-1]
    # An offset mean (5) next to unit spread: catches a variance computed as E[x^2] - E[x]^2.
    x = (torch.randn(shape, generator=g) * 2 + 5).to(dtype).to(device)
    w = (1 + 0.5 * torch.randn(cols, generator=g)).to(dtype).to(device)
    b = torch.randn(cols, generator=g).to(dtype).to(device) if bias else None
    dy = torch.randn(shape, generator=g).to(dtype).to(device)

    y, mean, rstd = tn.norm_forward(x, w, b, eps, rms)
    dx, dw, db = tn.norm_backward(dy, x, w, mean, rstd, bias, rms)
    for t in (y, mean, rstd, dx, dw) + ((db,) if bias else ()):
        assert not t.isnan().any(), "an output element was never written (still NaN poison)"
    assert y.shape == x.shape and dx.shape == x.shape and y.dtype == dx.dtype == dw.dtype == dtype

    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_() if bias else None
    y_ref, mean_ref, rstd_ref = layer_norm_ref(x64, w64, b64, eps, rms)
    y_ref.backward(dy.double())
    tol = TOL[dtype]
    errors = {"y": (rel_err(y, y_ref), tol),
              "rstd": (rel_err(rstd, rstd_ref.detach().reshape(-1)), 1e-5)}  # fp32 statistics for every dtype
    if not rms:
        errors["mean"] = (rel_err(mean, mean_ref.detach().reshape(-1)), 1e-5)
    errors["dx"] = (rel_err(dx, x64.grad), tol)
    errors["dw"] = (rel_err(dw, w64.grad), tol)
    if bias:
        errors["db"] = (rel_err(db, b64.grad), tol)
    return within(errors)
