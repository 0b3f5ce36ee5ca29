"""Upstream Megatron-DeepSpeed's logging flags, each honoured, a stated no-op, or refused in one line.

Honoured (as upstream's training_log / evaluate_and_print_results): --tensorboard-log-interval,
--tensorboard-queue-size, --log-timers-to-tensorboard, --log-batch-size-to-tensorboard,
--no-log-learnig-rate-to-tensorboard, --no-log-loss-scale-to-tensorboard, --log-validation-ppl-to-tensorboard,
--log-optimizer-states-to-tensorboard, --log-memory-to-tensorboard, --log-world-size-to-tensorboard,
--log-params-norm, --timing-log-level, --timing-log-option, --no-barrier-with-level-1-timing.
No-op, said once in the log: the *-to-tensorboard flags without --tensorboard-dir (no writer, as upstream).
--log-num-zeros-in-grad, --wandb-* are classed in megatron/compat/flags.py with every other upstream flag.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from megatron.errors import ConfigError

_TB_ONLY = ("log_timers_to_tensorboard", "log_batch_size_to_tensorboard", "log_validation_ppl_to_tensorboard",
            "log_optimizer_states_to_tensorboard", "log_memory_to_tensorboard", "log_world_size_to_tensorboard")


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
    notes: tuple[str, ...] = ()
    """No-op flags given on this command line, one log line each."""

    @property
    def tensorboard(self) -> bool:
        """Same on every rank: collectives that only feed TensorBoard run everywhere or nowhere."""
        return bool(self.tensorboard_dir)

    def tb_step(self, it: int) -> bool:
        return self.tensorboard and it % self.tensorboard_log_interval == 0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LogOptions:
        """Validates before any process group exists (ConfigError: one line, exit 2)."""
        g = lambda name, default=None: getattr(args, name, default)  # noqa: E731 (extra_args parsers may lack some)
        for flag, value in (("--tensorboard-log-interval", g("tensorboard_log_interval", 1)),
                            ("--tensorboard-queue-size", g("tensorboard_queue_size", 1000))):
            if value < 1:
                raise ConfigError(f"{flag} {value}: must be >= 1")
        notes = []
        tb_dir = g("tensorboard_dir")
        given = [f"--{n.replace('_', '-')}" for n in _TB_ONLY if g(n, False)]
        if given and not tb_dir:
            notes.append(f"{', '.join(given)} without --tensorboard-dir: nothing is written, as upstream")
        return cls(tensorboard_dir=tb_dir, tensorboard_log_interval=g("tensorboard_log_interval", 1),
                   tensorboard_queue_size=g("tensorboard_queue_size", 1000),
                   timers_to_tb=g("log_timers_to_tensorboard", False),
                   batch_size_to_tb=g("log_batch_size_to_tensorboard", False),
                   lr_to_tb=g("log_learning_rate_to_tensorboard", True),
                   loss_scale_to_tb=g("log_loss_scale_to_tensorboard", True),
                   validation_ppl_to_tb=g("log_validation_ppl_to_tensorboard", False),
                   optimizer_states_to_tb=g("log_optimizer_states_to_tensorboard", False),
                   memory_to_tb=g("log_memory_to_tensorboard", False),
                   world_size_to_tb=g("log_world_size_to_tensorboard", False),
                   params_norm=g("log_params_norm", False), timing_level=g("timing_log_level", 0),
                   timing_option=g("timing_log_option", "minmax"), barrier_l1=g("barrier_with_L1_time", True),
                   skip_train=g("skip_train", False), notes=tuple(notes))
