"""Slices of a source checkpoint into this rank's model and optimizer: each parameter's TP shard into the model before
deepspeed.initialize; after it, the flat range ZeRO-1/2 or the bf16 optimizer gave this rank of each parameter's fp32
master weights and Adam moments (its ``_hp_mapping``), ZeRO-3's partition of each parameter (through DeepSpeed's
public safe_set_local_*), or whole shards into torch AdamW (ZeRO-0)."""

from __future__ import annotations

import math

import torch
from deepspeed.utils import safe_set_local_fp32_param, safe_set_local_optimizer_state

from megatron import ds_seams
from megatron.checkpointing.ds_layout.slices import MOMENTS, DeepSpeedSource
from megatron.checkpointing.hzero import shards
from megatron.checkpointing.relayout.coords import Split, blocks, clip, copy
from megatron.errors import CheckpointError
from megatron.model.param_names import VOCAB_PARAMS, canonical_name, expert_offsets, globalize


def named_parameters(module: torch.nn.Module, num_layers: int) -> list[tuple[str, torch.nn.Parameter]]:
    """(full-state name, parameter): our names, experts under their global index."""
    offsets = expert_offsets(module)
    return [(globalize(n, c, offsets), p) for n, p in module.named_parameters()
            if (c := canonical_name(n, num_layers)) is not None]


def target_split(p: torch.nn.Parameter, tp_size: int, local: tuple[int, ...] | None = None) -> Split:
    """How this run cuts ``p`` over TP (its attributes from megatron/core/tensor_parallel); ``local``: its TP
    shard's shape where ``p`` no longer shows it (ZeRO-3 partitioned it)."""
    local = tuple(p.shape) if local is None else tuple(local)
    if not getattr(p, "tensor_model_parallel", False):
        return Split(local, None)
    dim = int(p.partition_dim)
    shape = tuple(n * tp_size if i == dim else n for i, n in enumerate(local))
    return Split(shape, dim, int(getattr(p, "partition_stride", 1)), tp_size)


class Reader:
    """Copies from ``source`` into flat target buffers of TP rank ``tp_rank``, counting the bytes read."""

    def __init__(self, source: DeepSpeedSource, tp_rank: int) -> None:
        self.source, self.tp_rank = source, tp_rank
        self.bytes = 0
        self._splits: dict[str, Split] = {}

    def source_split(self, name: str, target: Split) -> Split:
        """The source's cut of ``name``: this run's, over the source's TP size, with its own vocabulary padding."""
        if name not in self._splits:
            shard = self.source.shard_shape(name, 0)
            tp = self.source.tp
            full = tuple(n * tp if i == target.dim else n for i, n in enumerate(shard))
            differs = [i for i, (a, b) in enumerate(zip(full, target.shape, strict=False)) if a != b]
            if len(full) != len(target.shape) or differs and (name not in VOCAB_PARAMS or differs != [0]):
                raise CheckpointError(f"{self.source.dir}: {name} has shape {full} in the checkpoint, this model "
                                      f"{target.shape}: saved from a different model variant")
            self._splits[name] = Split(full, target.dim, target.stride, tp)
        return self._splits[name]

    def fill(self, name: str, kind: str, target: Split, a: int, b: int, dst: torch.Tensor) -> None:
        """``dst`` (flat) := elements ``[a, b)`` of this rank's shard of ``name``'s ``kind``. Vocabulary rows the
        source lacks are zero."""
        source = self.source_split(name, target)
        if source.shape != target.shape:
            dst.zero_()
        copied = 0
        for block in blocks(target, self.tp_rank, a, b, source):
            for piece in self.source.pieces(name, kind, block.src_rank):
                for part in clip(block, piece.start, piece.start + piece.tensor.numel()):
                    copy(part, dst, a, piece.tensor, piece.start)
                    copied += part.numel()
                    self.bytes += part.numel() * piece.tensor.element_size()
        if source.shape == target.shape and copied != b - a:
            raise CheckpointError(f"{self.source.dir}: the {kind} slices of {name} cover {copied} of the {b - a} "
                                  "elements this rank needs: the checkpoint's ZeRO files are incomplete")


def load_weights(module: torch.nn.Module, reader: Reader, num_layers: int, tp_size: int) -> None:
    """Before deepspeed.initialize: every parameter's TP shard from the source."""
    with torch.no_grad():
        for name, p in named_parameters(module, num_layers):
            reader.fill(name, "weight", target_split(p, tp_size), 0, p.numel(), p.data.view(-1))


def load_optimizer(engine, reader: Reader, num_layers: int, tp_size: int, step: int, moments: bool) -> str:
    """After deepspeed.initialize: this rank's part of the fp32 master weights (where the source has them) and, with
    ``moments``, of the Adam moments at ``step``. Returns what was loaded, for the log."""
    params = named_parameters(engine.module, num_layers)
    opt = engine.optimizer
    base = getattr(opt, "optimizer", opt)
    master = reader.source.has_master
    named = [(n, p, target_split(p, tp_size)) for n, p in params]
    with torch.no_grad():
        if shards.is_engine(engine):
            _load_hzero(engine, reader, params, tp_size, step, moments)
        elif any(ds_seams.zero3_part(p) is not None for _, p in params):
            _load_zero3(opt, base, params, reader, tp_size, step, master, moments)
        elif any(ds_seams.is_hp_linked(p) for _, p, _ in named):  # ZeRO-1/2, the bf16 optimizer: flat partitions
            if moments:
                for group in base.param_groups:
                    flat = group["params"][0]
                    base.state[flat] = {"step": _step(group, flat, step),
                                        **{k: torch.zeros_like(flat, dtype=torch.float32) for k in MOMENTS}}
            for name, p, split in named:
                hp = ds_seams.hp_mapping(p)
                if hp is None:  # no slice of it in this rank's partition
                    continue
                flat = base.param_groups[hp.param_group_index]["params"][0]
                a, b = hp.lp_fragment_address.start, hp.lp_fragment_address.start + hp.lp_fragment_address.numel
                at, n = hp.hp_fragment_address.start, hp.hp_fragment_address.numel
                if master:
                    reader.fill(name, "master", split, a, b, flat.narrow(0, at, n))
                for k in MOMENTS if moments else ():
                    reader.fill(name, k, split, a, b, base.state[flat][k].narrow(0, at, n))
        elif isinstance(base, torch.optim.Optimizer):  # ZeRO-0 fp32: torch AdamW over the parameters themselves
            groups = {id(p): g for g in base.param_groups for p in g["params"]}
            for name, p, split in named if moments else ():
                state = {k: torch.zeros(p.numel(), dtype=torch.float32, device=p.device) for k in MOMENTS}
                for k in MOMENTS:
                    reader.fill(name, k, split, 0, p.numel(), state[k])
                base.state[p] = {"step": _step(groups[id(p)], p, step),
                                 **{k: v.view(p.shape) for k, v in state.items()}}
        else:
            raise CheckpointError(f"{reader.source.dir}: this engine's optimizer ({type(base).__name__}) takes no "
                                  "per-parameter state; pass --no-load-optim")
    what = ["weights"] + (["fp32 master weights"] if master else [])
    return ", ".join(what + [f"Adam moments at step {step}"] if moments else what)


def _load_zero3(opt, base: torch.optim.Optimizer, params: list, reader: Reader, tp_size: int, step: int,
                master: bool, moments: bool) -> None:
    """ZeRO-3: of each parameter the partition this rank holds (its padding stays zero), through DeepSpeed's public
    safe_set_local_fp32_param / safe_set_local_optimizer_state. torch AdamW creates its state at the first step:
    with ``moments`` it is created here, on ZeRO-3's flat fp32 partitions, before those setters write into it."""
    if moments:
        for flat in ds_seams.zero3_fp32_partitions(opt):
            base.state[flat] = {"step": _step(base.param_groups[0], flat, step),
                                **{k: torch.zeros_like(flat, dtype=torch.float32) for k in MOMENTS}}
    for name, p in params:
        part = ds_seams.zero3_part(p)
        split = target_split(p, tp_size, part.shape)
        a, b = part.start, min(part.start + part.size, math.prod(part.shape))
        held = torch.zeros(part.size, dtype=torch.float32)
        for kind in (("master",) if master else ()) + (MOMENTS if moments else ()):
            if a < b:  # else this rank's partition of ``p`` is all padding
                reader.fill(name, kind, split, a, b, held.narrow(0, 0, b - a))
            if kind == "master":
                safe_set_local_fp32_param(p, held)
            else:
                safe_set_local_optimizer_state(p, held, kind)


def _load_hzero(engine, reader: Reader, params: list, tp_size: int, step: int, moments: bool) -> None:
    """Hierarchical ZeRO: this rank's primary chunk of every bucket (fp32 master weights, AdamW's state at ``step``);
    then the 16-bit secondary shards are rebuilt from the masters (collective), as after an optimizer step."""
    names = {id(p): n for n, p in params}
    held = {"master": engine.master.data} | (
        {k: torch.zeros_like(engine.master.data) for k in MOMENTS} if moments else {})
    pos = 0
    for b, (start, length) in zip(engine.buckets, shards.primary_ranges(engine), strict=True):
        off = b.offset
        for p, shape in zip(b.params, b.shapes, strict=True):
            lo, hi = max(off, start), min(off + shape.numel(), start + length)
            if lo < hi:  # part of ``p`` lies in this rank's chunk (the rest of the chunk is padding)
                split = target_split(p, tp_size, tuple(shape))
                for kind, dst in held.items():
                    reader.fill(names[id(p)], kind, split, lo - off, hi - off, dst.narrow(0, pos + lo - start, hi - lo))
            off += shape.numel()
        pos += length
    if moments:
        base = engine.optimizer
        base.state[engine.master] = {"step": _step(base.param_groups[0], engine.master, step),
                                     **{k: held[k] for k in MOMENTS}}
    engine.refresh_secondary()


def _step(group: dict, param: torch.Tensor, step: int) -> torch.Tensor:
    """torch AdamW's step counter; the fused and capturable kernels keep it on the parameter's device."""
    device = param.device if group.get("fused") or group.get("capturable") else "cpu"
    return torch.tensor(float(step), dtype=torch.float32, device=device)
