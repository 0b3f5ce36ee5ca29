"""What an upstream checkpoint directory looks like: its markers, file names and the records read from it.

Two layouts are recognised in a ``--load`` directory (neither has our ``megatron_meta.json`` / ``full_state.json``):

* Megatron-DeepSpeed: ``latest`` (DeepSpeed's tag) and/or ``latest_checkpointed_iteration.txt`` (Megatron's
  iteration) next to ``global_stepN/``, which holds ``mp_rank_XX_model_states.pt`` (weights under
  ``module`` without pipeline; with DeepSpeed's pipeline engine only the run's state) plus, under the pipeline
  engine, ``layer_XX-model_YY-model_states.pt`` (one file per pipeline layer and TP rank), plus ZeRO-0/1/2
  optimizer files ``zero_pp_rank_D_mp_rank_XX_optim_states.pt``.
* Plain Megatron: ``latest_checkpointed_iteration.txt`` next to ``iter_NNNNNNN/mp_rank_XX[_YYY]/model_optim_rng.pt``
  (XX the TP rank, YYY the pipeline stage), the model as nested dicts under ``model``.

DeepSpeed's universal form of the first (``latest_universal``) is universal.py's.
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass, field

import torch

from megatron.checkpointing.live.markers import META, TRACKER
from megatron.errors import CheckpointError

MP_FILE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
LAYER_FILE = re.compile(r"^layer_(\d+)-model_(\d+)-model_states\.pt$")
ITER_RANK = re.compile(r"^mp_rank_(\d+)(?:_(\d+))?$")


@dataclass
class Found:
    kind: str  # "deepspeed" (Megatron-DeepSpeed global_stepN/), "universal" (DeepSpeed's ds_to_universal.py
    # output, universal.py) or "megatron" (iter_NNNNNNN/)
    path: str  # the iteration's directory
    iteration: int


@dataclass
class Converted:
    """An upstream checkpoint in our names, merged over TP/PP; vocabulary rows as upstream padded them."""
    weights: dict[str, torch.Tensor]
    padded_vocab_size: int
    model: dict  # our ModelConfig field names -> upstream's values (for the shape check)
    iteration: int
    consumed_samples: int
    lr_num_steps: int  # in iterations, as our scheduler counts (upstream counts samples)
    layout: dict  # tp, pp, dp, zero_stage of the writer
    moments: dict[str, dict[str, torch.Tensor]] | None = None
    optimizer_step: int = 0
    optimizer_note: str = ""
    rng_states: list = field(default_factory=list)  # per model-parallel rank (tp, pp): upstream's list over DP


def find_marked(load: str) -> Found | None:
    """The Megatron-DeepSpeed or Megatron checkpoint that ``load``'s markers name, or None when the directory is not
    one (ours, empty, unknown)."""
    tag = read_marker(os.path.join(load, "latest"))
    if tag is not None:  # DeepSpeed's marker: upstream's global_stepN/ has no megatron_meta.json, ours has
        if "/" not in tag and is_ds_dir(os.path.join(load, tag)):
            m = re.search(r"(\d+)$", tag)
            return Found("deepspeed", os.path.join(load, tag), int(m.group(1)) if m else 0)
        return None  # ours, or a broken marker that live/markers.py names
    it = read_marker(os.path.join(load, TRACKER))
    if it is None:
        return None
    if it != "release" and not it.isdigit():
        raise CheckpointError(f"checkpoint marker {os.path.join(load, TRACKER)} holds {it[:40]!r}, not an iteration "
                              "number: write the iteration to resume (e.g. 1000) into it")
    ds = os.path.join(load, f"global_step{it}")
    if os.path.isfile(os.path.join(ds, META)):
        return None  # ours without its 'latest': the preflight names that
    if is_ds_dir(ds):
        return Found("deepspeed", ds, int(it) if it.isdigit() else 0)
    plain = os.path.join(load, "release" if it == "release" else f"iter_{int(it):07d}")
    if os.path.isdir(plain) and glob.glob(os.path.join(plain, "mp_rank_*", "model_optim_rng.pt")):
        return Found("megatron", plain, int(it) if it.isdigit() else 0)
    raise CheckpointError(f"checkpoint marker {os.path.join(load, TRACKER)} names iteration {it}, but neither "
                          f"{plain}/mp_rank_*/model_optim_rng.pt nor {ds}/mp_rank_*_model_states.pt exists: the "
                          "checkpoint is incomplete; write an iteration that was saved completely into the marker")


def is_ds_dir(path: str) -> bool:
    """A global_stepN/-like directory of upstream's: DeepSpeed model or pipeline-layer files, none of our meta."""
    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, META)):
        return False
    return any(MP_FILE.match(f) or LAYER_FILE.match(f) for f in os.listdir(path))


def read_marker(path: str) -> str | None:
    """A marker file's content (a tag or an iteration), None when it does not exist."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return f.read().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint marker {path} is unreadable ({e})") from None


# Entries that only a checkpoint has: a --load directory holding one of these but no marker we know is refused
# (it is someone's checkpoint in a layout we do not read), never silently restarted from iteration 1.
_CHECKPOINT_DIR_PREFIXES = ("global_step", "iter_", "release", "mp_rank_")
_CHECKPOINT_SUFFIXES = (".pt", ".pth", ".ckpt", ".safetensors", ".distcp")


def unknown_layout_message(load: str) -> str | None:
    """One line for a ``--load`` directory that holds checkpoint-like entries in no layout we read, else None."""
    if os.path.isfile(os.path.join(load, "latest_universal")) and not os.path.isfile(os.path.join(load, "latest")):
        return (f"--load {load} holds a DeepSpeed universal checkpoint ('latest_universal'): add "
                "--universal-checkpoint to load it, as upstream does")
    for name in sorted(os.listdir(load)):
        if name.startswith(".") or ".tmp-" in name or ".old-" in name:
            continue  # our interrupted saves: never loaded, cleaned up by the next save
        full = os.path.join(load, name)
        if (os.path.isdir(full) and name.startswith(_CHECKPOINT_DIR_PREFIXES)) or name.endswith(_CHECKPOINT_SUFFIXES):
            return (f"--load {load} holds {name} but no checkpoint layout this trainer reads (ours: 'latest' + "
                    f"global_stepN/megatron_meta.json, or full_state.json; Megatron-DeepSpeed: global_stepN/ named by "
                    f"'latest' or '{TRACKER}'; Megatron: '{TRACKER}' + iter_NNNNNNN/): point --load "
                    "at one of these, or at an empty directory to start from scratch")
    return None


def describe(conv: Converted) -> str:
    lay = conv.layout
    return (f"TP {lay['tp']}, PP {lay['pp']}, DP {lay['dp']}, ZeRO-{lay['zero_stage']}, iteration {conv.iteration}, "
            f"consumed samples {conv.consumed_samples}")
