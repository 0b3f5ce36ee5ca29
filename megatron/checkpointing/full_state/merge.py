"""The full (unsharded) model of a checkpoint training wrote, of any TP/PP/ZeRO/EP layout: one state dict under
our names (megatron/model/param_names.py; experts by global index) and, where the files map them, the full Adam
moments. Vocabulary rows are *unpadded* (``vocab_size`` rows), because the padding depends on the TP size (Megatron
pads to a multiple of divisible-by x TP). The formats read their own files (ds_layout/read.py, hzero/shards.py);
this merges their TP shards.
"""

from __future__ import annotations

import os

import torch

from megatron.checkpointing.ds_layout.read import (
    KEYS,
    Moments,
    has_zero_optimizer_files,
    tp_rank_states,
    zero0_moments,
    zero12_moments,
)
from megatron.checkpointing.hzero.shards import merged_tp_states
from megatron.checkpointing.state import HZERO_FORMAT
from megatron.errors import CheckpointError
from megatron.model.param_names import VOCAB_PARAMS, canonical_name, expert_index, with_expert


def merge_tp(shards: list[torch.Tensor], dim: int, stride: int) -> torch.Tensor:
    """Inverse of ``shard_tensor``: each shard holds its slice of each of ``stride`` stacked blocks."""
    if len(shards) == 1:
        return shards[0]
    blocks = [s.chunk(stride, dim=dim) for s in shards]
    return torch.cat([torch.cat([b[k] for b in blocks], dim=dim) for k in range(stride)], dim=dim)


def _tp_rank_states(ckpt_dir: str, meta: dict) -> list[dict[str, torch.Tensor]]:
    """One canonical state dict per TP rank (each still TP-sharded, vocab padded)."""
    if meta.get("format") == HZERO_FORMAT:  # per-rank shard files of hierarchical ZeRO, no DeepSpeed layout
        nl = meta["run"]["model"]["num_layers"]
        return [{canonical_name(k, nl): v for k, v in w.items()}
                for w in merged_tp_states(ckpt_dir, meta, with_moments=False)[0]]
    return tp_rank_states(ckpt_dir, meta)


def merge_checkpoint(ckpt_dir: str, meta: dict) -> dict[str, torch.Tensor]:
    """The full model of a checkpoint directory of ours (``DIR/global_stepN``), vocab unpadded."""
    table = meta.get("partition_table")
    if table is None:
        raise CheckpointError(f"checkpoint file {os.path.join(ckpt_dir, 'megatron_meta.json')} has no partition "
                              "table: not written by megatron/checkpointing")
    states = _tp_rank_states(ckpt_dir, meta)
    full = {}
    for name in states[0]:
        entry = table.get(name) or table.get(_local_zero(name))  # experts: the table names rank 0's (local) ones
        if entry is not None:
            dim, stride = entry
            full[name] = merge_tp([s[name] for s in states], dim, stride)
        else:
            full[name] = states[0][name]
    vocab = meta["run"]["model"]["vocab_size"]
    for name in VOCAB_PARAMS:
        if name in full:
            full[name] = full[name][:vocab]
    return {k: v.detach().clone().contiguous() for k, v in full.items()}


def _local_zero(name: str) -> str | None:
    return with_expert(name, 0) if expert_index(name) is not None else None


def merge_moments(ckpt_dir: str, meta: dict, unpad: bool = True) -> tuple[Moments | None, int, str]:
    """(full moments by canonical name, Adam step, why not when None) of one checkpoint directory; ``unpad=False``
    keeps the padded vocabulary rows (their moments are not zero: into the same TP size only). Sources:
    hierarchical ZeRO (its shard files), DeepSpeed ZeRO-1/2 and its bf16 optimizer, DeepSpeed ZeRO-0 in fp32
    (under pipeline when the names of its optimizer's parameters were saved beside it). ZeRO-3 files keep no
    per-parameter map: their moments restart, and the tool says so."""

    if not meta.get("has_optimizer", True):
        return None, 0, "the checkpoint was saved with --no-save-optim"
    p = meta["run"]["parallel"]
    nl, tp = meta["run"]["model"]["num_layers"], p["tensor_model_parallel_size"]
    try:  # the weights are converted regardless: moments that cannot be read restart, and the tool says why
        if meta.get("format") == HZERO_FORMAT:
            _, per_tp, step = merged_tp_states(ckpt_dir, meta, with_moments=True)
            per_tp = [{canonical_name(k, nl): v for k, v in m.items()} for m in per_tp]
        elif has_zero_optimizer_files(ckpt_dir) and p["zero_stage"] < 3:
            per_tp, step = zero12_moments(ckpt_dir, tp, nl, p.get("moe_expert_parallel_size", 1))
        elif p["zero_stage"] == 0:
            per_tp, step = zero0_moments(ckpt_dir, tp, nl, p["pipeline_model_parallel_size"])
        else:
            return None, 0, f"ZeRO-{p['zero_stage']} files keep no per-parameter map of the Adam moments"
    except (CheckpointError, KeyError, TypeError, ValueError) as e:
        return None, 0, f"{type(e).__name__}: {str(e)[:200]}"
    if not per_tp or not per_tp[0]:
        return None, 0, "the optimizer had not stepped yet"
    table, vocab = meta.get("partition_table") or {}, meta["run"]["model"]["vocab_size"]
    out: Moments = {}
    for name in per_tp[0]:
        out[name] = {}
        entry = table.get(name) or table.get(_local_zero(name))
        for k in KEYS:
            shards = [m[name][k] for m in per_tp]
            full = merge_tp(shards, *entry) if entry else shards[0]
            out[name][k] = (full[:vocab] if unpad and name in VOCAB_PARAMS else full).contiguous()
    return out, step, ""
