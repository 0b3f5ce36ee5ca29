"""A full state into a model of any layout: each rank copies its TP slice of every weight (vocabulary rows
zero-padded to the model's padded size; experts by global index, this rank's EP share) into the model before
deepspeed.initialize, and its share of the full Adam moments into any engine's optimizer after it.

Moments go into hierarchical ZeRO, DeepSpeed ZeRO-1/2/bf16 (through each parameter's ``_hp_mapping``) and plain
torch AdamW (ZeRO-0 fp32, with or without pipeline); ZeRO-3 restarts them, with a warning.
"""

from __future__ import annotations

import torch

from megatron import ds_seams
from megatron.checkpointing.ds_layout.read import KEYS, Moments
from megatron.checkpointing.hzero import shards as hzero_shards
from megatron.core.tensor_parallel.layers import shard_tensor
from megatron.errors import CheckpointError
from megatron.model.param_names import VOCAB_PARAMS, canonical_name, expert_offsets, globalize


def load_into_model(module: torch.nn.Module, full: dict[str, torch.Tensor], num_layers: int, tp_size: int,
                    tp_rank: int, source: str) -> None:
    """Copy this rank's shard of every full tensor into ``module`` (GPTModel or a GPTModelPipe stage),
    padding the vocabulary rows with zeros to the module's padded size; experts by global index (this rank's EP
    share). Call before deepspeed.initialize."""

    offsets = expert_offsets(module)
    with torch.no_grad():
        for n, p in module.named_parameters():
            name = canonical_name(n, num_layers)
            if name is None:
                continue
            name = globalize(n, name, offsets)
            if name not in full:
                raise CheckpointError(f"{source} has no tensor {name}: it was saved from a different model variant")
            p.copy_(shard_like(name, full[name], p, p.shape, tp_size, tp_rank, source).to(p.dtype))


def shard_like(name: str, t: torch.Tensor, p: torch.nn.Parameter, shape, tp_size: int, tp_rank: int,
               source: str) -> torch.Tensor:
    """This rank's piece of the full tensor ``t`` for parameter ``p`` of ``shape`` (given apart from ``p``: a
    ZeRO engine may have freed its data): the TP slice, vocabulary rows zero-padded to the padded size."""

    sharded = getattr(p, "tensor_model_parallel", False)
    dim = int(p.partition_dim) if sharded else 0
    if name in VOCAB_PARAMS:
        rows = shape[0] * (tp_size if sharded else 1)
        t = torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if rows > t.shape[0] else t
    if sharded:
        t = shard_tensor(t, dim, tp_size, tp_rank, int(getattr(p, "partition_stride", 1)))
    if tuple(t.shape) != tuple(shape):
        raise CheckpointError(f"{source}: {name} has shape {tuple(t.shape)} for this rank, the model expects "
                              f"{tuple(shape)}")
    return t


def load_moments(engine, moments: Moments, step: int, tp_size: int, tp_rank: int, num_layers: int,
                 source: str) -> str:
    """Fill ``engine``'s optimizer with this rank's share of ``moments``; returns what was done, for the log."""

    def shard(name: str, shape, param, full: torch.Tensor) -> torch.Tensor:
        return shard_like(name, full, param, shape, tp_size, tp_rank, source)

    if hzero_shards.is_engine(engine):
        hzero_shards.set_full_moments(engine, moments, step,
                                      lambda name, shape, full: shard(name, shape, _param(engine, name), full))
        return "Adam moments loaded"
    offsets = expert_offsets(engine.module)  # experts under their global index, as the full state keeps them
    named = [(globalize(n, c, offsets), p) for n, p in engine.module.named_parameters()
             if (c := canonical_name(n, num_layers)) is not None]
    missing = [c for c, _ in named if c not in moments]
    if missing:
        raise CheckpointError(f"{source} has no Adam moments for {missing[0]}: saved from a different model variant")
    opt = engine.optimizer
    base = getattr(opt, "optimizer", opt)
    # ZeRO-1/2 and the bf16 optimizer link every parameter (_hp_mapping None: no slice of it in this DP partition).
    if any(ds_seams.is_hp_linked(p) for _, p in named):
        for group in base.param_groups:
            flat = group["params"][0]
            base.state[flat] = {"step": torch.tensor(float(step)),
                                **{k: torch.zeros_like(flat, dtype=torch.float32) for k in KEYS}}
        for name, p in named:
            hp = ds_seams.hp_mapping(p)
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
