"""Pre-flight checks of --save (creatable, writable, room for a checkpoint) and --load (a complete checkpoint
that fits the flags)."""

from __future__ import annotations

import json
import os
import socket

from megatron.checkpointing.full_state.files import FULL_STATE_META
from megatron.checkpointing.live.markers import read_meta
from megatron.checkpointing.live.space import low_space_warning
from megatron.checkpointing.live.verify import check_complete
from megatron.checkpointing.locate import classify_load, expected_files, missing_checkpoint_message
from megatron.checkpointing.resume_checks import check_experts, check_model_shape, check_resume, loads_optimizer
from megatron.checkpointing.upstream import check_upstream
from megatron.config import CheckpointSettings, RunConfig
from megatron.errors import CheckpointError, ConfigError, warn_once
from megatron.optim.lr_schedule import check_resume_schedule


def check_save(save: str | None) -> None:
    """Create ``--save`` and write and remove a probe file in it, so an unusable directory fails now
    rather than at the first checkpoint, after the iterations before it are lost."""
    if not save:
        return
    if os.path.exists(save) and not os.path.isdir(save):
        raise ConfigError(f"--save {save} is a file, not a directory: choose a directory for the checkpoints")
    try:
        os.makedirs(save, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--save {save} cannot be created ({e.strerror}: {e.filename}): choose a directory "
                          "whose parents exist as directories and that you may write") from None
    # One probe per process: every rank writes checkpoint files, and ranks must not race on one name.
    probe = os.path.join(save, f".write-probe-{socket.gethostname()}-{os.getpid()}")
    try:
        with open(probe, "w") as f:
            f.write("probe\n")
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"--save {save} is not writable ({e.strerror}): choose a directory you may write "
                          "(on Frontier a project directory on Lustre, not $HOME)") from None


def check_save_space(settings: CheckpointSettings, run: RunConfig) -> None:
    """One warning line when --save's file system cannot hold one checkpoint of this model and layout."""
    if settings.save:
        msg = low_space_warning(settings.save, run, not settings.no_save_optim)
        if msg:
            warn_once(msg)


def check_load(settings: CheckpointSettings, run: RunConfig) -> None:
    """The metadata ``--load`` would resume from, against this run's flags (shapes, experts, precision unless
    --no-load-optim; another TP x PP x DP x EP x ZeRO layout passes when relayout/ reads it in place, else one line
    names what does not carry over), and the marker files: ``latest``, its tag, megatron_meta.json."""
    target = classify_load(settings)
    if target.kind == "none":
        return
    if target.kind == "empty":
        warn_once(missing_checkpoint_message(settings.load, False))  # a mistyped --load must not pass unnoticed
        return
    if run.model.moe.enabled and settings.universal_checkpoint:
        raise ConfigError(f"--load {settings.load}: loading a universal checkpoint into a model with experts "
                          "(--num-experts) is not built; load upstream's global_stepN/ directory instead")
    if target.kind == "upstream":  # a Megatron-DeepSpeed global_stepN/ or Megatron iter_N/: checked there
        check_upstream(target.found, settings, run)
        return
    if target.kind == "full_state":
        path = os.path.join(target.path, FULL_STATE_META)
        try:
            with open(path) as f:
                meta = json.load(f)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"checkpoint file {path} is unreadable ({e}); re-create it with "
                                  "tools/reshard_checkpoint.py or tools/convert_hf_to_megatron.py") from None
        check_model_shape(meta.get("model", {}), run, target.path)
        check_experts(meta.get("model", {}).get("moe") or {}, run, target.path)
        if not settings.finetune:
            check_resume_schedule(meta.get("lr_scheduler"), run, target.path)
        if settings.verify != "off":
            check_complete(target.path, None)
        return
    meta = read_meta(target.path)
    check_resume(meta, run, loads_optimizer(settings, meta), target.path)
    if not settings.finetune:
        check_resume_schedule(meta.get("lr_scheduler"), run, target.path)
    if settings.verify != "off":  # every file the manifest (or layout) names, sized: stats only
        check_complete(target.path, expected_files(meta))
