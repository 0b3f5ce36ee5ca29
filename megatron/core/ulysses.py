"""DeepSpeed-Ulysses sequence parallelism (``--ds-sequence-parallel-size``): the two all-to-alls around attention,
the whole-sequence loss mean, and each SP rank's slice of a micro-batch.

Every SP rank holds 1/SP of the sequence everywhere except inside attention. There one all-to-all turns
[s/SP, b, heads, ...] into [s, b, heads/SP, ...] (every rank then attends over the whole sequence with its own
heads) and a second turns the context back. Both go through ``megatron.core.comm`` (device tensors, counted by
its byte observers); the backward of each is the other. Same facts as DeepSpeed's
``deepspeed.sequence.layer.DistributedAttention``, our own code so that the fused QKV travels in one message and
the kernel seam (torch | Triton | HIP) stays unchanged inside.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from megatron.core import comm
from megatron.core.parallel_state import GroupInfo


def _seq_to_heads(x: torch.Tensor, ulysses: GroupInfo) -> torch.Tensor:
    """[s/SP, b, n, *rest] -> [s, b, n/SP, *rest]: rank j sends head chunk k to rank k, receives sequence chunks."""
    n = ulysses.size
    s_loc, b, heads = x.shape[:3]
    rest = tuple(x.shape[3:])
    send = x.reshape(s_loc, b, n, heads // n, *rest).movedim(2, 0)  # [SP, s/SP, b, n/SP, *rest]
    recv = comm.all_to_all(send, ulysses.group)  # chunk j came from rank j: sequence chunk j
    return recv.reshape(n * s_loc, b, heads // n, *rest)


def _heads_to_seq(x: torch.Tensor, ulysses: GroupInfo) -> torch.Tensor:
    """[s, b, n/SP, *rest] -> [s/SP, b, n, *rest]: the inverse of ``_seq_to_heads``."""
    n = ulysses.size
    s, b, h_loc = x.shape[:3]
    rest = tuple(x.shape[3:])
    send = x.reshape(n, s // n, b, h_loc, *rest)  # chunk j: sequence chunk j, for rank j
    recv = comm.all_to_all(send, ulysses.group)  # [SP, s/SP, b, n/SP, *rest]: chunk j holds rank j's heads
    return recv.movedim(0, 2).reshape(s // n, b, n * h_loc, *rest)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, ulysses: GroupInfo) -> torch.Tensor:
        ctx.ulysses = ulysses
        return _seq_to_heads(x, ulysses)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _heads_to_seq(grad, ctx.ulysses), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, ulysses: GroupInfo) -> torch.Tensor:
        ctx.ulysses = ulysses
        return _heads_to_seq(x, ulysses)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _seq_to_heads(grad, ctx.ulysses), None


def seq_to_heads(x: torch.Tensor, ulysses: GroupInfo) -> torch.Tensor:
    """Sequence-sharded [s/SP, b, n, ...] -> head-sharded [s, b, n/SP, ...] (identity when SP = 1)."""
    return x if ulysses.size == 1 else _SeqToHeads.apply(x, ulysses)


def heads_to_seq(x: torch.Tensor, ulysses: GroupInfo) -> torch.Tensor:
    """Head-sharded [s, b, n/SP, ...] -> sequence-sharded [s/SP, b, n, ...] (identity when SP = 1)."""
    return x if ulysses.size == 1 else _HeadsToSeq.apply(x, ulysses)


class _SumOverSequence(torch.autograd.Function):
    """Forward: all-reduce (sum) over the SP group. Backward: identity (times ``grad_scale``), because each SP
    rank's loss only depends on its own tokens and DeepSpeed sums the SP ranks' gradients (it divides by DP
    alone), except where it averages over SP x DP (ZeRO-3's reduce-scatter): there ``grad_scale`` is SP."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, ulysses: GroupInfo, grad_scale: float) -> torch.Tensor:
        ctx.grad_scale = grad_scale
        out = t.detach().to(comm.collective_device(ulysses.group)).clone()
        return comm.all_reduce(out, ulysses.group).to(t.device)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (grad if ctx.grad_scale == 1.0 else grad * ctx.grad_scale), None, None


def sequence_mean(losses: torch.Tensor, mask: torch.Tensor | None, ulysses: GroupInfo,
                  grad_scale: float = 1.0) -> torch.Tensor:
    """Mean of the per-token ``losses`` [b, s/SP] (weighted by ``mask``) over the whole sequence: every SP rank
    returns the same value, and the sum of their gradients is the gradient of that mean (times
    ``grad_scale``, see ``_SumOverSequence``)."""
    losses = losses.float()
    if mask is None:
        num, den = losses.sum(), torch.tensor(float(losses.numel()), device=losses.device)
    else:
        mask = mask.float()
        num, den = (losses * mask).sum(), mask.sum()
    if ulysses.size == 1:
        return num / den.clamp(min=1.0)
    both = _SumOverSequence.apply(torch.stack([num, den.detach()]), ulysses, grad_scale)  # one message, both sums
    return both[0] / both[1].clamp(min=1.0)


def slice_batch(batch: dict, ulysses: GroupInfo) -> dict:
    """This SP rank's part of a micro-batch loaded whole by every rank of the group.

    ``text`` [b, s+1] -> tokens [j*c, (j+1)*c] inclusive (c = s/SP): the rank's c inputs and their c labels.
    Per-position tensors [b, s] (``loss_mask``) -> columns [j*c, (j+1)*c)."""
    if ulysses.size == 1:
        return batch
    s = batch["text"].shape[1] - 1
    c, j = s // ulysses.size, ulysses.rank
    out = {}
    for key, v in batch.items():
        if key == "text":
            out[key] = v[:, j * c:(j + 1) * c + 1]
        elif isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[1] == s:
            out[key] = v[:, j * c:(j + 1) * c]
        else:
            out[key] = v
    return out


def sequence_slices(batches: Iterator[dict], ulysses: GroupInfo) -> Iterator[dict]:
    """``slice_batch`` over a micro-batch iterator (the data loader of every SP rank yields the same batches)."""
    if ulysses.size == 1:
        yield from batches
        return
    for batch in batches:
        yield slice_batch(batch, ulysses)


def position_ids(s_local: int, ulysses: GroupInfo, device) -> torch.Tensor:
    """Global positions [1, s/SP] of this rank's tokens (learned position embeddings)."""
    return (torch.arange(s_local, device=device) + ulysses.rank * s_local).unsqueeze(0)
