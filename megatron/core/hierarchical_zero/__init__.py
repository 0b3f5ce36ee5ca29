"""Hierarchical ZeRO-3 (package -> node -> network) for Frontier; megatron/engine.py selects it.

See engine.py for the partitions, groups.py for the tiers, collectives.py for the int8 network stage.
"""

from __future__ import annotations

import os

import torch
from deepspeed.accelerator import get_accelerator

from megatron.core.hierarchical_zero.config import (
    SECTION,
    HierarchyConfig,
    from_ds_config,
    hpz_partition_size,
)
from megatron.core.hierarchical_zero.engine import HierarchicalZeroEngine
from megatron.core.hierarchical_zero.groups import Hierarchy, build_hierarchy, check_whole_nodes, level_groups
from megatron.topology import discover_ranks

__all__ = [
    "SECTION",
    "HierarchicalZeroEngine",
    "Hierarchy",
    "HierarchyConfig",
    "build_hierarchy",
    "check_whole_nodes",
    "create_engine",
    "from_ds_config",
    "hpz_partition_size",
    "level_groups",
    "ranks_per_node",
]


def ranks_per_node(hcfg: HierarchyConfig | dict) -> int:
    """The configured node size (a HierarchyConfig, or a ds_config's section), else the launcher's ranks per node
    (never ``device_count()``: it is 1 on Frontier under --gpus-per-task=1)."""
    configured = hcfg.get("ranks_per_node") if isinstance(hcfg, dict) else hcfg.ranks_per_node
    if configured is not None:
        return configured

    return discover_ranks(os.environ, use_mpi4py=False).local_world_size


def create_engine(model: torch.nn.Module, run, pstate, hcfg: HierarchyConfig, optimizer_factory,
                  scheduler_factory) -> HierarchicalZeroEngine:
    """Build the tier groups (collective) and the engine for ``run`` (a RunConfig, whose validation refused what the
    mode cannot run with: megatron/config/parallel.py)."""
    p = run.parallel
    hierarchy = build_hierarchy(pstate.all_groups["dp"], pstate.world_size, pstate.global_rank, hcfg.levels,
                                ranks_per_node(hcfg))
    dtype = torch.bfloat16 if run.precision.bf16 else torch.float32
    # DeepSpeed moves a model to the accelerator itself; this engine is ours, so do it here (the norm weights
    # are built on the host), before its buffers are allocated where the parameters live.
    model.to(get_accelerator().current_device_name())
    engine = HierarchicalZeroEngine(model, hcfg, hierarchy, pstate, optimizer_factory, scheduler_factory,
                                    run.training.grad_accumulation_steps(p.dp), run.optimizer.clip_grad, dtype)
    engine.micro_batch_size = run.training.micro_batch_size
    return engine
