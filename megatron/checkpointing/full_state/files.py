"""A full-state directory (written by tools/reshard_checkpoint.py and tools/convert_hf_to_megatron.py; ``--load`` at
any layout): ``model.safetensors`` under our names with the vocabulary unpadded, optionally the Adam moments in
``optimizer.safetensors``, then ``full_state.json`` (model config, iteration, consumed samples, LR position), which
marks it complete."""

from __future__ import annotations

import json
import os

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from megatron.checkpointing.live import integrity
from megatron.errors import CheckpointError

FULL_STATE_META = "full_state.json"
FULL_STATE_WEIGHTS = "model.safetensors"
FULL_STATE_OPTIMIZER = "optimizer.safetensors"


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
    _, meta = read_full_state_meta(path)
    weights = os.path.join(path, FULL_STATE_WEIGHTS)
    if not os.path.isfile(weights):
        raise CheckpointError(f"checkpoint file {weights} is missing")
    return _safetensors(weights), meta


def read_full_moments(path: str) -> tuple[dict[str, dict[str, torch.Tensor]], int] | None:
    """(moments by name, Adam step) of a full-state directory, or None when it carries none."""
    optim = os.path.join(path, FULL_STATE_OPTIMIZER)
    if not os.path.isfile(optim):
        return None
    _, meta = read_full_state_meta(path)
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, v in _safetensors(optim).items():
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


def _safetensors(path: str) -> dict[str, torch.Tensor]:
    try:
        return load_file(path)
    except (SafetensorError, OSError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint file {path} is corrupt or truncated ({str(e).splitlines()[0]})") from None
