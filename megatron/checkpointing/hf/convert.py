"""Conversions between checkpoint kinds (used by tools/): DeepSpeed checkpoint of any layout -> full state
-> HF directory, HF directory -> full state. A full state loads at any TP/PP/ZeRO layout via ``--load``."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file

from megatron.checkpointing.full_state.files import (
    is_full_state,
    read_full_moments,
    read_full_state,
    save_full_state,
)
from megatron.checkpointing.full_state.merge import merge_checkpoint, merge_moments
from megatron.checkpointing.hf.dense import NEMOTRON, from_hf, special_token_ids, to_hf, variant
from megatron.checkpointing.hf.moe import MIXTRAL, QWEN2_MOE, has_experts, moe_from_hf, moe_to_hf
from megatron.checkpointing.hf.nemotron import nemotron_from_hf, nemotron_to_hf
from megatron.checkpointing.live import integrity
from megatron.checkpointing.live.markers import META, read_latest, read_meta
from megatron.checkpointing.live.verify import require_whole
from megatron.errors import CheckpointError


def read_any(path: str, tag: str | None = None) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """(full state, model config fields, progress {iteration, consumed_samples, lr_num_steps}) of a
    ``--save`` directory (its ``latest`` tag unless ``tag``), one tag directory, or a full-state directory."""
    if is_full_state(path):
        require_whole(path)
        full, meta = read_full_state(path)
        progress = {k: meta.get(k, 0) for k in ("iteration", "consumed_samples", "lr_num_steps")}
        if meta.get("lr_scheduler"):
            progress["lr_scheduler"] = meta["lr_scheduler"]
        return full, meta["model"], progress
    if tag is None and not os.path.isfile(os.path.join(path, META)):
        tag = read_latest(path)
        if tag is None:
            raise CheckpointError(f"{path}: no 'latest' file and no {META}: not a checkpoint directory")
    ckpt_dir = os.path.join(path, tag) if tag else path
    meta = read_meta(ckpt_dir)
    require_whole(ckpt_dir)
    progress = {"iteration": meta["iteration"], "consumed_samples": meta["consumed_samples"],
                "lr_num_steps": meta.get("lr_num_steps", meta["iteration"])}
    if meta.get("lr_scheduler"):
        progress["lr_scheduler"] = meta["lr_scheduler"]
    return merge_checkpoint(ckpt_dir, meta), meta["run"]["model"], progress


def write_full_state(out_dir: str, full: dict[str, torch.Tensor], model: dict, progress: dict, source: str,
                     moments: dict | None = None, optimizer_step: int = 0, special_tokens: dict | None = None) -> None:
    """``special_tokens``: {bos,eos}_token_id of an imported HF model, written back by an export."""
    extra = {"optimizer_step": optimizer_step} if moments else {}
    if special_tokens:
        extra["special_tokens"] = special_tokens
    save_full_state(out_dir, full, {"model": model, "source": source, **progress, **extra,
                                    "format": "megatron-frontier/full-state-v1"}, moments)


def read_moments(path: str, tag: str | None = None) -> tuple[dict | None, int, str]:
    """(full Adam moments by name, step, why not when None) of the same inputs as ``read_any``."""

    if is_full_state(path):
        got = read_full_moments(path)
        return (got[0], got[1], "") if got else (None, 0, "the full state carries no optimizer moments")
    if tag is None and not os.path.isfile(os.path.join(path, META)):
        tag = read_latest(path)
    ckpt_dir = os.path.join(path, tag) if tag else path
    return merge_moments(ckpt_dir, read_meta(ckpt_dir))


def write_hf(out_dir: str, full: dict[str, torch.Tensor], model: dict, special_tokens: dict | None = None) -> dict:
    """safetensors + config.json that ``AutoModelForCausalLM.from_pretrained(out_dir)`` loads;
    ``special_tokens`` ({bos,eos}_token_id) go into config.json (transformers warns without them)."""
    if has_experts(model):
        hf, config = moe_to_hf(full, model)
    else:
        hf, config = nemotron_to_hf(full, model) if variant(model) == NEMOTRON else to_hf(full, model)
    config.update(special_tokens or {})
    os.makedirs(out_dir, exist_ok=True)
    weights = os.path.join(out_dir, "model.safetensors")
    integrity.write_safetensors({k: v.float().contiguous() for k, v in hf.items()}, weights, metadata={"format": "pt"})
    integrity.write_bytes(os.path.join(out_dir, "config.json"), json.dumps(config, indent=2, sort_keys=True).encode())
    integrity.write_manifest(out_dir, integrity.recorded(out_dir))  # what tools/verify_checkpoint.py checks
    return config


def read_hf(hf_dir: str) -> tuple[dict[str, torch.Tensor], dict]:
    """A local HF model directory (config.json + model.safetensors or a sharded safetensors index)."""
    cfg_path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"{cfg_path} is missing: pass a local HF model directory")
    require_whole(hf_dir)  # an export of ours carries a manifest; one from the Hub does not
    with open(cfg_path) as f:
        config = json.load(f)
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(hf_dir, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise CheckpointError(f"{hf_dir} has no model.safetensors (pytorch_model.bin is not read: it is a pickle)")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        try:
            state.update(load_file(os.path.join(hf_dir, name)))
        except Exception as e:  # noqa: BLE001 - safetensors raises several error types; all mean a bad file
            raise CheckpointError(f"checkpoint file {os.path.join(hf_dir, name)} is unreadable "
                                  f"({str(e).splitlines()[0]})") from None
    return {k: v.float() for k, v in state.items()}, config


def hf_to_full_state(hf_dir: str, out_dir: str) -> dict:
    hf, config = read_hf(hf_dir)
    mt = config.get("model_type")
    convert = moe_from_hf if mt in (MIXTRAL, QWEN2_MOE) else nemotron_from_hf if mt == NEMOTRON else from_hf
    full, model = convert(hf, config)
    write_full_state(out_dir, full, model, {"iteration": 0, "consumed_samples": 0, "lr_num_steps": 0}, hf_dir,
                     special_tokens=special_token_ids(config))
    return model
