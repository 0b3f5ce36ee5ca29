"""The gate's random numbers as pure functions of (seed, layer, token): the same draws whatever the layout.

DeepSpeed draws random token selection and top-2's Gumbel noise from the device's RNG stream, so they depend on
how many tokens each rank holds and on what ran before. Here every number comes from a counter-based hash of the
run's seed, the layer, the token's sample index in the data set and its position in the sequence (and the expert):
one process, any EP/TP layout and a recompute draw the same numbers for the same token.

The hash is Wellons' ``lowbias32`` (a bijective 32-bit integer mixer) computed in int64 without overflow, so it
gives the same bits on every device.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
_C1, _C2 = 0x7FEB352D, 0x846CA68B
_RTS, _GUMBEL = 0x52545331, 0x47554D42  # stream tags: "RTS1", "GUMB"


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32), with no int64 intermediate above 2**48."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & _M32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, _C1)
    x = x ^ (x >> 15)
    x = _mul32(x, _C2)
    return x ^ (x >> 16)


def _fold(h: torch.Tensor, v) -> torch.Tensor:
    """Absorb ``v`` (a non-negative int or int64 tensor below 2**63) into the running hash ``h``."""
    return mix32(mix32(h ^ (v & _M32)) ^ ((v >> 32) & _M32))


def token_keys(sample_index: torch.Tensor, seq_length: int, seed: int) -> torch.Tensor:
    """One 32-bit key per token, [s, b] (the gate's token order): from the run's seed, the sample's index [b]
    (int64) and the position in the sequence."""
    h = mix32(torch.full((1, 1), seed & _M32, dtype=torch.int64, device=sample_index.device))
    h = _fold(h, sample_index.to(torch.int64).reshape(1, -1))  # [1, b]
    pos = torch.arange(seq_length, dtype=torch.int64, device=sample_index.device).reshape(-1, 1)
    return _fold(h, pos)  # [s, b]


def _unit(h: torch.Tensor) -> torch.Tensor:
    """32-bit hashes -> float32 in (0, 1): 24 bits, each value exact, never 0 or 1."""
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def rts_uniform(keys: torch.Tensor, layer: int) -> torch.Tensor:
    """Random token selection's U(0, 1) for each token of one layer: keys [S] -> [S] float32."""
    return _unit(_fold(_fold(keys, _RTS), layer))


def gumbel(keys: torch.Tensor, layer: int, num_experts: int) -> torch.Tensor:
    """Gumbel(0, 1) noise per (token, expert) of one layer: keys [S] -> [S, E] float32."""
    h = _fold(_fold(keys, _GUMBEL), layer).unsqueeze(1)  # [S, 1]
    experts = torch.arange(num_experts, dtype=torch.int64, device=keys.device).unsqueeze(0)  # [1, E]
    u = _unit(_fold(h, experts))  # [S, E]
    return -torch.log(-torch.log(u))
