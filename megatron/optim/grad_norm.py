"""The global gradient norm over one model replica (TP x PP), as Megatron's clip_grad_norm computes it."""

from __future__ import annotations

import torch

from megatron.core import comm


def grad_norm(params, pstate) -> torch.Tensor:
    """Global L2 norm of the model's gradients: TP-sharded parameters count on every TP rank,
    replicated ones once (TP rank 0), summed over the TP x PP ranks of one model replica.

    Returns a one-element float64 tensor where the gradients live: no host sync here (the log reads it)."""
    grads = [p.grad.detach() for p in params
             if p.grad is not None and (pstate.tp.rank == 0 or getattr(p, "tensor_model_parallel", False))]
    reduce = pstate.mp.size > 1
    device = grads[0].device if grads else (comm.collective_device(pstate.mp.group) if reduce else "cpu")
    sq = torch.zeros(1, dtype=torch.float64, device=device)
    for g in grads:  # float64 partial sums in parameter order, as before: the same bits on CPU
        sq += g.double().pow(2).sum()
    if reduce:
        sq = comm.all_reduce(sq.to(comm.collective_device(pstate.mp.group)), pstate.mp.group)
    return sq.sqrt()
