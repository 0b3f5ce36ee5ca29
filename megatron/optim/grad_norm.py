"""The global gradient norm over one model replica (TP x PP), as Megatron's clip_grad_norm computes it."""

from __future__ import annotations

import torch

from megatron.core import comm
from megatron.optim.optimizer import is_expert_param


def grad_norm(params, pstate) -> torch.Tensor:
    """Global L2 norm of the model's gradients: TP-sharded parameters count on every TP rank,
    replicated ones once (TP rank 0), summed over the TP x PP ranks of one model replica. Experts' parameters
    (megatron/optim/optimizer.py is_expert_param) are summed over the expert-parallel ranks too: each holds its own.

    Returns a one-element float64 tensor where the gradients live: no host sync here (the log reads it)."""
    params = [p for p in params
              if p.grad is not None and (pstate.tp.rank == 0 or getattr(p, "tensor_model_parallel", False))]
    ep = getattr(pstate, "ep", None)
    split = ep is not None and ep.size > 1
    reduce = pstate.mp.size > 1
    device = params[0].grad.device if params else (comm.collective_device(pstate.mp.group) if reduce else "cpu")
    sq = torch.zeros(1, dtype=torch.float64, device=device)
    experts = torch.zeros_like(sq)
    for p in params:  # float64 partial sums in parameter order, as before: the same bits on CPU
        if split and is_expert_param(p):
            experts += p.grad.detach().double().pow(2).sum()
        else:
            sq += p.grad.detach().double().pow(2).sum()
    if split:
        sq += comm.all_reduce(experts.to(comm.collective_device(ep.group)), ep.group).to(sq.device)
    if reduce:
        sq = comm.all_reduce(sq.to(comm.collective_device(pstate.mp.group)), pstate.mp.group)
    return sq.sqrt()
