"""Checkpoints: one save/load interface (``open_checkpoint`` -> ``Checkpointer``) over the formats, crash-safe saves
with exact resume, the layout-free full state, upstream's checkpoints and HF conversion.

See docs/checkpoints.md for the on-disk layout, the flags and what is unpickled where; docs/architecture.md for the
subpackages (live/ below the formats, the formats below the Checkpointer).
"""

from megatron.checkpointing.checkpointer import Checkpointer, open_checkpoint
from megatron.checkpointing.locate import classify_load
from megatron.checkpointing.state import Resume

__all__ = ["Checkpointer", "Resume", "classify_load", "open_checkpoint"]
