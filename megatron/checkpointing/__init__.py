"""Checkpoints: crash-safe DeepSpeed save/load with exact resume, full-state (any layout) and HF conversion.

See docs/checkpoints.md for the on-disk layout, the flags and what is unpickled where.
"""

from megatron.checkpointing.checkpoint import (
    CheckpointSettings,
    Resume,
    load_checkpoint,
    load_full_state,
    read_latest,
    read_meta,
    save_checkpoint,
)

__all__ = ["CheckpointSettings", "Resume", "load_checkpoint", "load_full_state", "read_latest", "read_meta",
           "save_checkpoint"]
