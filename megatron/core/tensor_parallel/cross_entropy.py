"""Cross entropy over vocab-parallel logits, without ever gathering the full vocab on one rank."""

from __future__ import annotations

import torch

from megatron.core import comm
from megatron.core.parallel_state import GroupInfo


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, g: GroupInfo):
        # logits: [..., V/tp] (this rank's vocab slice); target: [...] global ids.
        logits = logits.float()
        logits_max = logits.max(dim=-1)[0]
        if g.size > 1:
            comm.all_reduce(logits_max, g.group, op=comm.dist.ReduceOp.MAX)
        shifted = logits - logits_max.unsqueeze(-1)

        per_rank = logits.shape[-1]
        start = g.rank * per_rank
        outside = (target < start) | (target >= start + per_rank)
        local_target = (target - start).masked_fill(outside, 0)
        predicted = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)

        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        if g.size > 1:
            # One all-reduce for both: [2, ...]
            both = torch.stack([predicted, sum_exp])
            comm.all_reduce(both, g.group)
            predicted, sum_exp = both[0], both[1]
        loss = sum_exp.log() - predicted

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax
        # d loss / d logit = softmax - onehot(target), only on the rank that owns the target id.
        onehot = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -onehot.unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp: GroupInfo) -> torch.Tensor:
    """Per-token loss (fp32) of shape ``target.shape`` from vocab-parallel ``logits`` [..., V/tp]."""
    return _VocabParallelCrossEntropy.apply(logits, target, tp)
