"""The files of DeepSpeed's own checkpoint layout (``global_stepN/`` as its engines write it) and where experts and
their optimizer slices sit in them.

Per model-parallel rank ``mp_rank_XX_model_states.pt`` (``zero_pp_rank_D_mp_rank_XX_model_states.pt`` per DP rank at
ZeRO-3), the ZeRO optimizer partitions ``[bf16_]zero_pp_rank_D_mp_rank_XX_optim_states.pt``, the pipeline engine's
``layer_II-model_TT-model_states.pt`` and DeepSpeed-MoE's per-expert ``layer_M_expert_E_mp_rank_XX_model_states.pt``.

Experts: DeepSpeed names a rank's experts by local index in the model and optimizer files and by global index in its
per-expert files; the full state uses the global index (expert ``ep_rank x local experts + local``). DeepSpeed's groups
(``deepspeed/utils/groups.py``, ours in megatron/topology.py): the expert-parallel groups are consecutive
data-parallel ranks, so DP rank ``d`` holds the experts of EP rank ``d % ep`` and, within their replicas (the
expert-data-parallel group that ZeRO partitions expert optimizer state over), is replica ``d // ep``.
"""

from __future__ import annotations

import os
import re

from megatron.checkpointing.live.safe_io import safe_load
from megatron.model.param_names import expert_index, expert_layer_key, experts_per_layer, to_global

EXPERT_FILE = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")
LAYER_FILE = re.compile(r"^layer_(\d+)(?:-model_(\d+))?-model_states\.pt$")
OPTIM_FILES = "*zero_pp_rank_*_mp_rank_*_optim_states.pt"
OPTIM_FILE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


def model_file(ckpt_dir: str, mp: int) -> str:
    """The model file of model-parallel rank ``mp`` (stage x TP + TP rank under the pipeline engine)."""
    return os.path.join(ckpt_dir, f"mp_rank_{mp:02d}_model_states.pt")


def expected_files(meta: dict, present: set[str]) -> list[str]:
    """Files a checkpoint without a manifest must hold, from the layout in its megatron_meta.json: model files per
    model-parallel rank, ZeRO files per DP x MP rank, pipeline layer files per TP rank. ``present`` (the directory's
    names) settles what the layout leaves open: the bf16_ prefix DeepSpeed's bf16 optimizer adds, and how many
    pipeline layer files there are."""

    p = (meta.get("run") or {}).get("parallel") or {}
    tp, pp = int(p.get("tensor_model_parallel_size", 1)), int(p.get("pipeline_model_parallel_size", 1))
    world, zero = int(p.get("world_size", tp * pp)), int(p.get("zero_stage", 0))
    dp, mp = max(1, world // (tp * pp)), tp * pp
    names = []
    if zero == 3:
        names += [f"zero_pp_rank_{d}_mp_rank_{m:02d}_model_states.pt" for d in range(dp) for m in range(mp)]
    else:
        names += [f"mp_rank_{m:02d}_model_states.pt" for m in range(mp)]
    if zero >= 1 and meta.get("has_optimizer", True):
        prefix = "bf16_" if any(n.startswith("bf16_zero_pp_rank_") for n in present) else ""
        names += [f"{prefix}zero_pp_rank_{d}_mp_rank_{m:02d}_optim_states.pt" for d in range(dp) for m in range(mp)]
    layers = [int(m.group(1)) for n in present if (m := re.match(r"layer_(\d+)-model_\d+-model_states\.pt$", n))]
    if layers:  # pipeline engine: every layer index up to the last one seen, each for every TP rank
        names += [f"layer_{i:02d}-model_{t:02d}-model_states.pt" for i in range(max(layers) + 1) for t in range(tp)]
    return names


def expert_files(path: str) -> list[tuple[int, int, int, str]]:
    """DeepSpeed's per-expert files in a checkpoint directory: (MoE layer id, global expert, model-parallel rank,
    path), sorted. The MoE layer id counts MoE layers only (per pipeline stage); the tensors inside name their layer."""
    out = []
    for f in os.listdir(path):
        if m := EXPERT_FILE.match(f):
            out.append((int(m.group(1)), int(m.group(2)), int(m.group(3)), os.path.join(path, f)))
    return sorted(out)


def counts_in_files(path: str) -> dict[str, int]:
    """{layer prefix: experts} from the names inside a directory's per-expert files (global indices)."""
    names = set()
    for *_, f in expert_files(path):
        names.update(safe_load(f, mmap=True).keys())
    return experts_per_layer(names)


def ep_coords(dp_rank: int, ep_size: int) -> tuple[int, int]:
    """(EP rank, replica index in the expert-data-parallel group) of a data-parallel rank."""
    return dp_rank % ep_size, dp_rank // ep_size


def place(name: str, dp_rank: int, ep_size: int, per_layer: dict[str, int]) -> tuple[str, int]:
    """(full-state name, ZeRO partition index) of one optimizer-file slice of the DP rank ``dp_rank``: a non-expert
    parameter is partitioned over DP (index: the DP rank); an expert over its replicas (index: the replica), and its
    local name takes the global index of that rank's EP share (``per_layer``: experts of each MoE layer)."""
    if expert_index(name) is None:
        return name, dp_rank
    ep_rank, replica = ep_coords(dp_rank, ep_size)
    return to_global(name, ep_rank, per_layer[expert_layer_key(name)] // ep_size), replica
