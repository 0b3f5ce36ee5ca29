"""DeepSpeed's top-1, top-2 and top-k gates (deepspeed/moe/sharded_moe.py top1gating / top2gating / topkgating), as
routes.

The arithmetic is DeepSpeed's, step for step, so a run moved here routes, drops and balances as it did: the capacity
``max(ceil(S / E x factor x k), min_capacity)`` (float32, as there), top-1's random token selection among an expert's
over-capacity tokens, top-2's second expert from the Gumbel-perturbed logits queued after every first choice, the
load-balancing loss ``E x sum_e(mean gate_e x fraction routed first to e)``. What differs is only where the random
numbers come from (megatron/core/moe/draws.py: the token's identity, not the device's RNG stream) and the form of the
result: per-route expert, slot and weight ([k, S]) instead of the dense [S, E, C] combine tensor (the same numbers;
tests/unit/test_moe_gating.py compares the two with DeepSpeed's own functions).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron.core import comm
from megatron.core.parallel_state import GroupInfo


@dataclass
class Routing:
    """Where each of the S tokens goes, for its k routes."""

    l_aux: torch.Tensor
    """The load-balancing loss, a float32 scalar (before --moe-loss-coeff)."""
    capacity: int
    """Slots per expert (the same on every rank of the expert-parallel group)."""
    experts: torch.Tensor
    """[k, S] int64: the expert of each route, -1 where capacity dropped it."""
    locations: torch.Tensor
    """[k, S] int64: the route's slot in its expert's buffer (0 where dropped)."""
    weights: torch.Tensor
    """[k, S] float32: the route's combine weight (0 where dropped)."""
    counts: torch.Tensor
    """[E] int64: routes chosen per expert before capacity (DeepSpeed's exp_counts)."""


def capacity(num_tokens: int, num_experts: int, factor: float, min_capacity: int) -> int:
    """DeepSpeed's _capacity: ceil(tokens / experts x factor) in float32, at least ``min_capacity``."""
    cap = torch.ceil((num_tokens / num_experts) * torch.tensor(factor)).to(torch.int64)
    return int(torch.maximum(cap, torch.tensor(min_capacity, dtype=torch.int64)))


def _busiest(counts: torch.Tensor, ep: GroupInfo | None) -> int:
    """No token dropping: the largest count of any expert on any rank of the expert-parallel group (the all-to-all
    needs one buffer size on every rank)."""
    most = counts.max().reshape(1)
    if ep is not None and ep.size > 1:
        comm.all_reduce(most, ep.group, op=comm.dist.ReduceOp.MAX)
    return int(most)


def top1(logits: torch.Tensor, factor: float, min_capacity: int, drop_tokens: bool = True,
         rts: torch.Tensor | None = None, ep: GroupInfo | None = None) -> Routing:
    """logits [S, E] float32 -> one route per token. ``rts``: random token selection's U(0, 1) per token [S]
    (None: no random selection, the tokens torch.topk keeps)."""
    gates = F.softmax(logits, dim=1)  # [S, E]
    num_tokens, num_experts = gates.shape
    cap = capacity(num_tokens, num_experts, factor, min_capacity)
    first = torch.argmax(gates, dim=1)  # [S]
    mask = F.one_hot(first, num_classes=num_experts)  # [S, E] int64
    counts = mask.sum(dim=0)
    if not drop_tokens:
        cap = min(_busiest(counts, ep), num_tokens)
    l_aux = torch.sum(gates.mean(dim=0) * mask.float().mean(dim=0)) * num_experts
    ranked = mask * rts.unsqueeze(1) if rts is not None else mask  # [S, E]
    keep = torch.topk(ranked, k=min(cap, num_tokens), dim=0)[1]  # [C, E]: the tokens each expert keeps
    mask = mask * torch.zeros_like(mask).scatter_(0, keep, 1)
    kept = mask.sum(dim=1) > 0  # [S]
    locations = ((torch.cumsum(mask, dim=0) - 1) * mask).sum(dim=1)  # [S]
    weights = (gates * mask.float()).sum(dim=1)  # [S]: the kept expert's gate value
    experts = torch.where(kept, first, torch.full_like(first, -1))
    return Routing(l_aux, cap, experts.unsqueeze(0), locations.unsqueeze(0), weights.unsqueeze(0), counts)


def top2(logits: torch.Tensor, factor: float, min_capacity: int, drop_tokens: bool = True,
         gumbel: torch.Tensor | None = None, ep: GroupInfo | None = None) -> Routing:
    """logits [S, E] float32 -> two routes per token. ``gumbel``: noise [S, E] added to the logits to draw the
    second expert (None: the second largest gate)."""
    gates = F.softmax(logits, dim=1)  # [S, E]
    num_tokens, num_experts = gates.shape
    first = torch.argmax(gates, dim=1)  # [S]
    mask1 = F.one_hot(first, num_classes=num_experts)  # [S, E] int64
    perturbed = logits + gumbel if gumbel is not None else logits
    second = torch.argmax(perturbed.masked_fill(mask1.bool(), float("-inf")), dim=1)  # [S]
    mask2 = F.one_hot(second, num_classes=num_experts)
    locations1 = torch.cumsum(mask1, dim=0) - 1  # [S, E]
    locations2 = torch.cumsum(mask2, dim=0) - 1 + mask1.sum(dim=0, keepdim=True)  # second choices queue after
    l_aux = torch.mean(gates.mean(dim=0) * mask1.float().mean(dim=0)) * num_experts * num_experts
    counts = (mask1 + mask2).sum(dim=0)
    if drop_tokens:
        cap = capacity(num_tokens, num_experts, factor * 2, min_capacity)
        mask1 = mask1 * torch.lt(locations1, cap)
        mask2 = mask2 * torch.lt(locations2, cap)
    else:
        cap = _busiest(counts, ep)
    gates1 = (gates * mask1.float()).sum(dim=1)  # [S]
    gates2 = (gates * mask2.float()).sum(dim=1)
    denom = torch.clamp(gates1 + gates2, min=torch.finfo(gates.dtype).eps)
    experts = torch.stack([torch.where(mask1.any(dim=1), first, torch.full_like(first, -1)),
                           torch.where(mask2.any(dim=1), second, torch.full_like(second, -1))])  # [2, S]
    locations = torch.stack([(locations1 * mask1).sum(dim=1), (locations2 * mask2).sum(dim=1)])  # [2, S]
    return Routing(l_aux, cap, experts, locations, torch.stack([gates1 / denom, gates2 / denom]), counts)


def topk(logits: torch.Tensor, k: int, factor: float, min_capacity: int, drop_tokens: bool = True,
         ep: GroupInfo | None = None) -> Routing:
    """logits [S, E] float32 -> k routes per token, k > 2 (DeepSpeed's topkgating, drop policy "probs"): the capacity
    is ``ceil(S / E x factor x k)``, an over-full expert keeps its tokens of largest gate value, and each token's kept
    gates are renormalised to sum to 1."""
    gates = F.softmax(logits, dim=1)  # [S, E]
    num_tokens, num_experts = gates.shape
    top_gate, top_idx = torch.topk(gates, k=k, dim=1)  # [S, k]
    mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, top_idx, 1)  # [S, E]
    counts = mask.sum(dim=0)
    l_aux = torch.mean(gates.mean(dim=0) * mask.float().mean(dim=0)) * num_experts * num_experts / k
    if drop_tokens:
        cap = capacity(num_tokens, num_experts, factor * k, min_capacity)
        ranked = torch.zeros_like(gates).scatter(1, top_idx, top_gate)  # [S, E]: the chosen gates, else 0
        keep = torch.topk(ranked, k=min(cap, num_tokens), dim=0, sorted=False)[1]  # [C, E]
        mask &= torch.zeros_like(gates, dtype=torch.bool).scatter_(0, keep, True)
    else:
        cap = _busiest(counts, ep)
    locations = torch.cumsum(mask, dim=0) - 1  # [S, E]
    masked = gates * mask
    masked = masked / torch.clamp(masked.sum(dim=-1, keepdim=True), min=torch.finfo(masked.dtype).eps)
    kept = mask.gather(1, top_idx)  # [S, k]
    experts = torch.where(kept, top_idx, torch.full_like(top_idx, -1))
    return Routing(l_aux, cap, experts.t(), (locations.gather(1, top_idx) * kept).t(), masked.gather(1, top_idx).t(),
                   counts)
