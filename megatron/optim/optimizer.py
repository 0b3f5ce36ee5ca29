"""The optimizer from the flags (``make_optimizer``). AdamW, the default: torch's fused kernel on an
accelerator, the reference loop on CPU.

Why: the H100 profile of the GPT 1.3B step spent 11% of GPU time in the for-each AdamW over fp32
masters; ``fused=True`` does the whole update in one kernel per parameter group chunk, with the same
update rule (decoupled weight decay, bias correction). On CPU the optimizer stays exactly as before (the
default single-tensor path), so every CPU test's numerics are unchanged: torch also has a CPU fused
AdamW, but its rounding differs and nothing would gain from it here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from megatron.core.comm import accelerator_device_type

if TYPE_CHECKING:  # the config sits above this layer; only its type is named here
    from megatron.config import OptimizerConfig


def fused_supported(device_type: str) -> bool:
    """Whether torch has a fused AdamW for this (non-CPU) device type."""
    if device_type == "cpu":
        return False
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:  # older torch: CUDA (and ROCm, which reports "cuda") only
        return device_type == "cuda"
    return device_type in _get_fused_kernels_supported_devices()


def make_adamw(params, o: OptimizerConfig, device_type: str | None = None, **extra) -> torch.optim.AdamW:
    """AdamW over ``params`` (tensors or param groups) with the run's hyper-parameters.

    ``device_type`` defaults to the accelerator's: the model may still be on the host when the optimizer
    is built (DeepSpeed moves the same Parameter objects to the device afterwards).
    """
    kind = device_type or accelerator_device_type()
    kwargs = dict(lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps, **extra)
    if fused_supported(kind):
        kwargs["fused"] = True
    return torch.optim.AdamW(params, **kwargs)


def make_optimizer(params, o: OptimizerConfig, offload: bool = False, device_type: str | None = None, **extra):
    """The optimizer the flags ask for, as upstream builds it (megatron/optimizer/__init__.py there).

    --cpu-optimizer or a ZeRO-Offload JSON: DeepSpeed's CPU Adam in AdamW mode (torch's AdamW with
    --cpu_torch_adam), which DeepSpeed accepts as the client optimizer of an offloaded ZeRO. Else --optimizer:
    adam is AdamW (upstream's FusedAdam default, adam_w_mode), sgd is SGD with --sgd-momentum and L2 weight decay.
    """
    if o.cpu_optimizer or offload:
        kwargs = dict(lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps, **extra)
        if o.cpu_torch_adam:
            return torch.optim.AdamW(params, **kwargs)
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, adamw_mode=True, **kwargs)
    if o.optimizer == "sgd":
        return torch.optim.SGD(params, lr=o.lr, momentum=o.sgd_momentum, **extra)
    return make_adamw(params, o, device_type=device_type, **extra)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Megatron's split: no weight decay on biases and norm weights (any 1-D parameter). ``wd_mult`` as
    upstream's groups: the scheduler sets each group's decay to the schedule's times it. Experts' parameters get
    groups of their own (``moe_param_groups``)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.dim() == 1 else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay, "wd_mult": 1.0},
              {"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0}]
    return moe_param_groups([g for g in groups if g["params"]])


def is_expert_param(p: torch.Tensor) -> bool:
    """DeepSpeed's mark of an expert parameter (megatron/model/moe_experts.py sets it)."""
    return getattr(p, "allreduce", True) is False


def moe_param_groups(groups: list[dict]) -> list[dict]:
    """DeepSpeed's MoE optimizer groups (upstream's --create-moe-param-group): each group's expert parameters move to
    a group of their own per expert group, marked ``moe`` and named after it, after the dense groups; ZeRO-1/2 shard
    such a group over the experts' replicas. Always done here: ZeRO needs them, and for the rest the split changes no
    update. Groups without experts come back as they are."""
    dense, experts = [], []
    for g in groups:
        by_name: dict[str, list] = {}
        for p in g["params"]:
            if is_expert_param(p):
                by_name.setdefault(p.group_name, []).append(p)
        kept = [p for p in g["params"] if not is_expert_param(p)]
        if kept:
            dense.append({**g, "params": kept})
        experts += [{**g, "params": ps, "moe": True, "name": name} for name, ps in by_name.items()]
    return dense + experts
