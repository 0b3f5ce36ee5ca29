"""DeepSpeed's per-expert checkpoint files, ``layer_L_expert_E_mp_rank_XX_model_states.pt`` (L: the MoE layer's index
among the model's MoE layers, E: the expert's global id, XX: the TP rank): read back into each TP rank's state."""

from __future__ import annotations

import os
import re
from collections.abc import Callable

import torch

from megatron.checkpointing.safe_io import safe_load
from megatron.errors import CheckpointError

EXPERT_FILE = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_EXPERT_ID = re.compile(r"\.deepspeed_experts\.\d+\.")


def expert_file_name(moe_layer: int, expert: int, tp_rank: int) -> str:
    return f"layer_{moe_layer}_expert_{expert}_mp_rank_{tp_rank:02d}_model_states.pt"


def read_expert_files(ckpt_dir: str, tp: int, experts_per_layer: list[int],
                      canonical: Callable[[str], str]) -> list[dict[str, torch.Tensor]]:
    """One state per TP rank with every expert of every MoE layer under its global id (the names a one-process model
    has), from the files DeepSpeed's engine wrote; ``canonical`` maps a module name to GPTModel's. Each expert file
    names its tensors with the global id already; a missing file is an error naming it."""
    moe_counts = [n for n in experts_per_layer if n > 1]
    present = set(os.listdir(ckpt_dir))
    states: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    for rank in range(tp):
        for layer, count in enumerate(moe_counts):
            for expert in range(count):
                name = expert_file_name(layer, expert, rank)
                if name not in present:
                    raise CheckpointError(f"checkpoint file {os.path.join(ckpt_dir, name)} is missing: expert "
                                          f"{expert} of MoE layer {layer} (TP rank {rank}); the checkpoint is "
                                          "incomplete")
                for key, value in safe_load(os.path.join(ckpt_dir, name)).items():
                    states[rank][canonical(key)] = value
    return states


def partition_name(name: str) -> str:
    """The partition table lists rank 0's experts under their local ids; all experts of a layer are split alike, so
    any expert's entry is expert 0's."""
    return _EXPERT_ID.sub(".deepspeed_experts.0.", name)
