"""What sits at ``--load``, worked out in one place for the preflight and the Checkpointer alike: nothing, an empty
directory (a fresh start), our checkpoint (``latest`` + ``global_stepN/megatron_meta.json``), a full-state directory
(``full_state.json``, any layout), or an upstream Megatron(-DeepSpeed) checkpoint (upstream/); anything else that
looks like a checkpoint is refused in one line, never silently restarted from iteration 1. ``--load-tag`` names the
checkpoint directory itself, and no marker is read."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from megatron.checkpointing import upstream
from megatron.checkpointing.ds_layout.files import expected_files as ds_expected
from megatron.checkpointing.full_state.files import is_full_state
from megatron.checkpointing.hzero.shards import expected_files as hzero_expected
from megatron.checkpointing.live.markers import LATEST, META, read_latest
from megatron.checkpointing.live.verify import Layout
from megatron.checkpointing.state import HZERO_FORMAT
from megatron.checkpointing.upstream.layout import is_ds_dir
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
    """Ours: the tag ``latest`` (or ``--load-tag``) names."""
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
        if settings.load_tag is not None:
            raise CheckpointError(f"--load-tag {settings.load_tag}: --load {load} is a full-state directory, which "
                                  "holds one checkpoint and no tags; drop --load-tag")
        return LoadTarget("full_state", load)
    if settings.load_tag is not None:
        return _tagged(load, settings.load_tag, settings.universal_checkpoint)
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


def _tagged(load: str, tag: str, universal: bool) -> LoadTarget:
    """The checkpoint ``load/tag`` (--load-tag), whatever ``latest``, ``latest_universal`` or the iteration tracker
    name (as DeepSpeed's load_checkpoint(tag=...) upstream calls): ours, upstream's global_stepN/ (or its universal
    form with --universal-checkpoint), or plain Megatron's iter_NNNNNNN/ / release/ (upstream itself reads the tag
    only under --deepspeed)."""
    path = os.path.join(load, tag)
    if "/" in tag or tag in ("", ".", "..") or not os.path.isdir(path):
        tags = sorted(n for n in os.listdir(load) if os.path.isdir(os.path.join(load, n)) and not n.startswith(".")
                      and ".tmp-" not in n and ".old-" not in n)
        raise CheckpointError(f"--load-tag {tag}: {path} not found; the tags in {load} are "
                              f"{', '.join(tags) if tags else '(none)'}")
    if os.path.isfile(os.path.join(path, META)):
        return LoadTarget("ours", path, tag=tag)
    digits = re.search(r"(\d+)(?:_universal)?$", tag)
    iteration = int(digits.group(1)) if digits else 0
    if universal:
        if not (os.path.isdir(os.path.join(path, "zero")) and is_ds_dir(path)):
            raise CheckpointError(f"--load-tag {tag} --universal-checkpoint: {path} is not a universal checkpoint "
                                  "(zero/ and mp_rank_XX_model_states.pt): re-run ds_to_universal.py into it, or "
                                  "drop --universal-checkpoint")
        return LoadTarget("upstream", path, found=upstream.Found("universal", path, iteration))
    if is_ds_dir(path):
        return LoadTarget("upstream", path, found=upstream.Found("deepspeed", path, iteration))
    if any(os.path.isfile(os.path.join(path, d, "model_optim_rng.pt")) for d in os.listdir(path)):
        return LoadTarget("upstream", path, found=upstream.Found("megatron", path, iteration))
    raise CheckpointError(f"--load-tag {tag}: {path} holds no checkpoint this trainer reads (ours: "
                          f"{META}; Megatron-DeepSpeed: mp_rank_XX_model_states.pt; Megatron: "
                          "mp_rank_XX/model_optim_rng.pt): name a complete checkpoint's directory")


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
