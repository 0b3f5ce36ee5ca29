"""What sits at ``--load``, worked out in one place for the preflight and the Checkpointer alike: nothing, an empty
directory (a fresh start), our checkpoint (``latest`` + ``global_stepN/megatron_meta.json``), a full-state directory
(``full_state.json``, any layout), or an upstream Megatron(-DeepSpeed) checkpoint (upstream/); anything else that
looks like a checkpoint is refused in one line, never silently restarted from iteration 1."""

from __future__ import annotations

import os
from dataclasses import dataclass

from megatron.checkpointing import upstream
from megatron.checkpointing.ds_layout.files import expected_files as ds_expected
from megatron.checkpointing.full_state.files import is_full_state
from megatron.checkpointing.hzero.shards import expected_files as hzero_expected
from megatron.checkpointing.live.markers import LATEST, read_latest
from megatron.checkpointing.live.verify import Layout
from megatron.checkpointing.state import HZERO_FORMAT
from megatron.config import CheckpointSettings
from megatron.errors import CheckpointError


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


def expected_files(meta: dict) -> Layout:
    """The files a checkpoint of ours without a manifest must hold, by the format its metadata names (for
    live/verify.py's checks without a manifest)."""
    if meta.get("format") == HZERO_FORMAT:
        return lambda present: hzero_expected(meta)
    return lambda present: ds_expected(meta, present)


def missing_checkpoint_message(load: str, exit_on_missing: bool) -> str:
    where = os.path.join(load, LATEST)
    if exit_on_missing:
        return (f"--load {load} holds no checkpoint ({where} not found) and --exit-on-missing-checkpoint is set: "
                "point --load at a --save directory with a 'latest' file, or drop the flag to start from scratch")
    return (f"--load {load} holds no checkpoint ({where} not found): training starts from scratch "
            "(pass --exit-on-missing-checkpoint to make this an error)")
