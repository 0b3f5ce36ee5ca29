"""What sits at ``--load``, worked out in one place for the preflight and the loaders alike: nothing, an empty
directory (a fresh start), our checkpoint (``latest`` + ``global_stepN/megatron_meta.json``), a full-state directory
(``full_state.json``, any layout), or an upstream Megatron(-DeepSpeed) checkpoint (upstream/); anything else that
looks like a checkpoint is refused in one line, never silently restarted from iteration 1."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from megatron.checkpointing import upstream
from megatron.checkpointing.full_state import is_full_state
from megatron.config import CheckpointSettings
from megatron.errors import CheckpointError

META = "megatron_meta.json"
LATEST = "latest"
TRACKER = upstream.TRACKER  # Megatron's marker, which we write too (its iteration)


@dataclass(frozen=True)
class LoadTarget:
    kind: str
    """"none" (no --load), "empty" (a directory without a checkpoint: start from scratch), "ours", "full_state" or
    "upstream"."""
    path: str | None = None
    """The checkpoint's directory (ours: ``--load/<tag>``)."""
    tag: str | None = None
    """Ours: the tag ``latest`` names."""
    found: upstream.Found | None = None
    """Upstream: what upstream.find recognised."""


def classify_load(settings: CheckpointSettings) -> LoadTarget:
    """What ``settings.load`` holds (files and markers only: no process group, nothing unpickled). Raises a one-line
    CheckpointError for a missing directory, a broken marker, a foreign layout, or no checkpoint under
    --exit-on-missing-checkpoint."""
    load = settings.load
    if not load:
        return LoadTarget("none")
    if not os.path.isdir(load):
        raise CheckpointError(f"--load {load}: directory not found; fix the path, or drop --load to start from "
                              "scratch")
    if is_full_state(load):
        return LoadTarget("full_state", load)
    found = upstream.find(load, settings.universal_checkpoint)
    if found is not None:
        return LoadTarget("upstream", found.path, found=found)
    tag = read_latest(load)
    if tag is None:
        if (msg := upstream.unknown_layout_message(load)) is not None:
            raise CheckpointError(msg)
        if settings.exit_on_missing:
            raise CheckpointError(missing_checkpoint_message(load, True))
        return LoadTarget("empty", load)
    return LoadTarget("ours", os.path.join(load, tag), tag=tag)


def read_latest(load_dir: str) -> str | None:
    """The tag in ``load_dir/latest``; None when the directory holds no checkpoint yet."""
    path = os.path.join(load_dir, LATEST)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            tag = f.read().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint marker {path} is unreadable ({e}); write the tag to load into it") from None
    if not tag or "/" in tag or "\n" in tag:
        raise CheckpointError(f"checkpoint marker {path} is empty or malformed ({tag[:40]!r}); write the tag of a "
                              "complete checkpoint (e.g. global_step100) into it")
    return tag


def read_meta(ckpt_dir: str) -> dict:
    path = os.path.join(ckpt_dir, META)
    if not os.path.isdir(ckpt_dir):
        raise CheckpointError(f"checkpoint directory {ckpt_dir} is missing (named by 'latest'); point 'latest' at "
                              "an existing checkpoint")
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} is missing: not a complete Megatron-Frontier checkpoint; "
                              f"point {os.path.join(os.path.dirname(ckpt_dir), LATEST)} at a complete one")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint file {path} is corrupt ({e})") from None


def missing_checkpoint_message(load: str, exit_on_missing: bool) -> str:
    where = os.path.join(load, LATEST)
    if exit_on_missing:
        return (f"--load {load} holds no checkpoint ({where} not found) and --exit-on-missing-checkpoint is set: "
                "point --load at a --save directory with a 'latest' file, or drop the flag to start from scratch")
    return (f"--load {load} holds no checkpoint ({where} not found): training starts from scratch "
            "(pass --exit-on-missing-checkpoint to make this an error)")
