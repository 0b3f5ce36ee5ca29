"""Upstream's rules for the schedule flags (megatron/arguments.py validate_args and get_optimizer_param_scheduler),
checked on the RunConfig before any process group (the ranges of the numbers themselves are
megatron/flag_bounds.py's, checked by the config fields first): which iteration/sample forms combine, --train-samples ->
train iterations, the ramp, and the schedule's lengths."""

from __future__ import annotations

import dataclasses

from megatron.errors import ConfigError
from megatron.optim.lr_schedule import check_resume_flags, check_shape, schedule_shape
from megatron.optim.microbatches import RAMP_FLAG, MicroBatchPlan


def micro_batch_plan(run) -> MicroBatchPlan:
    t = run.training
    return MicroBatchPlan(t.global_batch_size, t.micro_batch_size, run.parallel.dp,
                          tuple(t.rampup_batch_size) if t.rampup_batch_size is not None else None)


def validate_schedule(run) -> int | None:
    """Raises ConfigError for a schedule upstream refuses; returns the train iterations --train-samples gives (None
    for iteration-based training), which RunConfig records."""
    o, t = run.optimizer, run.training
    if t.train_samples is None:  # iteration-based
        if t.train_iters is None:
            raise ConfigError("neither --train-iters nor --train-samples given: set how long to train")
        wrong = [flag for flag, bad in (("--lr-decay-samples", o.lr_decay_samples is not None),
                                        ("--lr-warmup-samples", o.lr_warmup_samples != 0),
                                        ("--rampup-batch-size", t.rampup_batch_size is not None)) if bad]
        if wrong:
            raise ConfigError(f"{', '.join(wrong)} with --train-iters: sample-based flags need sample-based "
                              "training; use --train-samples (and --lr-*-samples), or the *-iters forms")
        if o.lr_warmup_fraction is not None and o.lr_warmup_iters != 0:
            raise ConfigError("--lr-warmup-fraction and --lr-warmup-iters are both set: pick one")
    else:
        wrong = [flag for flag, bad in (("--lr-decay-iters", o.lr_decay_iters is not None),
                                        ("--lr-warmup-iters", o.lr_warmup_iters != 0)) if bad]
        if wrong:
            raise ConfigError(f"{', '.join(wrong)} with --train-samples: use --lr-decay-samples / "
                              "--lr-warmup-samples (or --lr-warmup-fraction) for sample-based training")
        if o.lr_warmup_fraction is not None and o.lr_warmup_samples != 0:
            raise ConfigError("--lr-warmup-fraction and --lr-warmup-samples are both set: pick one")
    check_resume_flags(o.override_opt_param_scheduler, o.use_checkpoint_opt_param_scheduler)
    plan = micro_batch_plan(run)
    if t.rampup_batch_size is not None and run.parallel.zero_hierarchy:
        raise ConfigError(f"{RAMP_FLAG} with --zero-hierarchy: hierarchical ZeRO runs a fixed number of "
                          "micro-batches per step; use --zero-stage 1..3 without --zero-hierarchy for a ramp")
    train_iters = None
    if t.train_samples is not None:
        train_iters = plan.train_iters(t.train_samples)
        if train_iters <= 0:
            raise ConfigError(f"--train-samples {t.train_samples} is less than one global batch "
                              f"({plan.global_batch(0)} samples): nothing would be trained")
        t = dataclasses.replace(t, train_iters=train_iters)
    check_shape(schedule_shape(o, t), t, plan.positions())
    return train_iters
