"""The one attention seam the model calls. Backends: torch SDPA (always), Triton, HIP (when built)."""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from megatron.kernels import hip_ops, measure, select


def _torch_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, dropout_p: float,
                     softmax_scale: float | None) -> torch.Tensor:
    nq, nkv = q.shape[1], k.shape[1]
    if nq != nkv:
        # [b, nkv, s, d] -> [b, nq, s, d]: each KV head serves nq // nkv consecutive query heads.
        k = k.repeat_interleave(nq // nkv, dim=1)
        v = v.repeat_interleave(nq // nkv, dim=1)
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal, scale=softmax_scale)


def _unsupported(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> str | None:
    if backend == "hip":
        return hip_ops.attention_unsupported(q, k, v, dropout_p)
    if backend == "triton":
        if not select.available("triton", "attention", q.device)[0]:
            return "triton unavailable here"
        from megatron.kernels import triton_attention  # lazy: triton is optional and slow to import

        return triton_attention.unsupported_reason(q, k, v, dropout_p)
    return None


def dot_product_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Softmax attention. q: [b, nq, s, d]; k, v: [b, nkv, s, d] with nq % nkv == 0 (GQA).

    Returns [b, nq, s, d]. Every backend must give the same result as the torch path within the
    dtype's tolerance; an unsupported shape or dtype falls back to torch.
    """
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    backend = measure.resolve(backend)
    if backend == "auto" and measure.enabled(q.device):
        usable = [b for b in select.PREFERENCE if b == "torch" or (
            select.available(b, "attention", q.device)[0] and _unsupported(b, q, k, v, dropout_p) is None)]
        if len(usable) == 1:
            return _run("torch", q, k, v, causal, dropout_p, scale, softmax_scale)
        key = measure.key_of("attention", (q, k, v), f"causal={int(causal)}")
        thunks = lambda: {b: measure.fwd_bwd(functools.partial(  # noqa: E731
            _run, b, causal=causal, dropout_p=dropout_p, scale=scale, softmax_scale=softmax_scale), q, k, v)
            for b in usable}
        return _run(measure.fastest(key, thunks, q.device), q, k, v, causal, dropout_p, scale, softmax_scale)
    chosen = select.choose("attention", backend, q.device)
    for candidate in select.fallback_order(chosen):
        why = _unsupported(candidate, q, k, v, dropout_p)
        if why is None:
            break
        select.once(f"attention:{candidate}:{why}", f"attention: {candidate} kernel cannot take {why}; falling back")
    return _run(candidate, q, k, v, causal, dropout_p, scale, softmax_scale)


def _run(candidate: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, dropout_p: float,
         scale: float, softmax_scale: float | None) -> torch.Tensor:
    if candidate == "hip":
        return hip_ops.HipFlashAttention.apply(q, k, v, causal, scale)
    if candidate == "triton":
        from megatron.kernels import triton_attention  # lazy: triton is optional and slow to import

        return triton_attention.TritonFlashAttention.apply(q, k, v, causal, scale)
    return _torch_attention(q, k, v, causal, dropout_p, softmax_scale)
