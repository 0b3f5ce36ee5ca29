"""Reading a whole upstream checkpoint into our names, merged over TP and PP: the weights, the Adam moments where
the files map them to parameters (DeepSpeed ZeRO-1/2 ``param_slice_mappings``), the iteration, consumed samples, LR
position and RNG states."""

from __future__ import annotations

import glob
import os

import torch

from megatron.checkpointing.ds_layout.files import expert_files as ds_expert_files
from megatron.checkpointing.live.safe_io import safe_load
from megatron.checkpointing.upstream import universal as universal_form
from megatron.checkpointing.upstream.layout import (
    ITER_RANK,
    LAYER_FILE,
    MP_FILE,
    Converted,
    Found,
    find_marked,
)
from megatron.checkpointing.upstream.moments import zero0_moments, zero12_moments
from megatron.checkpointing.upstream.mapping import (
    flatten,
    merge_ranks,
    model_fields,
    pipe_final_norm_to_ours,
    pipe_roles,
)
from megatron.checkpointing.upstream.unpickle import args_of, load_file
from megatron.config.parallel import split_layers
from megatron.errors import CheckpointError
from megatron.model.param_names import experts_per_layer, from_upstream, from_upstream_pipe, pipe_roles_from_keys


def find(load: str, universal: bool = False) -> Found | None:
    """The upstream checkpoint ``--load`` names, or None when the directory is not one (ours, empty, unknown).
    ``universal`` (--universal-checkpoint): the one ``latest_universal`` names, as upstream loads it."""
    return universal_form.find(load) if universal else find_marked(load)


def read(found: Found, trust: bool, with_optimizer: bool = True) -> Converted:
    """The whole checkpoint ``found`` in our names (collective-free: every rank may call it)."""
    if found.kind == "deepspeed":
        return _read_deepspeed(found, trust, with_optimizer)
    if found.kind == "universal":
        return universal_form.read(found, trust, with_optimizer)
    return _read_megatron(found, trust)


def header(found: Found, trust: bool) -> tuple[dict, int, int]:
    """(model fields, padded vocab size, TP size) from the first model file alone (the preflight check)."""
    a = first_args(found, trust)
    return model_fields(a), int(a["padded_vocab_size"]), int(a.get("tensor_model_parallel_size", 1))


def first_args(found: Found, trust: bool) -> dict:
    """Upstream's parsed flags (``args``) as a dict, from the first model file."""
    if found.kind in ("deepspeed", "universal"):
        path = os.path.join(found.path, _mp_files(found.path)[0][1])
    else:
        path = os.path.join(found.path, sorted(d for d in os.listdir(found.path) if ITER_RANK.match(d))[0],
                            "model_optim_rng.pt")
    return args_of(load_file(path, trust), path)


def _mp_files(path: str) -> list[tuple[int, str]]:
    """(model-parallel rank, file name) of a global_stepN/'s model files, which hold the run's state."""
    mp_files = sorted((int(m.group(1)), f) for f in os.listdir(path) if (m := MP_FILE.match(f)))
    if not mp_files:
        raise CheckpointError(f"checkpoint {path} has no mp_rank_XX_model_states.pt: the run's state is missing")
    return mp_files


def _read_deepspeed(found: Found, trust: bool, with_optimizer: bool) -> Converted:
    path = found.path
    mp_files = _mp_files(path)
    states = {r: load_file(os.path.join(path, f), trust) for r, f in mp_files}  # pipeline: args/RNG only
    first_file, first = os.path.join(path, mp_files[0][1]), states[mp_files[0][0]]
    a = args_of(first, first_file)
    tp, pp = int(a.get("tensor_model_parallel_size", 1)), int(a.get("pipeline_model_parallel_size", 1))
    fields = model_fields(a)
    layer_files = sorted(glob.glob(os.path.join(path, "layer_*-model_*-model_states.pt")))
    expert_files = ds_expert_files(path)
    per_tp: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    roles: dict[int, str] = {}
    if expert_files and pp > 1:  # DeepSpeed's pipeline engine with MoE: each stage's module in its mp_rank file
        roles, modules = _pipe_moe_roles(states, path, mp_files)
        for rank, module in sorted(modules.items()):
            for k, v in module.items():
                # the tied embedding sits on the first and last stage: the first stage's is the one trained
                # (the last stage's position embeddings are a stale copy)
                if (n := from_upstream_pipe(k, roles)) is not None and torch.is_tensor(v):
                    per_tp[rank % tp].setdefault(n, v)
    elif layer_files:  # DeepSpeed's pipeline engine (upstream's default under --deepspeed, even at PP=1)
        roles = pipe_roles(layer_files)
        for f in layer_files:
            m = LAYER_FILE.match(os.path.basename(f))
            idx, rank = int(m.group(1)), int(m.group(2))
            for k, v in safe_load(f).items():
                name = from_upstream_pipe(f"{idx}.{k}", roles)
                if name is not None and torch.is_tensor(v):
                    per_tp[rank][name] = v
    else:
        if len(mp_files) != tp:
            raise CheckpointError(f"checkpoint {path} has {len(mp_files)} mp_rank_XX_model_states.pt files for "
                                  f"--tensor-model-parallel-size {tp}: the checkpoint is incomplete")
        for rank, fname in mp_files:
            module = _module(states[rank], os.path.join(path, fname))
            # state_dict_for_save_checkpoint nests {language_model: {embedding: .., encoder: ..}}: flatten it
            # DeepSpeed 0.19.8 leaves upstream's lifted "encoderlayers.N...experts..." copies of this rank's experts
            # in the model file: the per-expert files hold them all (from_upstream skips these names)
            per_tp[rank] = {n: v for k, v in flatten(module).items()
                            if (n := from_upstream(k)) is not None and torch.is_tensor(v)}
    for _, _, mp, f in expert_files:  # DeepSpeed's per-expert files: names carry the global expert index
        for k, v in safe_load(f).items():
            n = from_upstream_pipe(k, roles) if roles else from_upstream(k)
            if n is not None and torch.is_tensor(v):
                per_tp[mp % tp][n] = v
    weights = merge_ranks(per_tp, fields)
    if roles:  # the pipeline engine's checkpoint: its final norm is never 1p
        weights = pipe_final_norm_to_ours(weights, fields)
    sched = first.get("lr_scheduler") or {}
    gbs = int(a["global_batch_size"])
    out = Converted(
        weights=weights, padded_vocab_size=int(a["padded_vocab_size"]), model=fields,
        iteration=int(first.get("iteration", found.iteration)),
        consumed_samples=int(a.get("consumed_train_samples", 0)),
        lr_num_steps=int(sched.get("num_steps", 0)) // gbs if sched else int(first.get("iteration", 0)),
        layout={"tp": tp, "pp": pp, "dp": int(a.get("data_parallel_size", 1)),
                "zero_stage": int(a.get("zero_stage", 0)) if a.get("deepspeed") else 0, "ep": fields["moe"]["ep"]},
        rng_states=[list(states[r].get("rng_state") or []) for r, _ in mp_files])
    if with_optimizer and not layer_files and not glob.glob(os.path.join(path, "*_optim_states.pt")):
        out.moments, out.optimizer_step, out.optimizer_note = zero0_moments(states, tp, fields, path)
    elif with_optimizer:
        shapes = {r: s.get("param_shapes") or [] for r, s in states.items()}
        out.moments, out.optimizer_step, out.optimizer_note = zero12_moments(
            path, tp, roles, fields, shapes, experts_per_layer(weights))
    return out


def _pipe_moe_roles(states: dict, path: str, mp_files) -> tuple[dict[int, str], dict[int, dict]]:
    """(pipeline layer index -> role, {model-parallel rank: module}) of a pipeline-engine MoE checkpoint, whose
    mp_rank files hold each stage's engine-level module (``2.self_attention...``, ``tied_modules.embed...``)."""
    modules, keys = {}, {}
    for rank, fname in mp_files:
        modules[rank] = module = _module(states[rank], os.path.join(path, fname))
        for k in module:
            idx, _, rest = k.partition(".")
            if idx.isdigit():
                keys.setdefault(int(idx), set()).add(rest)
    return pipe_roles_from_keys(keys), modules


def _module(state: dict, path: str) -> dict:
    """The weights of one Megatron-DeepSpeed model file (``module``)."""
    module = state.get("module")
    if not isinstance(module, dict):
        raise CheckpointError(f"checkpoint file {path} holds no 'module' weights")
    return module


def _read_megatron(found: Found, trust: bool) -> Converted:
    """Plain Megatron ``iter_N/mp_rank_XX[_YYY]/model_optim_rng.pt``: weights; its optimizer keeps no parameter
    names (an index per Megatron param group), so Adam restarts."""
    ranks = {}
    for d in os.listdir(found.path):
        m = ITER_RANK.match(d)
        if m and os.path.isfile(os.path.join(found.path, d, "model_optim_rng.pt")):
            ranks[(int(m.group(1)), int(m.group(2) or 0))] = os.path.join(found.path, d, "model_optim_rng.pt")
    if not ranks:
        raise CheckpointError(f"{found.path} holds no mp_rank_XX[_YYY]/model_optim_rng.pt")
    states = {k: load_file(p, trust) for k, p in sorted(ranks.items())}
    first_path = ranks[min(ranks)]
    a = args_of(states[min(ranks)], first_path)
    tp, pp = int(a.get("tensor_model_parallel_size", 1)), int(a.get("pipeline_model_parallel_size", 1))
    if len(ranks) != tp * pp:
        raise CheckpointError(f"{found.path} has {len(ranks)} mp_rank directories for TP {tp} x PP {pp}: incomplete")
    fields = model_fields(a)
    # Megatron's own pipeline numbers each stage's layers from 0; --standalone-embedding-stage leaves stage 0 none
    first_layer = [0, *split_layers(fields["num_layers"], pp, bool(a.get("standalone_embedding_stage")))]
    first_layer = [sum(first_layer[:stage + 1]) for stage in range(pp)]
    per_tp: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    for (t, stage), state in states.items():
        model = state.get("model") or state.get("model0")
        if not isinstance(model, dict):
            raise CheckpointError(f"checkpoint file {ranks[(t, stage)]} holds no 'model' (a virtual-pipeline "
                                  "checkpoint? convert it with the same --virtual-pipeline layout first)")
        for k, v in flatten(model).items():
            if (n := from_upstream(k, first_layer[stage])) is not None and torch.is_tensor(v):
                per_tp[t][n] = v
    weights = merge_ranks(per_tp, fields)
    first = states[min(ranks)]
    sched = first.get("opt_param_scheduler") or first.get("lr_scheduler") or {}
    gbs = int(a.get("global_batch_size") or 1)
    return Converted(
        weights=weights, padded_vocab_size=int(a["padded_vocab_size"]), model=fields,
        iteration=int(first.get("iteration", found.iteration)),
        consumed_samples=int(a.get("consumed_train_samples", 0)),
        lr_num_steps=int(sched.get("num_steps", 0)) // gbs if sched else int(first.get("iteration", 0)),
        layout={"tp": tp, "pp": pp, "dp": int(a.get("data_parallel_size", 1)), "zero_stage": 0,
                "ep": fields["moe"]["ep"]},
        optimizer_note="a plain Megatron optimizer keeps no parameter names: Adam restarts",
        rng_states=[list(s.get("rng_state") or []) for _, s in sorted(states.items())])
