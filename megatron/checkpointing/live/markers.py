"""The marker files of a ``--save`` directory: ``latest`` (the tag of the newest complete checkpoint, which moves
last), Megatron's iteration tracker, and each checkpoint's ``megatron_meta.json``."""

from __future__ import annotations

import json
import os

from megatron.errors import CheckpointError

META = "megatron_meta.json"
LATEST = "latest"
TRACKER = "latest_checkpointed_iteration.txt"
"""Megatron's marker: the iteration number (or "release"); we write it too, upstream's resume loops read it."""


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
