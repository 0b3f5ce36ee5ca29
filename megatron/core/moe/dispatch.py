"""Tokens into the experts' capacity buffer and back, as gathers over the routes (no dense [S, E, C] one-hots).

A kept route (token s, expert e, slot c) owns row ``e * C + c`` of the flat [E * C, h] buffer; dropped routes point at
one extra scratch row that nothing reads back. Dispatch inverts that map and gathers the tokens (a padding row fills
the empty slots); combine gathers each route's expert output and sums the routes weighted by the gate, in fp32.
Both are gathers, so autograd's backward is a scatter-add: the gradient of a token is the weighted sum of its routes'.
"""

from __future__ import annotations

import torch

from megatron.core.moe.gating import Routing


def route_slots(routing: Routing, num_experts: int, slots_per_expert: int) -> torch.Tensor:
    """[k, S] int64: each route's row in the [E * slots_per_expert + 1] buffer (the last row: dropped routes).
    ``slots_per_expert`` >= routing.capacity (a buffer padded to split evenly over TP)."""
    flat = routing.experts * slots_per_expert + routing.locations
    return torch.where(routing.experts >= 0, flat, torch.full_like(flat, num_experts * slots_per_expert))


def dispatch(tokens: torch.Tensor, slots: torch.Tensor, num_experts: int, slots_per_expert: int) -> torch.Tensor:
    """tokens [S, h], slots [k, S] -> the experts' buffer [E, C, h] (C = slots_per_expert; empty slots are 0)."""
    num_tokens, hidden = tokens.shape
    rows = num_experts * slots_per_expert
    source = torch.full((rows + 1,), num_tokens, dtype=torch.long, device=tokens.device)  # row -> token (S: pad)
    token_ids = torch.arange(num_tokens, device=tokens.device).expand_as(slots)  # [k, S]
    source.scatter_(0, slots.reshape(-1), token_ids.reshape(-1))  # the scratch row's winner is never read
    padded = torch.cat([tokens, tokens.new_zeros(1, hidden)])  # [S + 1, h]
    return padded.index_select(0, source[:rows]).view(num_experts, slots_per_expert, hidden)


def combine(expert_out: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """expert_out [E, C, h], slots [k, S], weights [k, S] float32 -> [S, h] in expert_out's dtype: each token's
    routes weighted by the gate and summed in fp32."""
    hidden = expert_out.shape[-1]
    k, num_tokens = slots.shape
    padded = torch.cat([expert_out.reshape(-1, hidden), expert_out.new_zeros(1, hidden)])  # [E * C + 1, h]
    routed = padded.index_select(0, slots.reshape(-1)).view(k, num_tokens, hidden)  # [k, S, h]
    return (routed * weights.unsqueeze(-1)).sum(dim=0).to(expert_out.dtype)
