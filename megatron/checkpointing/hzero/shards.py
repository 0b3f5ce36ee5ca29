"""Checkpoints of the hierarchical ZeRO engine: every rank writes and reads only its own shard file.

megatron/checkpointing/live/directory.py owns the protocol (temporary tag, fsync, rename, ``latest`` last,
retention, ``megatron_meta.json``); this module fills the temporary directory and reads it back (format.py wires it
in). Per rank, one file::

    DIR/global_stepN/hzero_rank_00003.pt   fp32 master shard, AdamW state (exp_avg, exp_avg_sq, step), the 16-bit
                                           secondary shards, the int8 error-feedback residual, LR position, RNG

Files are written through safe_io's SafeCheckpointEngine (torch.save hashed into the integrity manifest, fsync)
and read with its weights_only loader, as DeepSpeed's files are. Nothing is gathered: the secondary shards are
saved rather than re-gathered at load, so a resumed run starts from exactly the bytes the straight run holds
(bit-exact resume, also in bf16).

The metadata (``hierarchy`` in megatron_meta.json) records the layout the shards belong to: DP size, tiers with
their sizes, weights tier, int8 block, padded bucket layout with parameter names. resume_checks.py's
``check_resume`` compares it with a run's flags before any process group exists (another DP size, tiers or engine
is read in place by relayout/, through relayout/hzero_source.py); ``merged_tp_states``
rebuilds unsharded weights and Adam moments from the files without a process group (tools/reshard_checkpoint.py,
tools/convert_checkpoint_to_hf.py).
"""

from __future__ import annotations

import os

import torch

from megatron import ds_seams
from megatron.checkpointing.live import safe_io
from megatron.checkpointing.resume_checks import HZERO_RESHARD
from megatron.core.hierarchical_zero.engine import HierarchicalZeroEngine
from megatron.errors import CheckpointError, ConfigError


def shard_file(ckpt_dir: str, rank: int) -> str:
    return os.path.join(ckpt_dir, f"hzero_rank_{rank:05d}.pt")


def expected_files(meta: dict) -> list[str]:
    """The files of a checkpoint of these shards: one per rank (live/verify.py's layout without a manifest)."""
    p = (meta.get("run") or {}).get("parallel") or {}
    tp, pp = int(p.get("tensor_model_parallel_size", 1)), int(p.get("pipeline_model_parallel_size", 1))
    return [os.path.basename(shard_file("", r)) for r in range(int(p.get("world_size", tp * pp)))]


def is_engine(engine) -> bool:
    return isinstance(engine, HierarchicalZeroEngine)


def primary_ranges(engine) -> list[tuple[int, int]]:
    """(start, length) in the padded flat layout of each bucket's chunk that this rank's master shard holds."""
    h = engine.h
    count, idx = h.shard_count(h.levels), h.shard_index(h.levels)
    return [(b.offset + idx * (b.padded // count), b.padded // count) for b in engine.buckets]


def layout(engine, ranks_per_node: int | None) -> dict:
    """What the shards' meaning depends on (identical on every rank); stored as megatron_meta.json's ``hierarchy``."""
    names = {id(p): n for n, p in engine.module.named_parameters()}
    return {
        "levels": list(engine.cfg.levels),
        "level_sizes": {lv.name: lv.size for lv in engine.h.levels},
        "weights": engine.cfg.weights, "int8": engine.cfg.int8, "block": engine.cfg.block,
        "dp_size": engine.h.dp_size, "ranks_per_node": ranks_per_node, "padded": engine.padded,
        "buckets": [{"offset": b.offset, "padded": b.padded,
                     "params": [[names[id(p)], list(s)] for p, s in zip(b.params, b.shapes, strict=True)]}
                    for b in engine.buckets],
    }


def shard_table_entry(engine) -> dict:
    """This rank's place in the layout (gathered as plain data into the metadata, for offline merging)."""
    h = engine.h
    return {"tp_rank": engine.mpu.tp.rank, "dp_rank": engine.mpu.dp.rank,
            "shard_index": h.shard_index(h.levels), "shard_count": h.shard_count(h.levels)}


def save_shard(engine, tmp_dir: str, rank: int, rng: dict, save_optimizer: bool) -> None:
    """Write this rank's file into the temporary checkpoint directory (fsynced before it returns)."""
    os.makedirs(tmp_dir, exist_ok=True)
    state = {
        "master": engine.master.detach().clone(),
        "secondary": [b.secondary for b in engine.buckets],
        "residual": engine.residual,
        "scheduler": engine.lr_scheduler.state_dict(),
        "optimizer": engine.optimizer.state_dict() if save_optimizer else None,
        "steps": {"micro": engine.micro_steps, "global": engine.global_steps, "skipped": engine.skipped_steps},
        "rng": rng,
        **shard_table_entry(engine),
    }
    checkpoint_engine(engine).save(state, shard_file(tmp_dir, rank))


def checkpoint_engine(engine):
    """safe_io's engine (fsync on save, weights_only on load): the same code path as DeepSpeed's files."""
    if not isinstance(getattr(engine, "checkpoint_engine", None), safe_io.SafeCheckpointEngine):
        own = safe_io.SafeCheckpointEngine(None)
        own.zipfile_serialization = True  # the format validate_files' mmap check reads
        ds_seams.swap_checkpoint_engine(engine, own)
    return engine.checkpoint_engine


def check_engine_layout(engine, meta: dict, ranks_per_node: int | None, where: str) -> None:
    """After the engine exists: the saved tier sizes and bucket layout must be this run's (the flags were checked
    by ``check_resume``; this catches a different ranks per node or model variant)."""
    saved, now = meta["hierarchy"], layout(engine, ranks_per_node)
    for key, what in (("level_sizes", "tier sizes"), ("padded", "padded parameter count"),
                      ("buckets", "bucket layout")):
        if saved[key] != now[key]:
            raise ConfigError(f"--load {where}: hierarchical ZeRO shards were saved with {what} {_short(saved[key])}, "
                              f"this run has {_short(now[key])}. {HZERO_RESHARD.format(where=where)}")


def _short(x) -> str:
    text = str(x)
    return text if len(text) <= 80 else text[:77] + "..."


def load_shard(engine, ckpt_dir: str, rank: int, load_optimizer: bool, load_scheduler: bool) -> dict:
    """Restore this rank's state from its own file; returns the file's dict (its ``rng`` is applied later)."""
    path = shard_file(ckpt_dir, rank)
    state = checkpoint_engine(engine).load(path, map_location="cpu")
    if state.get("shard_index") != shard_table_entry(engine)["shard_index"]:
        raise CheckpointError(f"checkpoint file {path} holds shard {state.get('shard_index')}, this rank owns "
                              f"{shard_table_entry(engine)['shard_index']}: the files were renamed or mixed")
    with torch.no_grad():
        engine.master.copy_(state["master"])
        for b, sec in zip(engine.buckets, state["secondary"], strict=True):
            b.secondary = sec.to(device=engine.master.device, dtype=engine.dtype).clone()
        if engine.residual is not None:
            if state["residual"] is None:
                raise CheckpointError(f"checkpoint file {path} has no int8 error-feedback residual")
            engine.residual.copy_(state["residual"])
    if load_optimizer:
        if state["optimizer"] is None:
            raise CheckpointError(f"checkpoint file {path} was saved without optimizer (--no-save-optim); pass "
                                  "--no-load-optim")
        engine.optimizer.load_state_dict(state["optimizer"])
    if load_scheduler:  # after the optimizer: its param_groups carry a saved lr, the schedule decides
        engine.lr_scheduler.load_state_dict(state["scheduler"])
        s = state["steps"]
        engine.micro_steps, engine.global_steps, engine.skipped_steps = s["micro"], s["global"], s["skipped"]
    return state


# ---------------------------------------------------------------------------------------------- offline merge
def merged_tp_states(ckpt_dir: str, meta: dict, with_moments: bool = True) -> tuple[list[dict], list[dict], int]:
    """Without a process group: (per TP rank {name: weight}, per TP rank {name: {"exp_avg", "exp_avg_sq"}} (empty
    when the checkpoint has no optimizer or ``with_moments`` is false), Adam step). Names are the model's own
    (GPTModel), tensors still TP-sharded and vocab-padded, as DeepSpeed's model files hold them."""
    h, table = meta["hierarchy"], meta["shards"]
    tp = meta["run"]["parallel"]["tensor_model_parallel_size"]
    dp = h["dp_size"]
    flats = [{"master": torch.zeros(h["padded"])} for _ in range(tp)]
    step, have_moments = 0, with_moments and meta.get("has_optimizer", True)
    seen = [0] * tp
    for rank_text, entry in table.items():
        path = shard_file(ckpt_dir, int(rank_text))
        state = safe_io.safe_load(path)
        t, idx = entry["tp_rank"], entry["shard_index"]
        sources = {"master": state["master"]}
        if have_moments:
            opt = state["optimizer"]["state"].get(0)
            if opt is None:  # saved before the first step: nothing to carry
                have_moments = False
            else:
                sources.update(exp_avg=opt["exp_avg"], exp_avg_sq=opt["exp_avg_sq"])
                step = int(opt["step"])
        pos = 0
        for b in h["buckets"]:
            n = b["padded"] // dp
            for key, src in sources.items():
                dst = flats[t].setdefault(key, torch.zeros(h["padded"]))
                dst[b["offset"] + idx * n:b["offset"] + (idx + 1) * n] = src[pos:pos + n]
            pos += n
        seen[t] += 1
    if seen != [dp] * tp:
        raise CheckpointError(f"checkpoint {ckpt_dir}: expected {dp} shard files per TP rank, found {seen}")
    weights, moments = [], []
    for flat in flats:
        w, m = {}, {}
        for b in h["buckets"]:
            off = b["offset"]
            for name, shape in b["params"]:
                n = int(torch.Size(shape).numel())
                w[name] = flat["master"][off:off + n].view(shape).clone()
                if have_moments:
                    m[name] = {k: flat[k][off:off + n].view(shape).clone() for k in ("exp_avg", "exp_avg_sq")}
                off += n
        weights.append(w)
        moments.append(m)
    return weights, moments, step


def set_full_moments(engine, moments: dict[str, dict[str, torch.Tensor]], step: int, shard) -> None:
    """Fill this rank's AdamW state from full per-parameter moments (a resharded full state). ``shard(name, param,
    full)`` returns this rank's piece of a full tensor shaped as ``param`` (TP slice, vocab padding)."""
    flat = {k: torch.zeros(engine.padded) for k in ("exp_avg", "exp_avg_sq")}
    names = {id(p): n for n, p in engine.module.named_parameters()}
    for b in engine.buckets:
        off = b.offset
        for p, shape in zip(b.params, b.shapes, strict=True):
            n = shape.numel()
            for k in flat:
                flat[k][off:off + n] = shard(names[id(p)], shape, moments[names[id(p)]][k]).reshape(-1)
            off += n
    ranges = primary_ranges(engine)
    engine.optimizer.state[engine.master] = {
        "step": torch.tensor(float(step)),
        **{k: torch.cat([v[s:s + n] for s, n in ranges]).to(engine.master.device) for k, v in flat.items()}}
