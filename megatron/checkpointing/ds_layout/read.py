"""Reading DeepSpeed's own layout without a process group: the weights of each TP rank (any PP / ZeRO stage, experts
included) and the Adam moments where its files map them to parameters, under our names; full_state/ merges them.

Moments: ZeRO-1/2 and its bf16 optimizer carry ``param_slice_mappings`` (per parameter, where its slice sits in a DP
rank's flat partition); ZeRO-0 in fp32 keeps torch's AdamW state in the model file (under pipeline with the names
format.py records beside it). ZeRO-3 files keep no per-parameter map.
"""

from __future__ import annotations

import glob
import os
import tempfile

import torch

from megatron.checkpointing.ds_layout.files import (
    LAYER_FILE,
    OPTIM_FILE,
    OPTIM_FILES,
    counts_in_files,
    expert_files,
    model_file,
    place,
)
from megatron.checkpointing.live.safe_io import safe_load
from megatron.errors import CheckpointError
from megatron.model.param_names import canonical_name

KEYS = ("exp_avg", "exp_avg_sq")
OPTIMIZER_NAMES = "optimizer_param_names"
"""The model file's key for the full-state names of its ZeRO-0 optimizer's parameters, in the optimizer's order
(format.py writes it): the map that carries the moments to other layers per rank (another chunking)."""
Moments = dict[str, dict[str, torch.Tensor]]


def tp_rank_states(ckpt_dir: str, meta: dict) -> list[dict[str, torch.Tensor]]:
    """One canonical state dict per TP rank (each still TP-sharded, vocab padded)."""
    p = meta["run"]["parallel"]
    tp, pp, zero = p["tensor_model_parallel_size"], p["pipeline_model_parallel_size"], p["zero_stage"]
    nl = meta["run"]["model"]["num_layers"]
    states: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    if pp > 1 and expert_files(ckpt_dir):
        return _pipeline_moe_states(ckpt_dir, tp, pp, nl)
    if pp > 1:
        files = sorted(glob.glob(os.path.join(ckpt_dir, "layer_*-model_states.pt")))
        if not files:
            raise CheckpointError(f"checkpoint {ckpt_dir} has no pipeline layer files (layer_*-model_states.pt)")
        for f in files:
            m = LAYER_FILE.match(os.path.basename(f))
            idx, rank = int(m.group(1)), int(m.group(2) or 0)
            for k, v in safe_load(f).items():
                name = canonical_name(f"{idx}.{k}", nl)
                if name is not None and v is not None:
                    states[rank][name] = v
        return states
    for rank in range(tp):
        if zero == 3:
            module = _zero3_module(ckpt_dir, rank)
        else:
            module = safe_load(model_file(ckpt_dir, rank))["module"]
        states[rank] = {n: v for k, v in module.items() if (n := canonical_name(k, nl)) is not None}
    for _, _, mp, f in expert_files(ckpt_dir):  # DeepSpeed's per-expert files: global expert indices
        states[mp % tp].update({n: v for k, v in safe_load(f).items() if (n := canonical_name(k, nl)) is not None})
    return states


def _pipeline_moe_states(ckpt_dir: str, tp: int, pp: int, nl: int) -> list[dict[str, torch.Tensor]]:
    """DeepSpeed's layout for a pipeline with experts: no layer files; each stage's dense weights in
    mp_rank_XX_model_states.pt (XX = stage x TP + TP rank, the rank among the pipeline grid's model-parallel ranks)
    and one file per expert (tensors named by their pipeline layer index, experts by global id)."""
    states: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    for mp in range(pp * tp):  # stage 0 first: a tied embedding's first-stage copy wins (the last stage's copy of
        # the position embeddings takes no gradient there, so it is stale)
        path = model_file(ckpt_dir, mp)
        if not os.path.isfile(path):
            raise CheckpointError(f"checkpoint file {path} is missing: stage {mp // tp}, TP rank {mp % tp} of a "
                                  f"PP={pp} x TP={tp} checkpoint with experts")
        for k, v in safe_load(path)["module"].items():
            name = canonical_name(k, nl)
            if name is not None and v is not None:
                states[mp % tp].setdefault(name, v)
    for _, _, mp, f in expert_files(ckpt_dir):
        states[mp % tp].update({n: v for k, v in safe_load(f).items() if (n := canonical_name(k, nl)) is not None})
    return states


def _zero3_module(ckpt_dir: str, tp_rank: int) -> dict[str, torch.Tensor]:
    """ZeRO-3 keeps weights only in the fp32 optimizer partitions: gather them with DeepSpeed's own
    zero_to_fp32, one TP rank at a time (it globs every *_optim_states.pt file of a directory, so the
    files of this TP rank are linked into a scratch directory first). zero_to_fp32 unpickles with
    weights_only=False: only run it on checkpoints you trust (this function validates them first)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    mine = [f for f in os.listdir(ckpt_dir) if f.endswith(".pt") and f"mp_rank_{tp_rank:02d}" in f]
    for f in mine:
        safe_load(os.path.join(ckpt_dir, f), mmap=True)
    with tempfile.TemporaryDirectory() as tmp:
        os.makedirs(os.path.join(tmp, "t"))
        for f in mine:
            os.symlink(os.path.abspath(os.path.join(ckpt_dir, f)), os.path.join(tmp, "t", f.replace(
                f"mp_rank_{tp_rank:02d}", "mp_rank_00")))
        return get_fp32_state_dict_from_zero_checkpoint(tmp, tag="t")


def has_zero_optimizer_files(ckpt_dir: str) -> bool:
    return bool(glob.glob(os.path.join(ckpt_dir, OPTIM_FILES)))


def zero12_moments(ckpt_dir: str, tp: int, nl: int, ep: int = 1) -> tuple[list[Moments], int]:
    """DeepSpeed ZeRO-1/2 (fp32 or its bf16 optimizer): every DP rank's file holds a slice of each parameter's
    moments; concatenated in DP order they are the flattened parameter (model-parallel rank = stage x TP + tp)."""
    pieces: dict[tuple[int, str], dict[int, dict[int, dict]]] = {}  # (tp, name) -> mp -> dp -> {key: slice}
    shapes: list[dict[str, torch.Size]] = [{} for _ in range(tp)]
    shape_of: dict[tuple[int, str], str] = {}  # experts: global name -> the local name the shapes carry
    # Pipeline expert files name their tensors by pipeline layer index ('2.mlp...'): key the counts canonically.
    per_layer = {canonical_name(k, nl): v for k, v in counts_in_files(ckpt_dir).items()}
    step = 0
    for path in sorted(glob.glob(os.path.join(ckpt_dir, OPTIM_FILES))):
        m = OPTIM_FILE.search(path)
        dp, mp = int(m.group(1)), int(m.group(2))
        osd = safe_load(path)["optimizer_state_dict"]
        mappings = osd.get("param_slice_mappings")
        if mappings is None:
            raise CheckpointError(f"checkpoint file {path} has no param_slice_mappings: written by an older DeepSpeed")
        base = osd["base_optimizer_state"]
        states = [base["state"].get(i, {}) for i in range(len(mappings))] if isinstance(base, dict) else base
        for group, state in zip(mappings, states, strict=True):
            if "exp_avg" not in state:
                return [], 0
            step = int(state["step"])
            for name, addr in group.items():
                c = canonical_name(name, nl)
                if c is not None:
                    full, part = place(c, dp, ep, per_layer)  # experts: their replica's partition
                    shape_of[(mp % tp, full)] = c
                    pieces.setdefault((mp % tp, full), {}).setdefault(mp, {})[part] = {
                        k: state[k][addr.start:addr.start + addr.numel] for k in KEYS}
        for group in safe_load(model_file(ckpt_dir, mp), mmap=True).get("param_shapes") or []:
            for name, shape in group.items():
                if (c := canonical_name(name, nl)) is not None:
                    shapes[mp % tp][c] = torch.Size(shape)
    per_tp: list[Moments] = [{} for _ in range(tp)]
    for (t, name), by_mp in pieces.items():
        by_dp = by_mp[min(by_mp)]  # a tied weight sits on two stages with equal moments: take the first
        per_tp[t][name] = {k: torch.cat([by_dp[d][k] for d in sorted(by_dp)]).view(shapes[t][shape_of[(t, name)]])
                           for k in KEYS}
    return per_tp, step


def zero0_moments(ckpt_dir: str, tp: int, nl: int, pp: int = 1) -> tuple[list[Moments], int]:
    """ZeRO-0 fp32: torch AdamW's state in each model file (model-parallel rank = stage x TP + tp), indexed in the
    optimizer's order: the names saved beside it (``OPTIMIZER_NAMES``, format.py), else, without pipeline,
    megatron/optim/optimizer.py's param_groups order (weights with 2+ dims first, then 1-D ones, each in the module's
    order). A tied weight sits on two stages with equal moments: the first stage's is kept."""
    per_tp: list[Moments] = [{} for _ in range(tp)]
    step = 0
    for mp in range(pp * tp):
        model = safe_load(model_file(ckpt_dir, mp))
        opt, module = model.get("optimizer"), model.get("module")
        if not opt or "state" not in opt:
            raise CheckpointError("the ZeRO-0 model file holds no torch AdamW state (bf16 keeps DeepSpeed's own)")
        if not opt["state"]:
            return [], 0
        names = model.get(OPTIMIZER_NAMES)
        if names is None and module is None:
            raise CheckpointError(f"{model_file(ckpt_dir, mp)} keeps no names of its optimizer's parameters "
                                  "(saved before they were recorded)")
        if names is None:
            names = [canonical_name(n, nl) for n in
                     [n for n, v in module.items() if v.dim() > 1] + [n for n, v in module.items() if v.dim() == 1]]
            shapes = [v.shape for v in module.values() if v.dim() > 1] + [v.shape for v in module.values()
                                                                        if v.dim() == 1]
        else:
            shapes = [None] * len(names)
        for i, (name, shape) in enumerate(zip(names, shapes, strict=True)):
            st = opt["state"][i]
            if shape is not None and st["exp_avg"].shape != shape:
                raise CheckpointError(f"{ckpt_dir}: ZeRO-0 optimizer state {i} does not match parameter {name}")
            step = int(st["step"])
            if name is not None:
                per_tp[mp % tp].setdefault(name, {k: st[k] for k in KEYS})
    return per_tp, step
