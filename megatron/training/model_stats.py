"""--log-params-norm and --log-optimizer-states-to-tensorboard: the numbers upstream Megatron-DeepSpeed logs.

Both are collectives (over the model-parallel group; the optimizer states also over DP when ZeRO partitions them),
so every rank calls them on the same iterations.
"""

from __future__ import annotations

import torch

from megatron.core import comm
from megatron.core.parallel_state import ParallelState
from megatron.optim.optimizer import is_expert_param

# Upstream's names, in its order; "_l2"/"_l1" are norms over every element, "_abs_max" the largest |value|.
OPTIMIZER_STATS = ("variance_l2", "variance_sqrt_l2", "momentum_l2", "weight_l2", "variance_l1", "variance_sqrt_l1",
                   "momentum_l1", "weight_l1", "variance_abs_max", "variance_sqrt_abs_max", "momentum_abs_max",
                   "weight_abs_max")


def _counted_params(module: torch.nn.Module, pstate: ParallelState):
    """Each parameter of the model once: TP-replicated ones on TP rank 0 only, and a pipeline's tied embedding
    on its first stage only (DeepSpeed keeps a copy on the last stage too)."""
    tied = set()
    if pstate.pp.rank != 0 and hasattr(module, "tied_modules"):
        tied = {id(p) for p in module.tied_modules.parameters()}
    for p in module.parameters():
        if id(p) in tied:
            continue
        if pstate.tp.rank == 0 or getattr(p, "tensor_model_parallel", False):
            yield p


def params_norm(module: torch.nn.Module, pstate: ParallelState) -> float:
    """L2 norm of all model weights (as upstream's calc_params_l2_norm: the weights the model holds, in float64
    here). Under ZeRO-3 each rank holds a DP partition (``ds_tensor``), so the sum also runs over DP; experts'
    weights are summed over the expert-parallel ranks (each holds its own)."""
    sq, experts = torch.zeros(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
    partitioned = False
    for p in _counted_params(module, pstate):
        data = getattr(p, "ds_tensor", None)
        partitioned |= data is not None
        data = p.data if data is None else data
        if is_expert_param(p):
            experts += data.detach().double().pow(2).sum().cpu()
        else:
            sq += data.detach().double().pow(2).sum().cpu()
    if pstate.ep.size > 1:
        experts = torch.tensor(comm.reduce_host([experts], pstate.ep.group), dtype=torch.float64)
    sq += experts
    groups = [pstate.mp] + ([pstate.dp] if partitioned else [])
    for g in groups:
        if g.size > 1:
            sq = torch.tensor(comm.reduce_host([sq], g.group), dtype=torch.float64)
    return float(sq.sqrt())


def _adam_states(optimizer) -> list:
    """(weight, state) of every tensor Adam has stepped, from the torch optimizer inside DeepSpeed's ZeRO / bf16
    wrappers (``.optimizer``). Its ``state`` is read directly: ZeRO-3 empties ``param_groups`` between steps
    (upstream's walk over ``param_groups`` then reports zeros); the keys are the fp32 weights the update uses."""
    opt = optimizer
    while not isinstance(opt, torch.optim.Optimizer) and hasattr(opt, "optimizer"):
        opt = opt.optimizer
    return [(p, st) for p, st in opt.state.items() if "exp_avg" in st and "exp_avg_sq" in st]


def optimizer_stats(optimizer, pstate: ParallelState, zero_stage: int) -> dict[str, float]:
    """Upstream's twelve optimizer-state statistics. Sums run over DP when ZeRO partitions the states, and over
    TP and PP as upstream's: a TP-replicated tensor counts once per TP rank, and a pipeline's tied embedding once
    per stage holding it (each has its own Adam state), so weight_l2 exceeds params_norm there, as upstream's."""
    sums = torch.zeros(8, dtype=torch.float64)
    maxes = torch.zeros(4, dtype=torch.float64)
    for p, st in _adam_states(optimizer):
        if st["exp_avg"].numel() == 0:
            continue  # a rank's empty ZeRO partition
        v, m, w = st["exp_avg_sq"].double(), st["exp_avg"].double(), p.detach().double()
        vs = v.sqrt()
        sums += torch.stack([v.pow(2).sum(), vs.pow(2).sum(), m.pow(2).sum(), w.pow(2).sum(),
                             v.abs().sum(), vs.abs().sum(), m.abs().sum(), w.abs().sum()]).cpu()
        maxes = torch.maximum(maxes, torch.stack([v.abs().max(), vs.abs().max(), m.abs().max(),
                                                  w.abs().max()]).cpu())
    groups = ([pstate.dp] if zero_stage > 0 else []) + [pstate.tp, pstate.pp]
    for g in groups:
        if g.size > 1:
            sums = torch.tensor(comm.reduce_host(sums.tolist(), g.group), dtype=torch.float64)
            maxes = torch.tensor(comm.reduce_host(maxes.tolist(), g.group, op=torch.distributed.ReduceOp.MAX),
                                 dtype=torch.float64)
    values = [sums[0].sqrt(), sums[1].sqrt(), sums[2].sqrt(), sums[3].sqrt(), *sums[4:], *maxes]
    return {name: float(v) for name, v in zip(OPTIMIZER_STATS, values, strict=True)}
