"""Rotary position embeddings (RoFormer), in the rotate-half layout used by Megatron and HF Llama.

Partial rotary (--rotary-percent < 1, GPT-NeoX's rotary_pct): only the first ``rotary_dim`` channels of each
head rotate, with frequencies computed over ``rotary_dim``; the rest pass through unchanged (upstream's
apply_rotary_pos_emb, HF GPT-NeoX's rotary_ndims).
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=16)
def rotary_cos_sin(seq_len: int, dim: int, base: float, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [s, 1, 1, dim], computed in fp32 then cast.

    Cached per (seq, dim, base, device, dtype): every layer of every step asks for the same table, and
    rebuilding it cost ~10 small kernel launches per layer call (host gaps were 13% of the H100 step).
    The cached tensors never require grad and are only read.
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    t = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)  # [s, dim/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]  # [s, 1, 1, dim]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [s, b, n, d]; cos, sin: [s, 1, 1, r] with r <= d (r < d: partial rotary, the last d - r pass)."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rot, keep = x[..., :r], x[..., r:]
    return torch.cat([rot * cos + _rotate_half(rot) * sin, keep], dim=-1)
