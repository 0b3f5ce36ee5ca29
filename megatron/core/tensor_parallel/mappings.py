"""Autograd region functions that move activations in and out of the tensor-parallel region.

Each forward collective is paired with its adjoint in backward (Megatron's vocabulary):

    copy_to        fwd identity            bwd all-reduce     (entering a column-parallel layer)
    reduce_from    fwd all-reduce          bwd identity       (leaving a row-parallel layer)
    scatter_to     fwd split last dim      bwd all-gather
    gather_from    fwd all-gather last dim bwd split
    Sequence parallel, on the sequence dim 0 of [s, b, h]:
    scatter_to_sp  fwd split dim 0         bwd all-gather
    gather_from_sp fwd all-gather dim 0    bwd reduce-scatter
    reduce_scatter_to_sp fwd reduce-scatter bwd all-gather

Every function takes the TP ``GroupInfo`` explicitly and is the identity when its size is 1.
"""

from __future__ import annotations

import torch

from megatron.core import comm
from megatron.core.parallel_state import GroupInfo


def _split(x: torch.Tensor, g: GroupInfo, dim: int) -> torch.Tensor:
    return x.chunk(g.size, dim=dim)[g.rank].contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return x

    @staticmethod
    def backward(ctx, grad):
        return comm.all_reduce(grad.contiguous().clone(), ctx.g.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g):
        return comm.all_reduce(x.contiguous().clone(), g.group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return _split(x, g, -1)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_gather(grad, ctx.g.group, dim=grad.dim() - 1), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return comm.all_gather(x, g.group, dim=x.dim() - 1)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.g, -1), None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return _split(x, g, 0)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_gather(grad, ctx.g.group), None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g, reduce_grad):
        ctx.g, ctx.reduce_grad = g, reduce_grad
        return comm.all_gather(x, g.group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce_grad:
            return comm.reduce_scatter(grad, ctx.g.group), None, None
        return _split(grad, ctx.g, 0), None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return comm.reduce_scatter(x, g.group)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_gather(grad, ctx.g.group), None


def copy_to_tensor_model_parallel_region(x: torch.Tensor, g: GroupInfo) -> torch.Tensor:
    return x if g.size == 1 else _CopyToTP.apply(x, g)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, g: GroupInfo) -> torch.Tensor:
    return x if g.size == 1 else _ReduceFromTP.apply(x, g)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, g: GroupInfo) -> torch.Tensor:
    return x if g.size == 1 else _ScatterToTP.apply(x, g)


def gather_from_tensor_model_parallel_region(x: torch.Tensor, g: GroupInfo) -> torch.Tensor:
    return x if g.size == 1 else _GatherFromTP.apply(x, g)


def scatter_to_sequence_parallel_region(x: torch.Tensor, g: GroupInfo) -> torch.Tensor:
    return x if g.size == 1 else _ScatterToSP.apply(x, g)


def gather_from_sequence_parallel_region(x: torch.Tensor, g: GroupInfo, reduce_grad: bool = True) -> torch.Tensor:
    """All-gather [s/tp, b, h] -> [s, b, h]. ``reduce_grad``: the consumer is TP-sharded (a column-parallel
    matmul), so each rank holds a partial gradient and backward must reduce-scatter, not just split."""
    return x if g.size == 1 else _GatherFromSP.apply(x, g, reduce_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, g: GroupInfo) -> torch.Tensor:
    return x if g.size == 1 else _ReduceScatterToSP.apply(x, g)
