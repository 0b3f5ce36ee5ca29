"""One training iteration on a DeepSpeed engine: gradient accumulation, backward, optimizer step."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from megatron.core import comm


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
    total, norm = 0.0, None
    for i in range(num_microbatches):
        batch = next(data_iterator)
        loss = forward_step(engine, batch)
        engine.backward(loss)
        if i == num_microbatches - 1 and _plain_fp32(engine):
            # DeepSpeed records no norm on this path; grads are DP-reduced by now, so measure them here.
            norm = grad_norm(engine.module.parameters(), engine.mpu)
        engine.step()
        total += loss.detach().float().item()
    skipped = bool(getattr(engine, "skipped_steps", 0)) and _last_step_skipped(engine)
    norm = engine.get_global_grad_norm() if norm is None else norm
    if isinstance(norm, torch.Tensor):
        norm = norm.item()
    scale = getattr(engine.optimizer, "loss_scale", None) if engine.fp16_enabled() else None
    return StepResult(total / num_microbatches, norm, skipped, lr, scale)


def grad_norm(params, pstate) -> float:
    """Global L2 norm of the model's gradients: TP-sharded parameters count on every TP rank,
    replicated ones once (TP rank 0), summed over the TP x PP ranks of one model replica."""
    sq = torch.zeros(1, dtype=torch.float64)
    for p in params:
        if p.grad is not None and (pstate.tp.rank == 0 or getattr(p, "tensor_model_parallel", False)):
            sq += p.grad.detach().double().pow(2).sum().cpu()
    if pstate.mp.size > 1:
        comm.all_reduce(sq, pstate.mp.group)
    return sq.sqrt().item()


def _plain_fp32(engine) -> bool:
    return not (engine.zero_optimization() or engine.fp16_enabled() or engine.bfloat16_enabled())


def _last_step_skipped(engine) -> bool:
    opt = engine.optimizer
    return bool(getattr(opt, "overflow", False))
