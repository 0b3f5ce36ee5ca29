"""DeepSpeed ZeRO-1/2 optimizer files (``zero_pp_rank_D_mp_rank_XX_optim_states.pt``) for upstream Megatron-DeepSpeed
without pipeline, from full weights and Adam moments, laid out as DeepSpeed 0.19's stage_1_and_2 builds them:

* upstream's param groups (megatron/optimizer ``get_param_groups``: weights with 2+ dims "wd_no_scale_lr", the 1-D
  ones "no_wd_no_scale_lr", each in module order), with ``--create-moe-param-group`` the experts moved out into
  groups of their own ("ep_size_E": the weights, then the 1-D ones), holding this EP rank's experts;
* each group flattened in order, padded at the end to a multiple of 2 x its partition count (the DP size; the
  experts' replica count for expert groups), split evenly: DP rank d holds partition d (experts: d // EP);
* per partition: the fp32 master slice, Adam's ``exp_avg``/``exp_avg_sq``/``step`` as torch Adam's state of one
  flat parameter, and ``param_slice_mappings`` (where each parameter's piece sits in it).
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch
from deepspeed.runtime.fp16.loss_scaler import LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

from megatron.checkpointing.ds_layout.files import ep_coords
from megatron.errors import CheckpointError
from megatron.model.param_names import expert_index, expert_layer_key, upstream_flat, upstream_order, with_expert


def scheduler_lr(sd: dict) -> float:
    """The lr upstream's OptimizerParamScheduler gives at its state ``sd`` (samples-based, as it saves)."""
    n, warm, decay = sd["num_steps"], sd["lr_warmup_steps"], sd["lr_decay_steps"]
    max_lr, min_lr = sd["max_lr"], sd["min_lr"]
    if warm > 0 and n <= warm:
        return max_lr * n / warm
    if sd["lr_decay_style"] == "constant":
        return max_lr
    if n > decay:
        return min_lr
    ratio = (n - warm) / (decay - warm)
    coeff = {"cosine": 0.5 * (math.cos(math.pi * ratio) + 1.0), "linear": 1.0 - ratio}.get(sd["lr_decay_style"])
    if coeff is None:
        raise CheckpointError(f"--lr-decay-style {sd['lr_decay_style']}: its lr is not written for upstream")
    return min_lr + coeff * (max_lr - min_lr)


def groups_for(shards: dict[str, torch.Tensor], ep: int, ep_rank: int, per_layer: dict[str, int]) -> list[tuple]:
    """Upstream's param groups of one DP rank: [(group name, wd_mult, is_moe, [(flat upstream name, our name)])]; the
    expert groups hold EP rank ``ep_rank``'s experts under their local index."""
    dense_wd, dense_no, exp_wd, exp_no = [], [], [], []
    for name in sorted(shards, key=upstream_order):
        if (g := expert_index(name)) is not None:
            local = per_layer[expert_layer_key(name)] // ep
            if g // local != ep_rank:
                continue
            up = upstream_flat(with_expert(name, g % local))
            (exp_wd if shards[name].dim() > 1 else exp_no).append((up, name))
        else:
            (dense_wd if shards[name].dim() > 1 else dense_no).append((upstream_flat(name), name))
    out = [("wd_no_scale_lr", 1.0, False, dense_wd), ("no_wd_no_scale_lr", 0.0, False, dense_no)]
    if exp_wd or exp_no:
        out += [(f"ep_size_{ep}", 1.0, True, exp_wd), (f"ep_size_{ep}", 0.0, True, exp_no)]  # DeepSpeed's group names
    return [g for g in out if g[3]]


def param_shapes(shards: dict[str, torch.Tensor], ep: int, per_layer: dict[str, int]) -> list[OrderedDict]:
    """DeepSpeed's ``param_shapes`` of the model file (DP rank 0's groups): {flat name: shape} per group."""
    return [OrderedDict((up, shards[n].shape) for up, n in params)
            for *_, params in groups_for(shards, ep, 0, per_layer)]


def zero_states(shards: dict[str, torch.Tensor], moments: dict[str, dict[str, torch.Tensor]], step: int, *,
                dp: int, ep: int, per_layer: dict[str, int], scheduler: dict, hyper: dict, stage: int,
                ds_config: dict) -> list[dict]:
    """One ZeRO file's content per DP rank, for one TP rank (``shards``, ``moments``: its tensors, upstream's form)."""
    lr = scheduler_lr(scheduler)
    files = []
    for d in range(dp):
        ep_rank, replica = ep_coords(d, ep)
        fp32, state, param_groups, mappings, paddings, counts, aligns = [], {}, [], [], [], [], []
        for g, (gname, wd_mult, moe, params) in enumerate(groups_for(shards, ep, ep_rank, per_layer)):
            parts = dp // ep if moe else dp
            index = replica if moe else d
            flat = {k: torch.cat([src[n].reshape(-1).float() for _, n in params])
                    for k, src in (("w", shards), ("exp_avg", _pick(moments, "exp_avg")),
                                   ("exp_avg_sq", _pick(moments, "exp_avg_sq")))}
            total = flat["w"].numel()
            padded = -(-total // (2 * parts)) * (2 * parts)
            size = padded // parts
            lo, hi = index * size, (index + 1) * size
            piece = {k: torch.cat([v, v.new_zeros(padded - total)])[lo:hi].clone() for k, v in flat.items()}
            fp32.append(piece["w"])
            state[g] = {"step": torch.tensor(float(step)), "exp_avg": piece["exp_avg"],
                        "exp_avg_sq": piece["exp_avg_sq"]}
            param_groups.append({"name": gname, "wd_mult": wd_mult, "lr_mult": 1.0, **({"moe": True} if moe else {}),
                                 "lr": lr, "betas": hyper["betas"], "eps": hyper["eps"],
                                 "weight_decay": hyper["weight_decay"] * wd_mult, "amsgrad": False, "maximize": False,
                                 "foreach": None, "capturable": False, "differentiable": False, "fused": None,
                                 "decoupled_weight_decay": False, "params": [g]})
            mapping, offset = OrderedDict(), 0
            for up, n in params:
                numel = shards[n].numel()
                a, b = max(offset, lo), min(offset + numel, hi)
                if a < b:
                    mapping[up] = fragment_address(numel=b - a, start=a - lo)
                offset += numel
            mappings.append(mapping)
            paddings.append(padded - total if index == parts - 1 else 0)
            counts.append(parts)
            aligns.append([0] * len(params))
        files.append({"optimizer_state_dict": {
            "loss_scaler": LossScaler(1.0), "dynamic_loss_scale": False, "overflow": False,
            "clip_grad": hyper["clip_grad"], "base_optimizer_state": {"state": state, "param_groups": param_groups},
            "single_partition_of_fp32_groups": fp32, "zero_stage": ZeroStageEnum(stage), "group_paddings": paddings,
            "param_alignment_paddings": aligns, "partition_count": counts, "ds_version": hyper["ds_version"],
            "param_slice_mappings": mappings}, "ds_config": ds_config, "ds_version": hyper["ds_version"]})
    return files


def _pick(moments: dict[str, dict[str, torch.Tensor]], key: str) -> dict[str, torch.Tensor]:
    return {n: m[key] for n, m in moments.items()}
