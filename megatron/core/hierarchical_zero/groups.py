"""The data-parallel group split into tiers (package -> node -> network) from megatron/topology.py's placement.

Worked example: 8 ranks simulating 2 nodes x 2 packages x 2 GCDs (ranks per node 4), TP=1, one DP group of 8:

    package groups: [0,1] [2,3] [4,5] [6,7]          (200 GB/s link)
    node groups:    [0,2] [1,3] [4,6] [5,7]          (same position in their package, across packages)
    network groups: [0,4] [1,5] [2,6] [3,7]          (same position in their node, one rank per node)

A gradient reduce-scatter walks package -> node -> network, each stage splitting the buffer it received into as
many contiguous chunks as the group has members and keeping its own: a rank ends with chunk
``(i_package * k_node + i_node) * k_network + i_network`` of the flat buffer, and the network stage carries only
1/(ranks per node) of the gradient per rank. With TP=2 on a package the DP group [0,2,4,6] has one rank per
package, so the package level has size 1 and is skipped.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from megatron.errors import ConfigError
from megatron.topology import Placement, frontier_placement


def _unit(level: str, p: Placement) -> tuple:
    """The topology unit a level's group lives in: one package, one node, or the whole job."""
    return {"package": (p.node_index, p.package), "node": (p.node_index,), "network": ()}[level]


def level_groups(dp_groups: list[list[int]], placements: list[Placement],
                 levels: tuple[str, ...]) -> dict[str, list[list[int]]]:
    """Pure function: for each level, the rank lists of its groups (over every DP group), in creation order.

    A level's group holds the DP ranks that share the level's unit (package / node / job) and hold the same
    position in every finer level's group. Raises ConfigError when packages or nodes hold unequal DP counts.
    """
    out: dict[str, list[list[int]]] = {lv: [] for lv in levels}
    for dp in dp_groups:
        position: dict[int, tuple] = {r: () for r in dp}  # a rank's index in each finer level's group
        for lv in levels:
            buckets: dict[tuple, list[int]] = defaultdict(list)
            for r in dp:
                buckets[(_unit(lv, placements[r]), position[r])].append(r)
            groups = list(buckets.values())
            if len({len(g) for g in groups}) != 1:
                raise ConfigError(f"data-parallel group {dp} is spread unevenly over {lv}s "
                                  f"({sorted(len(g) for g in groups)} ranks): launch the same number of ranks on "
                                  "every node (srun -n $((N*8))) or drop that tier from --zero-hierarchy")
            for g in groups:
                for i, r in enumerate(g):
                    position[r] = position[r] + (i,)
            out[lv].extend(groups)
    return out


@dataclass
class Level:
    """One tier of this rank's DP group: its ranks, this rank's index in it and the process group."""

    name: str
    ranks: list[int]
    index: int
    group: object

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass
class Hierarchy:
    """This rank's levels, fastest first. Levels of size 1 are dropped: they carry no traffic."""

    levels: list[Level]
    dp_size: int

    def upto(self, name: str) -> list[Level]:
        """Levels up to and including ``name`` in the configured order (those present on this run)."""
        order = ("package", "node", "network")
        return [lv for lv in self.levels if order.index(lv.name) <= order.index(name)]

    def after(self, name: str) -> list[Level]:
        order = ("package", "node", "network")
        return [lv for lv in self.levels if order.index(lv.name) > order.index(name)]

    def shard_index(self, levels: list[Level]) -> int:
        """Which chunk of the flat buffer this rank holds after reduce-scattering over ``levels``."""
        idx = 0
        for lv in levels:
            idx = idx * lv.size + lv.index
        return idx

    def shard_count(self, levels: list[Level]) -> int:
        n = 1
        for lv in levels:
            n *= lv.size
        return n


def check_whole_nodes(world_size: int, ranks_per_node: int) -> None:
    """The tiers assume every node is full (preflight runs this before any process group, too)."""
    if world_size % ranks_per_node:
        raise ConfigError(f"--zero-hierarchy: world size {world_size} is not a multiple of {ranks_per_node} ranks "
                          "per node: launch whole nodes (or set megatron_frontier.ranks_per_node in the ds_config)")


def build_hierarchy(dp_groups: list[list[int]], world_size: int, rank: int, levels: tuple[str, ...],
                    ranks_per_node: int) -> Hierarchy:
    """Create every level's process groups (collective: all ranks call this in the same order)."""
    import deepspeed.comm as dist

    check_whole_nodes(world_size, ranks_per_node)
    placements = frontier_placement(world_size, ranks_per_node)
    mine: list[Level] = []
    dp_size = len(dp_groups[0])
    for lv, groups in level_groups(dp_groups, placements, levels).items():
        for ranks in groups:
            handle = dist.new_group(ranks) if len(ranks) > 1 else None
            if rank in ranks and len(ranks) > 1:
                mine.append(Level(lv, ranks, ranks.index(rank), handle))
    return Hierarchy(mine, dp_size)
