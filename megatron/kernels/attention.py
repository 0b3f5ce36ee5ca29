"""The one attention seam the model calls. Backends: torch SDPA (always), Triton, HIP (when built)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
    nq, nkv = q.shape[1], k.shape[1]
    if nq != nkv:
        # [b, nkv, s, d] -> [b, nq, s, d]: each KV head serves nq // nkv consecutive query heads.
        k = k.repeat_interleave(nq // nkv, dim=1)
        v = v.repeat_interleave(nq // nkv, dim=1)
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal, scale=softmax_scale)
