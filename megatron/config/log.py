"""What the run reports: upstream Megatron-DeepSpeed's logging and TensorBoard flags, and its profiler window.

Honoured (as upstream's training_log / evaluate_and_print_results): --tensorboard-log-interval,
--tensorboard-queue-size, --log-timers-to-tensorboard, --log-batch-size-to-tensorboard,
--no-log-learnig-rate-to-tensorboard, --no-log-loss-scale-to-tensorboard, --log-validation-ppl-to-tensorboard,
--log-optimizer-states-to-tensorboard, --log-memory-to-tensorboard, --log-world-size-to-tensorboard,
--log-params-norm, --timing-log-level, --timing-log-option, --no-barrier-with-level-1-timing.
Weights & Biases (--wandb-project, --wandb-exp-name, --wandb-save-dir): the same scalars, written by
megatron/training/wandb_writer.py. No-op, said once in the log: the *-to-tensorboard flags without --tensorboard-dir
or W&B, --wandb-save-dir without a project or name (no writer, as upstream). --log-num-zeros-in-grad is classed in
megatron/compat/flags.py with every other upstream flag.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.errors import ConfigError
from megatron.flag_bounds import check_fields


@dataclass(frozen=True)
class LogOptions:
    tensorboard_dir: str | None = None
    tensorboard_log_interval: int = 1
    tensorboard_queue_size: int = 1000
    timers_to_tb: bool = False
    batch_size_to_tb: bool = False
    lr_to_tb: bool = True
    loss_scale_to_tb: bool = True
    validation_ppl_to_tb: bool = False
    optimizer_states_to_tb: bool = False
    memory_to_tb: bool = False
    world_size_to_tb: bool = False
    params_norm: bool = False
    timing_level: int = 0
    timing_option: str = "minmax"
    barrier_l1: bool = True
    skip_train: bool = False
    wandb_project: str | None = None
    wandb_exp_name: str | None = None
    wandb_dir: str | None = None
    """Where W&B writes: --wandb-save-dir, else --save/wandb (as upstream); also where the campaign's run id is
    kept."""
    notes: tuple[str, ...] = ()
    """No-op flags given on this command line, one log line each."""

    @property
    def tensorboard(self) -> bool:
        return bool(self.tensorboard_dir)

    @property
    def wandb(self) -> bool:
        """Either flag starts W&B, as upstream."""
        return bool(self.wandb_project or self.wandb_exp_name)

    @property
    def writes_scalars(self) -> bool:
        """TensorBoard or W&B (upstream's writer.is_enabled()). Same on every rank: collectives that only feed the
        writers run everywhere or nowhere."""
        return self.tensorboard or self.wandb

    def tb_step(self, it: int) -> bool:
        """The writers' scalars are due (--tensorboard-log-interval, which upstream applies to W&B too)."""
        return self.writes_scalars and it % self.tensorboard_log_interval == 0

    def validate(self) -> LogOptions:
        """Before any process group exists (ConfigError: one line, exit 2)."""
        check_fields(self, {"tensorboard_log_interval": "--tensorboard-log-interval",
                            "tensorboard_queue_size": "--tensorboard-queue-size",
                            "timing_level": "--timing-log-level=timing_log_level"})
        if self.wandb and not self.wandb_dir:
            raise ConfigError("--wandb-project / --wandb-exp-name need --wandb-save-dir DIR or --save DIR (upstream "
                              "writes W&B's files to --save/wandb)")
        return self


@dataclass(frozen=True)
class ProfileConfig:
    """--profile pt|pt-full, --profile_steps START,END, --profile-ranks R ...: upstream's PyTorch-profiler window
    (megatron/training/profiler.py runs it). The trace goes to --tensorboard-dir, as upstream's."""

    mode: str | None = None
    """None (off), 'pt', or 'pt-full' (with Python stacks)."""
    steps: str = "2,3"
    ranks: tuple[int, ...] | None = None
    """Ranks that profile (None: all)."""
    tensorboard_dir: str | None = None

    @property
    def window(self) -> tuple[int, int] | None:
        """(first, last) step to profile, counted from 1; None without --profile. Raises ConfigError for a bad
        window (``validate`` calls it before any process group)."""
        if self.mode is None:
            return None
        try:
            start, end = (int(x) for x in str(self.steps).split(","))
        except ValueError:
            raise ConfigError(f"--profile_steps {self.steps!r}: give START,END (e.g. 2,3)") from None
        if not 1 <= start <= end:
            raise ConfigError(f"--profile_steps {start},{end}: need 1 <= START <= END (steps count from 1)")
        if not self.tensorboard_dir:
            raise ConfigError("--profile writes its trace to --tensorboard-dir, as upstream: give --tensorboard-dir "
                              "DIR")
        return start, end

    def validate(self) -> ProfileConfig:
        if self.mode not in (None, "pt", "pt-full"):
            raise ConfigError(f"--profile {self.mode!r}: choose pt or pt-full")
        check_fields(self, {"ranks": "--profile-ranks=profile_ranks"})
        _ = self.window
        return self
