"""Which engine can save and load under which checkpoint flags, decided from the flags alone: the one place these
refusals are written.

pretrain() calls ``check_supported`` before any process group exists, so a combination that cannot be saved fails
in one line at launch instead of after a save interval of node-hours (it used to crash at the first save).

Engines (``engine_kind``): DeepSpeed ZeRO-0..3 (``zero0`` ... ``zero3``), DeepSpeed's pipeline engine
(``pipeline``, ZeRO-0/1), DeepSpeed ZeRO++ hpZ (``hpz``), and our hierarchical ZeRO (``hierarchical``). All of
them save and resume through the Checkpointer (checkpointer.py: hierarchical ZeRO in hzero/, the others in
ds_layout/); what they cannot do is listed in ``REFUSED``.
"""

from __future__ import annotations

from megatron.core import hierarchical_zero
from megatron.errors import ConfigError

ENGINES = ("zero0", "zero1", "zero2", "zero3", "pipeline", "hpz", "hierarchical")

REFUSED: dict[tuple[str, str], str] = {
    ("zero3", "no_save_optim"): "--no-save-optim with --zero-stage 3: ZeRO-3 keeps the weights only in the optimizer "
                                "partitions, so there would be nothing to load; drop --no-save-optim or use "
                                "--zero-stage 1/2",
    ("hpz", "no_save_optim"): "--no-save-optim with ZeRO++ hpZ (ZeRO-3): the weights live only in the optimizer "
                              "partitions; drop --no-save-optim",
}
"""(engine, checkpoint flag) -> the one-line reason and fix. Flags: ``save``, ``load``, ``no_save_optim``."""


def engine_kind(run, ds_config: dict) -> str:
    """The engine megatron/engine.py will build for ``run`` and its ds_config (as built by build_ds_config)."""

    if hierarchical_zero.from_ds_config(ds_config) is not None:
        return "hierarchical"
    if ds_config.get("zero_optimization", {}).get("zero_hpz_partition_size"):
        return "hpz"
    if run.parallel.pp > 1:
        return "pipeline"
    return f"zero{run.parallel.zero_stage}"


def checkpoint_flags(settings) -> list[str]:
    flags = []
    if settings.save:
        flags.append("save")
        if settings.no_save_optim:
            flags.append("no_save_optim")
    if settings.load:
        flags.append("load")
    return flags


def check_supported(run, ds_config: dict, settings) -> None:
    """Raise ConfigError (one line, exit 2) when this engine cannot honour the checkpoint flags."""
    kind = engine_kind(run, ds_config)
    for flag in checkpoint_flags(settings):
        reason = REFUSED.get((kind, flag))
        if reason:
            raise ConfigError(reason)
