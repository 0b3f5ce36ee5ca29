"""Where checkpoints go and come from, and what a resume restores (megatron/checkpointing acts on these)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.errors import ConfigError
from megatron.flag_bounds import check_fields


@dataclass(frozen=True)
class CheckpointSettings:
    save: str | None = None
    load: str | None = None
    load_tag: str | None = None
    """--load-tag: the checkpoint directory under --load to resume (e.g. global_step1000), not the one 'latest'
    names (as upstream under --deepspeed)."""
    save_interval: int | None = None
    no_save_optim: bool = False
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False
    exit_on_missing: bool = False
    """--exit-on-missing-checkpoint: a --load without a checkpoint is an error, not a fresh start."""
    keep_last: int | None = None
    """Keep this many newest checkpoints (None: keep all). The one ``latest`` names is never deleted."""
    trust_checkpoint: bool = False
    """--trust-checkpoint: unpickle an upstream Megatron(-DeepSpeed) checkpoint's Python objects (upstream/)."""
    verify: str = "full"
    """--verify-checkpoint: check the files of --load against their manifest (full: sizes and checksums)."""
    universal_checkpoint: bool = False
    """--universal-checkpoint: --load is DeepSpeed's universal form of an upstream checkpoint ('latest_universal')."""
    async_save: bool = False
    """--async-save (Megatron-LM's name): a save blocks only for a copy to host memory; a background thread writes the
    files and ``latest`` moves once every rank's files are durable (megatron/checkpointing/async_save.py)."""

    def validate(self) -> CheckpointSettings:
        check_fields(self, {"save_interval": "--save-interval",
                            "keep_last": "--keep-last-n-checkpoints=keep_last_n_checkpoints"})
        if self.verify not in ("full", "size", "off"):
            raise ConfigError(f"--verify-checkpoint {self.verify!r}: choose full, size or off")
        if self.load_tag is not None and not self.load:
            raise ConfigError(f"--load-tag {self.load_tag} without --load: add --load DIR (the tag is a directory "
                              "in it)")
        if self.async_save and not self.save:
            raise ConfigError("--async-save without --save: nothing would be saved; add --save DIR or drop "
                              "--async-save")
        return self
