"""One training iteration on a DeepSpeed engine: gradient accumulation, backward, optimizer step."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from megatron.core import comm
from megatron.core.ulysses import sequence_mean
from megatron.optim.grad_norm import grad_norm
from megatron.progress import PROGRESS


class _NoTimers:
    """Stand-in for megatron.training.timers.Timers at --timing-log-level 0 (no timer exists)."""

    def __call__(self, name):
        return contextlib.nullcontext()

    def start(self, name) -> None:
        pass

    def stop(self, name) -> None:
        pass


_NO_TIMERS = _NoTimers()


@dataclass
class StepResult:
    """One iteration's outcome. ``loss_value`` / ``norm_value`` may be tensors still on the device: the step
    itself never waits for the device. They become host floats in one read-back, either RunControl.exchange's
    (together with the stop flags) or, on first access of ``loss`` / ``grad_norm``, this object's own."""

    loss_value: torch.Tensor | float
    """Mean lm loss over this rank's micro-batches (not yet averaged over DP)."""
    norm_value: torch.Tensor | float | None
    skipped: bool
    lr: float
    """The lr this step's update applied."""
    loss_scale: float | None
    next_lr: float | None = None
    """The optimizer's lr after the step (the next update's): what upstream's log prints as "learning rate"."""
    moe_loss_value: torch.Tensor | float | None = None
    """Mean MoE loss (--moe-loss-coeff x the layers' load-balancing losses) over this rank's micro-batches; None
    without MoE layers."""
    _host: list | None = field(default=None, repr=False)

    def _values_in_order(self) -> tuple:
        return self.loss_value, self.norm_value, self.moe_loss_value

    def pending(self) -> list[torch.Tensor]:
        """The values still on the device, in (loss, norm, moe loss) order."""
        return [v for v in self._values_in_order() if isinstance(v, torch.Tensor)]

    def resolve(self, read: list) -> None:
        """Host copies of ``pending()``, in its order."""
        it = iter(read)
        self._host = [float(next(it)) if isinstance(v, torch.Tensor) else v for v in self._values_in_order()]

    def _values(self) -> list:
        if self._host is None:
            self.resolve(comm.to_host(*self.pending()))
        return self._host

    @property
    def loss(self) -> float:
        return self._values()[0]

    @property
    def grad_norm(self) -> float | None:
        return self._values()[1]

    @property
    def moe_loss(self) -> float | None:
        return self._values()[2]


def gpt_forward_step(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """Megatron's contract: batch["text"] is [b, s+1]; predict token t+1 from tokens <= t.
    Returns the mean lm loss over the micro-batch (scalar, fp32). A model with MoE layers also gets the samples'
    indices (their gates' random draws follow them) and leaves its MoE loss for ``take_moe_loss``."""
    tokens = batch["text"]
    module = getattr(model, "module", model)
    keyed = bool(getattr(module, "moe_layers", None)) and "sample_index" in batch
    extra = {"sample_index": batch["sample_index"]} if keyed else {}
    losses = model(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), **extra)  # [b, s]
    mask = batch.get("loss_mask")
    ulysses = getattr(module, "ulysses", None)
    if ulysses is not None and ulysses.size > 1:  # DeepSpeed-Ulysses: this rank's [b, s/SP] slice; mean over all of s
        return sequence_mean(losses, mask, ulysses, getattr(module, "sequence_grad_scale", 1.0))
    if mask is None:
        return losses.float().mean()
    mask = mask.float()
    return (losses.float() * mask).sum() / mask.sum().clamp(min=1.0)


def train_step(engine, data_iterator: Iterator[dict], num_microbatches: int,
               forward_step: Callable = gpt_forward_step, timers=None) -> StepResult:
    """Run ``num_microbatches`` forward/backward passes then one optimizer step. DeepSpeed scales
    each loss by 1/num_microbatches and averages gradients over DP, so the update is that of the
    mean loss over the global batch. A model with MoE layers adds its MoE loss to each micro-batch's lm loss
    (upstream's loss_func); the two are logged apart.

    The count may change from step to step (--rampup-batch-size): the engine is told the step's global batch
    (``set_train_batch_size``, as upstream does each iteration) and the last micro-batch is marked as the
    accumulation boundary, since DeepSpeed's own boundary counts micro-steps modulo the *current* count. The LR
    schedule moves on by the step's global batch in samples (``lr_kwargs``, as upstream's train_step).
    ``timers``: megatron.training.timers.Timers (--timing-log-level)."""
    timers = timers or _NO_TIMERS
    set_num_microbatches(engine, num_microbatches)
    increment = engine.train_batch_size()
    lr = engine.get_lr()[0]  # the lr this update uses (the scheduler moves on inside engine.step)
    mark = getattr(engine, "set_gradient_accumulation_boundary", None)
    total, moe_total, norm = None, None, None
    module = getattr(engine, "module", engine)
    timers.start("forward-backward")
    for i in range(num_microbatches):
        last = i == num_microbatches - 1
        if mark is not None:
            mark(last)
        PROGRESS.enter("data")  # where the hang watchdog and the straggler report see this rank
        with timers("batch-generator"):
            batch = next(data_iterator)
        PROGRESS.enter("forward")
        loss = forward_step(engine, batch)
        moe = module.take_moe_loss() if hasattr(module, "take_moe_loss") else None
        PROGRESS.enter("backward")
        engine.backward(loss if moe is None else loss + moe)
        if last and _plain_fp32(engine):
            # DeepSpeed records no norm on this path; grads are DP-reduced by now, so measure them here.
            norm = grad_norm(engine.module.parameters(), engine.mpu)
        if last:  # the boundary step is the optimizer step, timed apart as upstream's
            timers.stop("forward-backward")
            timers.start("optimizer")
            PROGRESS.enter("optimizer")
        engine.step(lr_kwargs={"increment": increment})
        # Summed on the device in micro-batch order: no host sync per micro-batch.
        total = loss.detach().float() if total is None else total + loss.detach().float()
        if moe is not None:
            moe_total = moe.detach() if moe_total is None else moe_total + moe.detach()
    timers.stop("optimizer")
    PROGRESS.enter("step end")
    skipped = bool(getattr(engine, "skipped_steps", 0)) and _last_step_skipped(engine)
    norm = engine.get_global_grad_norm() if norm is None else norm
    scale = getattr(engine.optimizer, "loss_scale", None) if engine.fp16_enabled() else None
    moe_mean = None if moe_total is None else moe_total / num_microbatches
    return StepResult(total / num_microbatches, norm, skipped, lr, scale, engine.get_lr()[0], moe_mean)


def set_num_microbatches(engine, num_microbatches: int) -> None:
    """Make ``engine`` accumulate ``num_microbatches`` micro-batches per step (a no-op when it already does)."""
    if engine.gradient_accumulation_steps() == num_microbatches:
        return
    if not hasattr(engine, "set_train_batch_size"):
        raise RuntimeError(f"{type(engine).__name__} runs a fixed number of micro-batches per step")
    engine.set_train_batch_size(engine.train_batch_size() // engine.gradient_accumulation_steps() * num_microbatches)


def _plain_fp32(engine) -> bool:
    return not (engine.zero_optimization() or engine.fp16_enabled() or engine.bfloat16_enabled())


def _last_step_skipped(engine) -> bool:
    opt = engine.optimizer
    return bool(getattr(opt, "overflow", False))
