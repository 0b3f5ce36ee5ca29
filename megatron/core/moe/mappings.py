"""The expert-parallel all-to-all and the split of the capacity buffer over TP, as autograd functions.

    all_to_all        fwd all-to-all over EP (dim 0 in EP chunks)   bwd the same all-to-all
    split_capacity    fwd this TP rank's slice of dim 1             bwd all-gather dim 1 over TP
    gather_capacity   fwd all-gather dim 1 over TP                  bwd this TP rank's slice

The buffer [E, C, h] is the same on every TP rank (the gate and the dispatch run on replicated tokens): each TP rank
sends only its 1/TP of the slots through the all-to-all, as upstream's drop_tokens / gather_tokens, and its experts
run on those (whole experts, or with --enable-expert-tensor-parallelism TP-split ones that gather them again inside,
megatron/model/moe_experts.py); then the slots are gathered back for the combine.
Collectives go through megatron.core.comm (device tensors only).
"""

from __future__ import annotations

import torch

from megatron.core import comm
from megatron.core.parallel_state import GroupInfo


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return comm.all_to_all(x, g.group)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_to_all(grad, ctx.g.group), None


class _SplitCapacity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return x.chunk(g.size, dim=1)[g.rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return comm.all_gather(grad, ctx.g.group, dim=1), None


class _GatherCapacity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return comm.all_gather(x, g.group, dim=1)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.g.size, dim=1)[ctx.g.rank].contiguous(), None


def all_to_all(x: torch.Tensor, ep: GroupInfo) -> torch.Tensor:
    """[E, c, h]: chunk j of dim 0 (experts j*E/ep ...) goes to EP rank j; returns [E, c, h] whose chunk i came from
    EP rank i (this rank's experts, rank i's tokens). Identity for one rank."""
    return x if ep.size == 1 else _AllToAll.apply(x, ep)


def split_capacity(x: torch.Tensor, tp: GroupInfo) -> torch.Tensor:
    """[E, C, h] -> this TP rank's [E, C/tp, h]."""
    return x if tp.size == 1 else _SplitCapacity.apply(x, tp)


def gather_capacity(x: torch.Tensor, tp: GroupInfo) -> torch.Tensor:
    """[E, C/tp, h] -> [E, C, h] on every TP rank."""
    return x if tp.size == 1 else _GatherCapacity.apply(x, tp)
