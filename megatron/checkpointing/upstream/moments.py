"""Adam moments of upstream Megatron-DeepSpeed checkpoints in our names, merged over DP, PP and TP (reader.py
reads the rest): ZeRO-1/2 from each DP rank's flat fp32 partition through DeepSpeed's ``param_slice_mappings``,
ZeRO-0 without pipeline from torch Adam's state in the model files (indexed in upstream's param-group order)."""

from __future__ import annotations

import glob
import os

import torch

from megatron.checkpointing.ds_layout.files import OPTIM_FILE, OPTIM_FILES, place
from megatron.checkpointing.live.safe_io import safe_load
from megatron.checkpointing.upstream.mapping import flatten, merge_ranks
from megatron.model.param_names import from_upstream, from_upstream_pipe


def zero0_moments(states: dict, tp: int, fields: dict, path: str):
    """DeepSpeed ZeRO-0 without pipeline: torch Adam's state in each model file, indexed in upstream's param-group
    order (its weight-decay group: parameters with 2+ dims in module order, then the 1-D ones), checked by shape."""
    per_tp: list[dict] = [{} for _ in range(tp)]
    step = 0
    for rank, state in states.items():
        opt, module = state.get("optimizer") or {}, flatten(state.get("module") or {})
        if not opt.get("state"):
            return None, 0, "no Adam state in the ZeRO-0 model files: Adam restarts"
        tensors = {k: v for k, v in module.items() if torch.is_tensor(v)}
        order = [k for k, v in tensors.items() if v.dim() > 1] + [k for k, v in tensors.items() if v.dim() == 1]
        if len(order) != len(opt["state"]):
            return None, 0, f"{path}: {len(opt['state'])} Adam states for {len(order)} parameters: Adam restarts"
        for i, name in enumerate(order):
            st = opt["state"][i]
            if st["exp_avg"].shape != tensors[name].shape:
                return None, 0, f"{path}: Adam state {i} does not fit {name} (another param-group order): Adam restarts"
            step = int(st["step"])
            if (ours := from_upstream(name)) is not None:
                per_tp[rank][ours] = {k: st[k] for k in ("exp_avg", "exp_avg_sq")}
    moments: dict = {}
    for k in ("exp_avg", "exp_avg_sq"):
        for name, t in merge_ranks([{n: m[k] for n, m in mine.items()} for mine in per_tp], fields).items():
            moments.setdefault(name, {})[k] = t
    return moments, step, "Adam moments loaded"


def zero12_moments(path: str, tp: int, roles: dict[int, str], fields: dict, param_shapes: dict[int, list],
                   per_layer: dict[str, int] | None = None):
    """Adam moments from DeepSpeed ZeRO-1/2 optimizer files (each DP rank's flat fp32 partition, mapped to
    parameters by ``param_slice_mappings``), merged over DP, PP and TP. Experts (``per_layer``: experts of each MoE
    layer) sit in the files under their local index, partitioned over their replicas: placed by
    ds_layout/files.py's ``place``."""
    files = sorted(glob.glob(os.path.join(path, OPTIM_FILES)))
    if not files:
        return None, 0, "no ZeRO optimizer files (ZeRO-0 under upstream keeps no per-parameter map): Adam restarts"
    pieces: dict[tuple[int, str], dict[int, dict[int, dict]]] = {}
    shapes: dict[tuple[int, str], torch.Size] = {}
    shape_of: dict[tuple[int, str], str] = {}  # a global expert name -> its local name in the shapes (same shape)
    ep = (fields.get("moe") or {}).get("ep", 1)
    step, pp_files = 0, bool(roles)
    for f in files:
        m = OPTIM_FILE.search(f)
        dp, mp = int(m.group(1)), int(m.group(2))
        t = mp % tp
        osd = safe_load(f)["optimizer_state_dict"]
        mappings = osd.get("param_slice_mappings")
        if mappings is None:
            return None, 0, f"{f} has no param_slice_mappings (ZeRO-3 or an older DeepSpeed): Adam restarts"
        base = osd["base_optimizer_state"]
        states = [base["state"].get(i, {}) for i in range(len(mappings))] if isinstance(base, dict) else base
        for group, state in zip(mappings, states, strict=True):
            if "exp_avg" not in state:
                return None, 0, "the optimizer had not stepped yet"
            step = int(state["step"])
            for name, addr in group.items():
                local = from_upstream_pipe(name, roles) if pp_files else from_upstream(name)
                if local is None:
                    continue
                ours, part = place(local, dp, ep, per_layer or {})
                shape_of[(t, ours)] = local
                pieces.setdefault((t, ours), {}).setdefault(mp, {})[part] = {
                    k: state[k][addr.start:addr.start + addr.numel] for k in ("exp_avg", "exp_avg_sq")}
        for group in param_shapes.get(mp, []):
            for name, shape in group.items():
                ours = from_upstream_pipe(name, roles) if pp_files else from_upstream(name)
                if ours is not None:
                    shapes[(t, ours)] = torch.Size(shape)
    per_tp: list[dict] = [{} for _ in range(tp)]
    for (t, name), by_mp in pieces.items():
        by_dp = by_mp[min(by_mp)]  # the tied embedding sits on the first and last stage with equal moments
        per_tp[t][name] = {k: torch.cat([by_dp[d][k] for d in sorted(by_dp)]).view(shapes[(t, shape_of[(t, name)])])
                           for k in ("exp_avg", "exp_avg_sq")}
    moments = {}
    for k in ("exp_avg", "exp_avg_sq"):
        for name, t in merge_ranks([{n: m[k] for n, m in mine.items()} for mine in per_tp], fields).items():
            moments.setdefault(name, {})[k] = t
    return moments, step, "Adam moments loaded"
