"""The full (unsharded) model: merge a DeepSpeed checkpoint of any TP/PP/ZeRO layout into one state dict
under GPTModel's parameter names, and shard such a state dict into a model of any layout.

Canonical names are GPTModel's (``embedding.word_embeddings.weight``, ``layers.N.mlp.dense_h_to_4h.weight``,
``output_layer.linear.weight``, ...). Vocabulary rows are stored *unpadded* (``vocab_size`` rows), because the
padding depends on the TP size (Megatron pads to a multiple of divisible-by x TP).

A "full-state" directory (written by tools/reshard_checkpoint.py and tools/convert_hf_to_megatron.py) holds
``model.safetensors`` plus ``full_state.json`` (model config, iteration, consumed samples, LR position) and
can be passed to ``--load`` at any layout.
"""

from __future__ import annotations

import glob
import json
import os
import re
import tempfile

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from megatron.checkpointing import experts, integrity
from megatron.checkpointing import hierarchical_zero as hzero_ckpt
from megatron.checkpointing.safe_io import safe_load
from megatron.core.tensor_parallel.layers import shard_tensor
from megatron.errors import CheckpointError

FULL_STATE_META = "full_state.json"
FULL_STATE_WEIGHTS = "model.safetensors"
FULL_STATE_OPTIMIZER = "optimizer.safetensors"
VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.linear.weight")


def canonical_name(name: str, num_layers: int) -> str | None:
    """GPTModel's name for a parameter of GPTModel or GPTModelPipe (None: not a stored weight)."""
    if name.startswith("tied_modules.embed."):
        name = "0." + name[len("tied_modules.embed."):]
    m = re.match(r"^(\d+)\.(.+)$", name)
    if not m:
        return name
    idx, rest = int(m.group(1)), m.group(2)
    if idx == 0:
        return None if rest.startswith("head.") else f"embedding.{rest}"
    if idx <= num_layers:
        return f"layers.{idx - 1}.{rest}"
    return f"final_layernorm.{rest}" if idx == num_layers + 1 else f"output_layer.{rest}"


def partition_table(module: torch.nn.Module, num_layers: int) -> dict[str, list[int]]:
    """{canonical name: [partition_dim, stride]} of this rank's TP-sharded parameters."""
    return {canonical_name(n, num_layers): [int(p.partition_dim), int(getattr(p, "partition_stride", 1))]
            for n, p in module.named_parameters() if getattr(p, "tensor_model_parallel", False)
            and canonical_name(n, num_layers) is not None}


def merge_tp(shards: list[torch.Tensor], dim: int, stride: int) -> torch.Tensor:
    """Inverse of ``shard_tensor``: each shard holds its slice of each of ``stride`` stacked blocks."""
    if len(shards) == 1:
        return shards[0]
    blocks = [s.chunk(stride, dim=dim) for s in shards]
    return torch.cat([torch.cat([b[k] for b in blocks], dim=dim) for k in range(stride)], dim=dim)


def _tp_rank_states(ckpt_dir: str, meta: dict) -> list[dict[str, torch.Tensor]]:
    """One canonical state dict per TP rank (each still TP-sharded, vocab padded)."""
    if meta.get("format") == hzero_ckpt.FORMAT:  # per-rank shard files of hierarchical ZeRO, no DeepSpeed layout
        nl = meta["run"]["model"]["num_layers"]
        return [{canonical_name(k, nl): v for k, v in w.items()}
                for w in hzero_ckpt.merged_tp_states(ckpt_dir, meta, with_moments=False)[0]]
    p = meta["run"]["parallel"]
    tp, pp, zero = p["tensor_model_parallel_size"], p["pipeline_model_parallel_size"], p["zero_stage"]
    nl = meta["run"]["model"]["num_layers"]
    states: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    if pp > 1 and experts.expert_files(ckpt_dir):
        return _pipeline_moe_states(ckpt_dir, tp, pp, nl)
    if pp > 1:
        files = sorted(glob.glob(os.path.join(ckpt_dir, "layer_*-model_states.pt")))
        if not files:
            raise CheckpointError(f"checkpoint {ckpt_dir} has no pipeline layer files (layer_*-model_states.pt)")
        for f in files:
            m = re.match(r"layer_(\d+)(?:-model_(\d+))?-model_states\.pt$", os.path.basename(f))
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
            module = safe_load(os.path.join(ckpt_dir, f"mp_rank_{rank:02d}_model_states.pt"))["module"]
        states[rank] = {n: v for k, v in module.items() if (n := canonical_name(k, nl)) is not None}
    for _, _, mp, f in experts.expert_files(ckpt_dir):  # DeepSpeed's per-expert files: global expert indices
        states[mp % tp].update({n: v for k, v in safe_load(f).items() if (n := canonical_name(k, nl)) is not None})
    return states


def _pipeline_moe_states(ckpt_dir: str, tp: int, pp: int, nl: int) -> list[dict[str, torch.Tensor]]:
    """DeepSpeed's layout for a pipeline with experts: no layer files; each stage's dense weights in
    mp_rank_XX_model_states.pt (XX = stage x TP + TP rank, the rank among the pipeline grid's model-parallel ranks)
    and one file per expert (tensors named by their pipeline layer index, experts by global id)."""
    states: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    for mp in range(pp * tp):  # stage 0 first: a tied embedding's first-stage copy wins (the last stage's copy of
        # the position embeddings takes no gradient there, so it is stale)
        path = os.path.join(ckpt_dir, f"mp_rank_{mp:02d}_model_states.pt")
        if not os.path.isfile(path):
            raise CheckpointError(f"checkpoint file {path} is missing: stage {mp // tp}, TP rank {mp % tp} of a "
                                  f"PP={pp} x TP={tp} checkpoint with experts")
        for k, v in safe_load(path)["module"].items():
            name = canonical_name(k, nl)
            if name is not None and v is not None:
                states[mp % tp].setdefault(name, v)
    for _, _, mp, f in experts.expert_files(ckpt_dir):
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


def merge_checkpoint(ckpt_dir: str, meta: dict) -> dict[str, torch.Tensor]:
    """The full model of a DeepSpeed checkpoint directory (``DIR/global_stepN``), vocab unpadded."""
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
    return experts.with_expert(name, 0) if experts.expert_index(name) is not None else None


def load_into_model(module: torch.nn.Module, full: dict[str, torch.Tensor], num_layers: int, tp_size: int,
                    tp_rank: int, source: str) -> None:
    """Copy this rank's shard of every full tensor into ``module`` (GPTModel or a GPTModelPipe stage),
    padding the vocabulary rows with zeros to the module's padded size; experts by global index (this rank's EP
    share). Call before deepspeed.initialize."""

    offsets = experts.expert_offsets(module)
    with torch.no_grad():
        for n, p in module.named_parameters():
            name = canonical_name(n, num_layers)
            if name is None:
                continue
            name = experts.globalize(n, name, offsets)
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


def save_full_state(out_dir: str, full: dict[str, torch.Tensor], meta: dict,
                    moments: dict[str, dict[str, torch.Tensor]] | None = None) -> None:
    """Write a full-state directory: safetensors weights (and Adam moments, ``optimizer.safetensors`` with keys
    ``exp_avg/NAME``, ``exp_avg_sq/NAME``; the step is ``optimizer_step`` in the JSON), then the JSON that marks
    it complete."""
    os.makedirs(out_dir, exist_ok=True)
    weights = os.path.join(out_dir, FULL_STATE_WEIGHTS)
    integrity.write_safetensors({k: v.contiguous() for k, v in full.items()}, weights)
    optim = os.path.join(out_dir, FULL_STATE_OPTIMIZER)
    if moments:
        integrity.write_safetensors({f"{k}/{name}": v.float().contiguous() for name, m in moments.items()
                                     for k, v in m.items()}, optim)
    elif os.path.exists(optim):  # a stale file from an earlier conversion into the same directory
        os.remove(optim)
    # The manifest before the JSON that marks the directory complete (the JSON's entry is known in advance).
    text = json.dumps(meta, indent=1, sort_keys=True).encode()
    integrity.record(os.path.join(out_dir, FULL_STATE_META), len(text), integrity.digest(text))
    integrity.write_manifest(out_dir, integrity.recorded(out_dir))
    integrity.write_bytes(os.path.join(out_dir, FULL_STATE_META), text, record=False)


def is_full_state(path: str) -> bool:
    return os.path.isfile(os.path.join(path, FULL_STATE_META))


def read_full_state(path: str) -> tuple[dict[str, torch.Tensor], dict]:
    meta_path, weights = os.path.join(path, FULL_STATE_META), os.path.join(path, FULL_STATE_WEIGHTS)
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint file {meta_path} is unreadable ({e})") from None
    if not os.path.isfile(weights):
        raise CheckpointError(f"checkpoint file {weights} is missing")
    try:
        return load_file(weights), meta
    except (SafetensorError, OSError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint file {weights} is corrupt or truncated ({str(e).splitlines()[0]})") from None


def read_full_moments(path: str) -> tuple[dict[str, dict[str, torch.Tensor]], int] | None:
    """(moments by name, Adam step) of a full-state directory, or None when it carries none."""
    optim = os.path.join(path, FULL_STATE_OPTIMIZER)
    if not os.path.isfile(optim):
        return None
    _, meta = read_full_state_meta(path)
    try:
        flat = load_file(optim)
    except (SafetensorError, OSError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint file {optim} is corrupt or truncated ({str(e).splitlines()[0]})") from None
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, v in flat.items():
        kind, name = key.split("/", 1)
        out.setdefault(name, {})[kind] = v
    return out, int(meta.get("optimizer_step", 0))


def read_full_state_meta(path: str) -> tuple[str, dict]:
    meta_path = os.path.join(path, FULL_STATE_META)
    try:
        with open(meta_path) as f:
            return meta_path, json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint file {meta_path} is unreadable ({e})") from None
