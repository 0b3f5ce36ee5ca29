"""Checkpoints: crash-safe DeepSpeed save/load with exact resume, full-state (any layout) and HF conversion.

See docs/checkpoints.md for the on-disk layout, the flags and what is unpickled where.
"""

from megatron.checkpointing.checkpoint import load_checkpoint, load_full_state, save_checkpoint
from megatron.checkpointing.locate import classify_load, read_latest, read_meta
from megatron.checkpointing.state import Resume

__all__ = ["Resume", "classify_load", "load_checkpoint", "load_full_state", "read_latest", "read_meta",
           "save_checkpoint"]
