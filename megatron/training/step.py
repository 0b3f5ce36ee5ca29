"""One training iteration on a DeepSpeed engine: gradient accumulation, backward, optimizer step."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch


@dataclass
class StepResult:
    loss: float
    """Mean lm loss over this rank's micro-batches (not yet averaged over DP)."""
    grad_norm: float | None
    skipped: bool
    lr: float
    loss_scale: float | None


def gpt_forward_step(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """Megatron's contract: batch["text"] is [b, s+1]; predict token t+1 from tokens <= t.
    Returns the mean lm loss over the micro-batch (scalar, fp32)."""
    tokens = batch["text"]
    losses = model(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())  # [b, s]
    mask = batch.get("loss_mask")
    if mask is None:
        return losses.float().mean()
    mask = mask.float()
    return (losses.float() * mask).sum() / mask.sum().clamp(min=1.0)


def train_step(engine, data_iterator: Iterator[dict], num_microbatches: int,
               forward_step: Callable = gpt_forward_step) -> StepResult:
    """Run ``num_microbatches`` forward/backward passes then one optimizer step. DeepSpeed scales
    each loss by 1/num_microbatches and averages gradients over DP, so the update is that of the
    mean loss over the global batch."""
    lr = engine.get_lr()[0]  # the lr this update uses (the scheduler moves on inside engine.step)
    total = 0.0
    for _ in range(num_microbatches):
        batch = next(data_iterator)
        loss = forward_step(engine, batch)
        engine.backward(loss)
        engine.step()
        total += loss.detach().float().item()
    skipped = bool(getattr(engine, "skipped_steps", 0)) and _last_step_skipped(engine)
    norm = engine.get_global_grad_norm()
    if isinstance(norm, torch.Tensor):
        norm = norm.item()
    scale = getattr(engine.optimizer, "cur_scale", None) if engine.fp16_enabled() else None
    return StepResult(total / num_microbatches, norm, skipped, lr, scale)


def _last_step_skipped(engine) -> bool:
    opt = engine.optimizer
    return bool(getattr(opt, "overflow", False))
