"""Tensor-, pipeline- and data-parallel process groups in Megatron's rank order.

Worked example: 16 ranks, TP=2, PP=4 (so DP=2). TP is innermost, then DP, then PP:

    rank = pp_rank * (DP * TP) + dp_rank * TP + tp_rank

    TP groups (8): [0,1] [2,3] [4,5] [6,7] [8,9] [10,11] [12,13] [14,15]
    DP groups (8): [0,2] [1,3] [4,6] [5,7] [8,10] [9,11] [12,14] [13,15]
    PP groups (4): [0,4,8,12] [1,5,9,13] [2,6,10,14] [3,7,11,15]

With one process per GCD and Frontier's closest binding, consecutive ranks (0,1) share one MI250X
package, so TP=2 rides the 200 GB/s in-package link and TP=8 stays inside a node.

DeepSpeed-Ulysses (SP > 1) splits that DP dimension into SP (inner) x DP (outer), so the SP all-to-alls ride
the fastest link TP leaves free. 16 ranks, TP=2, PP=2, SP=2 (so DP=2):

    ULYSSES groups    (8): [0,2] [4,6] [1,3] [5,7] [8,10] [12,14] [9,11] [13,15]
    DP groups         (8): [0,4] [2,6] [1,5] [3,7] [8,12] [10,14] [9,13] [11,15]
    ULYSSES_DP groups (4): [0,2,4,6] [1,3,5,7] [8,10,12,14] [9,11,13,15]   (gradients and ZeRO shards)

Megatron's own sequence parallelism (``--sequence-parallel``, ``sequence_parallel`` everywhere) is another thing: it
splits the sequence over the TP group between the TP regions and has no group of its own. Fields and groups of
DeepSpeed-Ulysses are named ``ulysses`` (never ``sp``), so the two cannot be confused.

``ParallelState`` is also the ``mpu`` object DeepSpeed expects (get_model_parallel_* = TP,
get_data_parallel_*). The registry holds the one instance of the run; code that wants other groups
(tests, tools) builds its own ``ParallelState`` and passes it explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import deepspeed.comm as dist

from megatron.topology import parallel_groups


def layout_groups(world_size: int, tp: int, pp: int, ulysses: int = 1,
                  ep: int | None = None) -> dict[str, list[list[int]]]:
    """Pure function: the rank lists of every TP, DP and PP group (``megatron.topology.parallel_groups``, the one
    statement of Megatron's rank order; with SP > 1 also "ulysses" and "ulysses_dp", with experts "ep" and "edp"), plus
    "mp": the TP x PP ranks of each full model replica (each SP rank counts as one: after the gradient reduction SP
    peers hold equal grads; an EP rank holds only its own experts, which the gradient norm adds over "ep")."""
    groups = parallel_groups(world_size, tp, pp, ulysses, ep)
    dp = world_size // (tp * pp)
    groups["mp"] = [[(p * dp + d) * tp + t for p in range(pp) for t in range(tp)] for d in range(dp)]
    return groups


@dataclass
class GroupInfo:
    """One process group as seen by this rank. ``group`` is None only when size == 1 and no
    distributed backend exists (single-process runs and unit tests)."""

    ranks: list[int]
    rank: int
    group: object = None

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass
class ParallelState:
    world_size: int
    global_rank: int
    tp: GroupInfo
    dp: GroupInfo
    pp: GroupInfo
    mp: GroupInfo
    all_groups: dict[str, list[list[int]]] = field(default_factory=dict)
    ulysses: GroupInfo | None = None
    """DeepSpeed-Ulysses sequence group (size 1 without it)."""
    ulysses_dp: GroupInfo | None = None
    """SP x DP: where gradients are reduced and ZeRO shards (the DP group itself without SP)."""
    ep: GroupInfo | None = None
    """Expert parallelism: the DP ranks that together hold one copy of every expert (a lone rank, without a group
    handle, in a model without experts)."""
    edp: GroupInfo | None = None
    """The replicas of this rank's experts: where their gradients are reduced (the DP group itself without EP)."""

    def __post_init__(self) -> None:
        if self.ulysses is None:
            self.ulysses = GroupInfo([self.global_rank], 0, None)
        if self.ulysses_dp is None:
            self.ulysses_dp = self.dp
        if self.ep is None:
            self.ep = GroupInfo([self.global_rank], 0, None)
        if self.edp is None:
            self.edp = self.dp

    @classmethod
    def build(cls, tp_size: int, pp_size: int = 1, world_size: int | None = None,
              global_rank: int | None = None, ulysses_size: int = 1, ep_size: int | None = None) -> ParallelState:
        """Create the groups. Every rank must call this in the same order (new_group is collective). ``ep_size``: a
        model with experts (its EP and expert-replica groups exist even at size 1: DeepSpeed reduces over them)."""
        distributed = dist.is_initialized()
        if world_size is None:
            world_size = dist.get_world_size() if distributed else 1
        if global_rank is None:
            global_rank = dist.get_rank() if distributed else 0
        groups = layout_groups(world_size, tp_size, pp_size, ulysses_size, ep_size)
        mine = {}
        for kind, lists in groups.items():
            for ranks in lists:
                handle = dist.new_group(ranks) if distributed else None
                if global_rank in ranks:
                    mine[kind] = GroupInfo(ranks, ranks.index(global_rank), handle)
        return cls(world_size, global_rank, mine["tp"], mine["dp"], mine["pp"], mine["mp"], groups,
                   mine.get("ulysses"), mine.get("ulysses_dp"), mine.get("ep"), mine.get("edp"))

    # --- the mpu interface DeepSpeed probes (model parallel == tensor parallel here) ---
    def get_model_parallel_rank(self) -> int:
        return self.tp.rank

    def get_model_parallel_world_size(self) -> int:
        return self.tp.size

    def get_model_parallel_group(self):
        return self.tp.group

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_data_parallel_rank(self) -> int:
        return self.dp.rank

    def get_data_parallel_world_size(self) -> int:
        return self.dp.size

    def get_data_parallel_group(self):
        return self.dp.group

    # DeepSpeed reads these (deepspeed.utils.groups): it reduces gradients, partitions ZeRO states and
    # broadcasts the initial weights over the SP x DP group, and divides the summed gradients by DP only.
    def get_sequence_parallel_rank(self) -> int:
        return self.ulysses.rank

    def get_sequence_parallel_world_size(self) -> int:
        return self.ulysses.size

    def get_sequence_parallel_group(self):
        return self.ulysses.group

    def get_sequence_data_parallel_rank(self) -> int:
        return self.ulysses_dp.rank

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.ulysses_dp.size

    def get_sequence_data_parallel_group(self):
        return self.ulysses_dp.group

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.pp.rank

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.pp.size

    def get_pipeline_model_parallel_group(self):
        return self.pp.group

    def describe(self) -> str:
        """Which global ranks form each group (printed by rank 0 at start-up)."""
        lines = []
        for kind in ("tp", "pp", "dp", "ulysses", "ulysses_dp", "ep", "edp"):
            if kind not in self.all_groups:
                continue
            lists = self.all_groups[kind]
            shown = " ".join(str(r) for r in lists[:8]) + (" ..." if len(lists) > 8 else "")
            lines.append(f"  {kind.upper()} groups ({len(lists)} of size {len(lists[0]) if lists else 0}): {shown}")
        return "\n".join(lines)


_STATE: ParallelState | None = None


def set_parallel_state(state: ParallelState | None) -> None:
    global _STATE
    _STATE = state


def get_parallel_state() -> ParallelState:
    if _STATE is None:
        raise RuntimeError("parallel state is not initialised: call megatron.initialize.initialize_megatron first")
    return _STATE


def single_process_state() -> ParallelState:
    """A TP=PP=DP=1 state for single-process use without any process group."""
    one = GroupInfo([0], 0, None)
    return ParallelState(1, 0, one, one, one, one, layout_groups(1, 1, 1))
