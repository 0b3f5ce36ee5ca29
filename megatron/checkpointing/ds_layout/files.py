"""Expert parameters across layouts: DeepSpeed names a rank's experts by local index in the model and its optimizer
files (``...deepspeed_experts.<local>...``) and by global index in its per-expert files; the full state uses the global
index (expert ``ep_rank x local experts + local``), so experts merge and reshard over EP like TP shards.

DeepSpeed's groups (``deepspeed/utils/groups.py``, ours in megatron/topology.py): the expert-parallel groups are
consecutive data-parallel ranks, so DP rank ``d`` holds the experts of EP rank ``d % ep`` and, within their replicas
(the expert-data-parallel group that ZeRO partitions expert optimizer state over), is replica ``d // ep``.
"""

from __future__ import annotations

import os
import re

import torch

from megatron.checkpointing.safe_io import safe_load

EXPERT_FILE = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_EXPERT = re.compile(r"^(.*\.deepspeed_experts\.)(\d+)(\..+)$")


def expert_index(name: str) -> int | None:
    """The expert index a parameter name carries (local or global by context), None for non-expert parameters."""
    m = _EXPERT.match(name)
    return int(m.group(2)) if m else None


def with_expert(name: str, index: int) -> str:
    """``name`` with its expert index replaced by ``index``."""
    m = _EXPERT.match(name)
    return f"{m.group(1)}{index}{m.group(3)}"


def ep_coords(dp_rank: int, ep_size: int) -> tuple[int, int]:
    """(EP rank, replica index in the expert-data-parallel group) of a data-parallel rank."""
    return dp_rank % ep_size, dp_rank // ep_size


def to_global(name: str, ep_rank: int, num_local: int) -> str:
    """A rank-local expert name under its global index (non-expert names unchanged)."""
    i = expert_index(name)
    return name if i is None else with_expert(name, ep_rank * num_local + i)


def expert_files(path: str) -> list[tuple[int, int, int, str]]:
    """DeepSpeed's per-expert files in a checkpoint directory: (MoE layer id, global expert, model-parallel rank,
    path), sorted. The MoE layer id counts MoE layers only (per pipeline stage); the tensors inside name their layer."""
    out = []
    for f in os.listdir(path):
        if m := EXPERT_FILE.match(f):
            out.append((int(m.group(1)), int(m.group(2)), int(m.group(3)), os.path.join(path, f)))
    return sorted(out)


def local_counts(names) -> dict[str, int]:
    """{layer prefix (the name up to ``deepspeed_experts.``): experts named} over a set of global names."""
    seen: dict[str, set[int]] = {}
    for n in names:
        if m := _EXPERT.match(n):
            seen.setdefault(m.group(1), set()).add(int(m.group(2)))
    return {k: len(v) for k, v in seen.items()}


def layer_key(name: str) -> str | None:
    m = _EXPERT.match(name)
    return m.group(1) if m else None


def expert_offsets(module: torch.nn.Module) -> dict[str, int]:
    """{parameter name: global index of its expert minus its local index} for this rank's expert parameters
    (megatron/model/moe.py's MoE: ``deepspeed_moe.ep`` is the EP group, ``num_local_experts`` its share)."""
    out = {}
    for n, m in module.named_modules():
        ep = getattr(getattr(m, "deepspeed_moe", None), "ep", None)
        if ep is None or not hasattr(m, "num_local_experts"):
            continue
        for pn, _ in m.deepspeed_moe.experts.named_parameters():
            out[f"{n}.deepspeed_moe.experts.{pn}" if n else f"deepspeed_moe.experts.{pn}"] = (
                ep.rank * m.num_local_experts)
    return out


def globalize(param_name: str, canonical: str, offsets: dict[str, int]) -> str:
    """The full-state name of a model parameter: ``canonical`` with a local expert index made global."""
    off = offsets.get(param_name)
    return canonical if off is None else with_expert(canonical, expert_index(canonical) + off)


def place(name: str, dp_rank: int, ep_size: int, per_layer: dict[str, int]) -> tuple[str, int]:
    """(full-state name, ZeRO partition index) of one optimizer-file slice of the DP rank ``dp_rank``: a non-expert
    parameter is partitioned over DP (index: the DP rank); an expert over its replicas (index: the replica), and its
    local name takes the global index of that rank's EP share (``per_layer``: experts of each MoE layer)."""
    if expert_index(name) is None:
        return name, dp_rank
    ep_rank, replica = ep_coords(dp_rank, ep_size)
    return to_global(name, ep_rank, per_layer[layer_key(name)] // ep_size), replica


def counts_in_files(path: str) -> dict[str, int]:
    """{layer prefix: experts} from the names inside a directory's per-expert files (global indices)."""
    names = set()
    for *_, f in expert_files(path):
        names.update(safe_load(f, mmap=True).keys())
    return local_counts(names)
