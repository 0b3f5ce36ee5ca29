"""Layout checks that need the launcher's environment but no process group (the world size and the ranks
per node come from torchrun / Slurm / MPI variables, as ``megatron.topology.discover_ranks`` reads them)."""

from __future__ import annotations

import os

from megatron.core.hierarchical_zero import check_whole_nodes, from_ds_config, ranks_per_node
from megatron.topology import discover_ranks


def check_layout(ds_config: dict) -> None:
    """Hierarchical ZeRO's tiers need whole nodes: refuse a partial last node now, not after the groups exist."""
    hcfg = from_ds_config(ds_config)
    if hcfg is None:
        return
    world = discover_ranks(os.environ, use_mpi4py=False).world_size
    check_whole_nodes(world, ranks_per_node(hcfg))
