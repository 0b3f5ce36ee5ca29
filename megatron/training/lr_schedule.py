"""Megatron's learning-rate schedule: linear warmup, then cosine or linear decay to --min-lr."""

from __future__ import annotations

import math

import torch

from megatron.config import OptimizerConfig
from megatron.errors import ConfigError


class OptimizerParamScheduler:
    """Stepped once per optimizer step (DeepSpeed calls ``step()``); ``num_steps`` counts iterations."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: OptimizerConfig, train_iters: int) -> None:
        self.optimizer = optimizer
        self.max_lr, self.min_lr, self.style = cfg.lr, cfg.min_lr, cfg.lr_decay_style
        self.decay_steps = cfg.lr_decay_iters or train_iters
        if cfg.lr_warmup_fraction is not None:
            self.warmup_steps = int(cfg.lr_warmup_fraction * self.decay_steps)
        else:
            self.warmup_steps = cfg.lr_warmup_iters
        if self.style not in ("constant", "linear", "cosine"):
            raise ConfigError(f"--lr-decay-style {self.style!r}: choose constant, linear or cosine")
        if self.min_lr > self.max_lr:
            raise ConfigError(f"--min-lr {self.min_lr} is above --lr {self.max_lr}")
        self.num_steps = 0
        self._apply(self.get_lr(1))  # the first update uses the lr of step 1

    def get_lr(self, step: int) -> float:
        if self.warmup_steps > 0 and step <= self.warmup_steps:
            return self.max_lr * step / self.warmup_steps
        if self.style == "constant":
            return self.max_lr
        if step > self.decay_steps:
            return self.min_lr
        ratio = (step - self.warmup_steps) / max(1, self.decay_steps - self.warmup_steps)
        if self.style == "linear":
            coeff = 1.0 - ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def _apply(self, lr: float) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    @property
    def current_lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def apply_schedule(self) -> None:
        """Write the schedule's lr for the next update into the optimizer, over whatever a restored
        optimizer state put there (the lr of the schedule it was saved under)."""
        self._apply(self.get_lr(self.num_steps + 1))

    def step(self, increment: int = 1) -> None:
        self.num_steps += increment
        self._apply(self.get_lr(self.num_steps + 1))

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, "max_lr": self.max_lr, "min_lr": self.min_lr,
                "warmup_steps": self.warmup_steps, "decay_steps": self.decay_steps, "style": self.style}

    def load_state_dict(self, state: dict) -> None:
        # Only the position is restored: the schedule's shape comes from the current flags, so a user
        # may lengthen --train-iters / --lr-decay-iters on resume (a safe change).
        self.num_steps = int(state["num_steps"])
        self._apply(self.get_lr(self.num_steps + 1))
