"""One training / evaluation iteration on DeepSpeed's pipeline engine (``train_batch`` / ``eval_batch``).

The engine pulls micro-batches itself, on first-stage ranks (tokens) and last-stage ranks (labels) only,
and on every TP rank separately without checking that they agree. ``pipe_microbatches`` therefore derives
each micro-batch from the sample index alone (our datasets are deterministic per index), so every TP rank
of a stage loads the same micro-batches, sharded by DP rank exactly as the plain engine's loop does.
A model with experts also takes the samples' indices on the first stage (its gates' random draws follow them).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from megatron.training.step import StepResult


def to_pipe_batch(batch: dict, sample_index: bool = False) -> tuple:
    """Megatron's {"text": [b, s+1]} -> (tokens [b, s], (labels [b, s], loss_mask [b, s])); with ``sample_index``
    (a model with experts, when the batch carries it) the first element is (tokens, sample_index [b])."""
    text = batch["text"]
    tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
    mask = batch.get("loss_mask")
    mask = torch.ones_like(labels, dtype=torch.float32) if mask is None else mask.float()
    if sample_index and "sample_index" in batch:
        return (tokens, batch["sample_index"]), (labels, mask)
    return tokens, (labels, mask)


def pipe_microbatches(batches: Iterator[dict], sample_index: bool = False) -> Iterator[tuple]:
    for batch in batches:
        yield to_pipe_batch(batch, sample_index)


def pipe_train_step(engine, data_iterator: Iterator[tuple]) -> StepResult:
    """One optimizer step over ``gradient_accumulation_steps`` micro-batches through the 1F1B schedule.

    ``StepResult.loss`` is this DP rank's mean over its micro-batches (the engine broadcasts it from the
    last stage to every stage), so the caller's DP mean gives the same lm loss as the plain path. With experts the
    engine's loss is lm + MoE loss: the lm and MoE losses come from its additional losses instead, which it has
    already averaged over DP (the caller's DP mean leaves them as they are).
    """
    lr = engine.get_lr()[0]
    engine.train_batch(data_iter=data_iterator)
    # Kept on the device (a copy: the engine reuses its buffer); StepResult reads them in one host sync.
    extra = engine.agg_additional_losses
    moe = None
    if extra is not None and "moe loss" in extra:
        loss, moe = extra["lm loss"].detach().float().clone(), extra["moe loss"].detach().float().clone()
    else:
        loss = engine.dp_group_loss.detach().float().clone()
    norm = engine.get_global_grad_norm()
    if norm is None:
        norm = getattr(engine.optimizer, "megatron_grad_norm", None)
    opt = engine.optimizer
    skipped = bool(getattr(opt, "overflow", False))
    scale = getattr(opt, "cur_scale", None) if engine.fp16_enabled() else None
    return StepResult(loss, norm, skipped, lr, scale, engine.get_lr()[0], moe)


def pipe_evaluate_batch(engine, data_iterator: Iterator[tuple]) -> float:
    """Mean lm loss of one global batch on this DP rank's pipeline (broadcast to every stage)."""
    out = engine.eval_batch(data_iterator, reduce_output="avg", bcast_loss=True)
    return float(out.item())
