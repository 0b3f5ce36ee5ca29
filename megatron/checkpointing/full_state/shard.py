"""Adam moments across a layout change: merge them out of a checkpoint into full per-parameter tensors (the
full-state format's ``optimizer.safetensors``), and put full moments into any engine's optimizer at load.

Sources (``merge_moments``): hierarchical ZeRO (its shard files), DeepSpeed ZeRO-1/2 and its bf16 optimizer (the
``param_slice_mappings`` each optimizer file carries: per parameter, where its slice sits in this DP rank's flat
partition), DeepSpeed ZeRO-0 in fp32 without pipeline (torch's own AdamW state in the model file). ZeRO-3 and
pipeline ZeRO-0 files keep no per-parameter map: their moments restart, and the tool says so.

Targets (``load_moments``): hierarchical ZeRO, DeepSpeed ZeRO-1/2/bf16 (through each parameter's ``_hp_mapping``),
and plain torch AdamW (ZeRO-0 fp32, with or without pipeline). ZeRO-3 targets restart the moments, with a warning.
"""

from __future__ import annotations

import glob
import os
import re

import torch

from megatron.checkpointing import experts
from megatron.checkpointing import hierarchical_zero as hzero_ckpt
from megatron.checkpointing.full_state import VOCAB_PARAMS, canonical_name, merge_tp, shard_like
from megatron.checkpointing.safe_io import safe_load
from megatron.errors import CheckpointError

KEYS = ("exp_avg", "exp_avg_sq")
MOMENTS_FILE = "optimizer.safetensors"

Moments = dict[str, dict[str, torch.Tensor]]


def merge_moments(ckpt_dir: str, meta: dict) -> tuple[Moments | None, int, str]:
    """(full moments by canonical name, Adam step, why not when None) of one checkpoint directory."""

    if not meta.get("has_optimizer", True):
        return None, 0, "the checkpoint was saved with --no-save-optim"
    p = meta["run"]["parallel"]
    nl, tp = meta["run"]["model"]["num_layers"], p["tensor_model_parallel_size"]
    try:  # the weights are converted regardless: moments that cannot be read restart, and the tool says why
        if meta.get("format") == hzero_ckpt.FORMAT:
            _, per_tp, step = hzero_ckpt.merged_tp_states(ckpt_dir, meta, with_moments=True)
            per_tp = [{canonical_name(k, nl): v for k, v in m.items()} for m in per_tp]
        elif glob.glob(os.path.join(ckpt_dir, "*zero_pp_rank_*_mp_rank_*_optim_states.pt")) and p["zero_stage"] < 3:
            per_tp, step = _zero12(ckpt_dir, tp, nl, p.get("moe_expert_parallel_size", 1))
        elif p["zero_stage"] == 0 and p["pipeline_model_parallel_size"] == 1:
            per_tp, step = _zero0(ckpt_dir, tp, nl)
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
        entry = table.get(name) or (table.get(experts.with_expert(name, 0)) if experts.expert_index(name) is not None
                                    else None)
        for k in KEYS:
            shards = [m[name][k] for m in per_tp]
            full = merge_tp(shards, *entry) if entry else shards[0]
            out[name][k] = (full[:vocab] if name in VOCAB_PARAMS else full).contiguous()
    return out, step, ""


def _zero12(ckpt_dir: str, tp: int, nl: int, ep: int = 1) -> tuple[list[Moments], int]:
    """DeepSpeed ZeRO-1/2 (fp32 or its bf16 optimizer): every DP rank's file holds a slice of each parameter's
    moments; concatenated in DP order they are the flattened parameter (model-parallel rank = stage x TP + tp)."""
    pieces: dict[tuple[int, str], dict[int, dict[int, dict]]] = {}  # (tp, name) -> mp -> dp -> {key: slice}
    shapes: list[dict[str, torch.Size]] = [{} for _ in range(tp)]
    shape_of: dict[tuple[int, str], str] = {}  # experts: global name -> the local name the shapes carry
    # Pipeline expert files name their tensors by pipeline layer index ('2.mlp...'): key the counts canonically.
    per_layer = {canonical_name(k, nl): v for k, v in experts.counts_in_files(ckpt_dir).items()}
    step = 0
    for path in sorted(glob.glob(os.path.join(ckpt_dir, "*zero_pp_rank_*_mp_rank_*_optim_states.pt"))):
        m = re.search(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$", path)
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
                    full, part = experts.place(c, dp, ep, per_layer)  # experts: their replica's partition
                    shape_of[(mp % tp, full)] = c
                    pieces.setdefault((mp % tp, full), {}).setdefault(mp, {})[part] = {
                        k: state[k][addr.start:addr.start + addr.numel] for k in KEYS}
        model_file = os.path.join(ckpt_dir, f"mp_rank_{mp:02d}_model_states.pt")
        for group in safe_load(model_file, mmap=True).get("param_shapes") or []:
            for name, shape in group.items():
                if (c := canonical_name(name, nl)) is not None:
                    shapes[mp % tp][c] = torch.Size(shape)
    per_tp: list[Moments] = [{} for _ in range(tp)]
    for (t, name), by_mp in pieces.items():
        by_dp = by_mp[min(by_mp)]  # a tied weight sits on two stages with equal moments: take the first
        per_tp[t][name] = {k: torch.cat([by_dp[d][k] for d in sorted(by_dp)]).view(shapes[t][shape_of[(t, name)]])
                           for k in KEYS}
    return per_tp, step


def _zero0(ckpt_dir: str, tp: int, nl: int) -> tuple[list[Moments], int]:
    """ZeRO-0 fp32: torch AdamW's state in the model file, indexed in megatron/optim/optimizer.py's param_groups order
    (weights with 2+ dims first, then 1-D ones, each in the module's order)."""
    per_tp: list[Moments] = []
    step = 0
    for t in range(tp):
        model = safe_load(os.path.join(ckpt_dir, f"mp_rank_{t:02d}_model_states.pt"))
        opt, module = model.get("optimizer"), model["module"]
        if not opt or "state" not in opt:
            raise CheckpointError("the ZeRO-0 model file holds no torch AdamW state (bf16 keeps DeepSpeed's own)")
        if not opt["state"]:
            return [], 0
        names = [n for n, v in module.items() if v.dim() > 1] + [n for n, v in module.items() if v.dim() == 1]
        mine: Moments = {}
        for i, name in enumerate(names):
            st = opt["state"][i]
            if st["exp_avg"].shape != module[name].shape:
                raise CheckpointError(f"{ckpt_dir}: ZeRO-0 optimizer state {i} does not match parameter {name}")
            step = int(st["step"])
            if (c := canonical_name(name, nl)) is not None:
                mine[c] = {k: st[k] for k in KEYS}
        per_tp.append(mine)
    return per_tp, step


# ---------------------------------------------------------------------------------------------- into an engine
def load_moments(engine, moments: Moments, step: int, tp_size: int, tp_rank: int, num_layers: int,
                 source: str) -> str:
    """Fill ``engine``'s optimizer with this rank's share of ``moments``; returns what was done, for the log."""

    def shard(name: str, shape, param, full: torch.Tensor) -> torch.Tensor:
        return shard_like(name, full, param, shape, tp_size, tp_rank, source)

    if hzero_ckpt.is_engine(engine):
        hzero_ckpt.set_full_moments(engine, moments, step,
                                    lambda name, shape, full: shard(name, shape, _param(engine, name), full))
        return "Adam moments loaded"
    offsets = experts.expert_offsets(engine.module)  # experts under their global index, as the full state keeps them
    named = [(experts.globalize(n, c, offsets), p) for n, p in engine.module.named_parameters()
             if (c := canonical_name(n, num_layers)) is not None]
    missing = [c for c, _ in named if c not in moments]
    if missing:
        raise CheckpointError(f"{source} has no Adam moments for {missing[0]}: saved from a different model variant")
    opt = engine.optimizer
    base = getattr(opt, "optimizer", opt)
    # ZeRO-1/2 and the bf16 optimizer link every parameter (_hp_mapping None: no slice of it in this DP partition).
    if any(hasattr(p, "_hp_mapping") for _, p in named):
        for group in base.param_groups:
            flat = group["params"][0]
            base.state[flat] = {"step": torch.tensor(float(step)),
                                **{k: torch.zeros_like(flat, dtype=torch.float32) for k in KEYS}}
        for name, p in named:
            hp = getattr(p, "_hp_mapping", None)
            if hp is None:
                continue
            state = base.state[base.param_groups[hp.param_group_index]["params"][0]]
            for k in KEYS:
                full = shard(name, p.shape, p, moments[name][k]).reshape(-1)
                lp, dst = hp.lp_fragment_address, hp.hp_fragment_address
                state[k].narrow(0, dst.start, dst.numel).copy_(full.narrow(0, lp.start, lp.numel))
        return "Adam moments loaded"
    owned = {id(p) for g in base.param_groups for p in g["params"]}
    if isinstance(base, torch.optim.Optimizer) and all(id(p) in owned for _, p in named):  # plain AdamW
        for name, p in named:
            base.state[p] = {"step": torch.tensor(float(step)),
                             **{k: shard(name, p.shape, p, moments[name][k]).to(p.device, torch.float32).clone()
                                for k in KEYS}}
        return "Adam moments loaded"
    return "WARNING: this engine (ZeRO-3) takes no per-parameter Adam moments: they restart"


def _param(engine, name: str):
    for n, p in engine.module.named_parameters():
        if n == name:
            return p
    raise CheckpointError(f"parameter {name} not found in the model")
