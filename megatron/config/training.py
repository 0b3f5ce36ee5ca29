"""Batch sizes, how long to train (iterations, samples or tokens, with an optional batch ramp), evaluation and
the seed."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.errors import ConfigError
from megatron.flag_bounds import check_fields


@dataclass(frozen=True)
class TrainingConfig:
    micro_batch_size: int = 1
    global_batch_size: int | None = None
    train_iters: int | None = 10
    """Derived from ``train_samples`` (as upstream) when that is given."""
    train_samples: int | None = None
    train_tokens: int | None = None
    """Training also stops once this many tokens are consumed (upstream's --train-tokens)."""
    rampup_batch_size: tuple[int, int, int] | None = None
    """--rampup-batch-size START INCR SAMPLES (megatron/optim/microbatches.py)."""
    eval_interval: int = 1000
    eval_iters: int = 10
    log_interval: int = 100
    seed: int = 1234
    peak_tflops: float | None = None
    """Peak of one device for MFU; default: the device's datasheet figure (megatron/perf/peaks.py: 191.5 for an
    MI250X GCD in bf16), measured on CPU."""

    def grad_accumulation_steps(self, dp: int) -> int:
        return self.global_batch_size // (self.micro_batch_size * dp)

    def validate(self, dp: int) -> None:
        """Raises ConfigError naming the flags; without --global-batch-size, RunConfig fills micro-batch x DP."""
        check_fields(self, {f: "--" + f.replace("_", "-") for f in (
            "micro_batch_size", "global_batch_size", "train_iters", "train_samples", "train_tokens",
            "rampup_batch_size", "eval_interval", "eval_iters", "log_interval", "seed", "peak_tflops")})
        if self.global_batch_size is not None:
            check_global_batch(self.global_batch_size, self.micro_batch_size, dp)


def check_global_batch(global_batch_size: int, micro_batch_size: int, dp: int) -> None:
    """Every optimizer step is a whole number of micro-batches on every data-parallel rank (the trainer's and the
    performance model's rule)."""
    if global_batch_size % (micro_batch_size * dp):
        raise ConfigError(
            f"--global-batch-size {global_batch_size} is not divisible by --micro-batch-size "
            f"{micro_batch_size} x data-parallel size {dp} = {micro_batch_size * dp}: "
            f"use a multiple of {micro_batch_size * dp}"
        )
