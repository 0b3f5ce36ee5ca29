"""Checks that need only the flags and the file system, run on every rank before any process group or
model exists: a typo costs seconds of one process, not minutes of a 1,000-node allocation.

Each failure is a MegatronError (one line naming the flag or file and the fix, exit 2, printed once per
job by ``megatron.errors.run_cli``). Flag-only checks live with the configs (``RunConfig.validate``); the
tokenizer files are opened by the entry point's tokenizer provider, also before the process group.
"""

from __future__ import annotations

from megatron.config import RunConfig
from megatron.preflight.checkpoints import check_load, check_save, check_save_space
from megatron.preflight.data import check_data


def preflight(run: RunConfig) -> None:
    """Cheapest first; nothing here is collective."""
    check_save(run.checkpoint.save)
    check_save_space(run.checkpoint, run)
    check_load(run.checkpoint, run)
    check_data(run)


__all__ = ["check_data", "check_load", "check_save", "check_save_space", "preflight"]
