"""The single-process reference every parallel layout is checked against: no DeepSpeed, no process group,
torch AdamW + clip_grad_norm_ + our LR schedule, on the deterministic mock data; weight decay split by upstream's
rule (tests/upstream_weight_decay.py), not by ours."""

from __future__ import annotations

import torch

from tests.upstream_weight_decay import upstream_param_groups


def reference_losses(run, steps: int, dataset_size: int = 4000, data_seed: int = 9) -> list[float]:
    """Mean lm loss of each of ``steps`` iterations of ``run`` (a validated RunConfig) on one process."""
    return reference_losses_and_norms(run, steps, dataset_size, data_seed)[0]


def reference_losses_and_norms(run, steps: int, dataset_size: int = 4000,
                               data_seed: int = 9) -> tuple[list[float], list[float]]:
    """``reference_losses`` and each iteration's gradient norm before clipping: Adam and active clipping hide a
    uniformly scaled gradient from the losses, the norm does not."""
    losses, norms, _ = reference_run(run, steps, dataset_size, data_seed)
    return losses, norms


def reference_run(run, steps: int, dataset_size: int = 4000,
                  data_seed: int = 9) -> tuple[list[float], list[float], list[float] | None]:
    """``reference_losses_and_norms`` and, for a model with MoE layers, each iteration's mean MoE loss (added to
    the lm loss in the backward, as train_step does; None without MoE)."""
    from megatron.core.parallel_state import single_process_state
    from megatron.data.mock_dataset import MockGPTDataset
    from megatron.model.gpt_model import GPTModel
    from megatron.training.batches import microbatches
    from megatron.optim.lr_schedule import OptimizerParamScheduler
    from megatron.training.step import gpt_forward_step

    m, o, t = run.model, run.optimizer, run.training
    model = GPTModel(m, tp=single_process_state().tp, init_seed=t.seed)
    groups = upstream_param_groups(model, o.weight_decay)
    if o.optimizer == "sgd":  # --optimizer sgd: torch's SGD, L2 weight decay per group, as upstream
        opt = torch.optim.SGD(groups, lr=o.lr, momentum=o.sgd_momentum)
    else:
        opt = torch.optim.AdamW(groups, lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps)
    import dataclasses

    # Megatron-DeepSpeed's schedule over ``steps`` iterations: counted in samples, first update at position 0.
    sched = OptimizerParamScheduler.from_run(opt, dataclasses.replace(run, training=dataclasses.replace(
        t, train_iters=steps)))
    mbs = t.micro_batch_size
    n_micro = t.global_batch_size // mbs
    data = microbatches(MockGPTDataset(dataset_size, m.seq_length, m.vocab_size, seed=data_seed), 0, mbs, 0, 1,
                        "cpu")
    losses, norms, moe_losses = [], [], []
    for _ in range(steps):
        opt.zero_grad()
        total, moe_total = 0.0, 0.0
        for _ in range(n_micro):
            loss = gpt_forward_step(model, next(data))
            moe = model.take_moe_loss()
            ((loss if moe is None else loss + moe) / n_micro).backward()
            total += loss.item()
            moe_total += 0.0 if moe is None else moe.item()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_grad if o.clip_grad > 0 else float("inf"))
        opt.step()
        sched.step(t.global_batch_size)
        losses.append(total / n_micro)
        norms.append(norm.item())
        moe_losses.append(moe_total / n_micro)
    return losses, norms, moe_losses if run.model.moe.enabled else None
