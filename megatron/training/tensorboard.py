"""TensorBoard scalars under upstream Megatron-DeepSpeed's tags, so its analysis scripts read our runs.

Most series come three times, as upstream's: ``<group>/<name>`` against the iteration, ``... vs samples`` against
consumed samples and ``... vs tokens`` against consumed tokens. Only rank 0 writes (upstream: the last rank;
every value written here is the same on all ranks).
"""

from __future__ import annotations

import math

from deepspeed.accelerator import get_accelerator

from megatron.config.log import LogOptions


def open_writer(opts: LogOptions, rank: int, flags: dict | None = None, iteration: int = 0):
    """SummaryWriter on rank 0 when --tensorboard-dir is set (queue of --tensorboard-queue-size events), with every
    flag (``RunConfig.flags``) written as text at the start iteration, as upstream's write_args_to_tensorboard."""
    if not opts.tensorboard or rank != 0:
        return None
    from torch.utils.tensorboard import SummaryWriter

    print("> setting tensorboard ...", flush=True)
    writer = SummaryWriter(log_dir=opts.tensorboard_dir, max_queue=opts.tensorboard_queue_size)
    if flags is not None:
        for name, value in sorted(flags.items()):
            writer.add_text(name, str(value), global_step=iteration)
    return writer


def _series(writer, tag: str, value: float, it: int, samples: int, tokens: int) -> None:
    writer.add_scalar(tag, value, it)
    writer.add_scalar(f"{tag} vs samples", value, samples)
    writer.add_scalar(f"{tag} vs tokens", value, tokens)


def write_training(writer, opts: LogOptions, it: int, samples: int, tokens: int, *, loss: float, lr: float,
                   batch_size: int, loss_scale: float | None, world_size: int, grad_norm: float | None,
                   params_norm: float | None, seq_length: int | None = None, moe_loss: float | None = None) -> None:
    """Upstream training_log's scalars of one iteration (written at --tensorboard-log-interval); ``moe_loss``: a model
    with experts (upstream writes every key of its loss dict under lm-loss-training/)."""
    writer.add_scalar("steps-vs-samples/y=steps,x=samples", it, samples)
    writer.add_scalar("steps-vs-samples/y=samples,x=steps", samples, it)
    writer.add_scalar("steps-vs-tokens/y=steps,x=tokens", it, tokens)
    writer.add_scalar("steps-vs-tokens/y=tokens,x=steps", tokens, it)
    if opts.lr_to_tb:
        _series(writer, "learning-rate/learning-rate", lr, it, samples, tokens)
    if opts.batch_size_to_tb:
        _series(writer, "batch-size/batch-size", batch_size, it, samples, tokens)
    _series(writer, "lm-loss-training/lm loss", loss, it, samples, tokens)
    if moe_loss is not None:
        _series(writer, "lm-loss-training/moe loss", moe_loss, it, samples, tokens)
    if loss_scale and opts.loss_scale_to_tb:  # fp16 only: bf16/fp32 steps report no scale, as upstream's
        _series(writer, "loss-scale/loss-scale", loss_scale, it, samples, tokens)
    if opts.world_size_to_tb:
        _series(writer, "world-size/world-size", world_size, it, samples, tokens)
    if grad_norm is not None:
        _series(writer, "grad-norm/grad-norm", grad_norm, it, samples, tokens)
    if params_norm is not None:
        _series(writer, "params-norm/params-norm", params_norm, it, samples, tokens)
    if seq_length is not None:  # upstream's pretrain_gpt sets args.actual_seq_length, so it always writes this
        _series(writer, "seqlen/actual_seq_length", seq_length, it, samples, tokens)
    if opts.memory_to_tb:
        acc = get_accelerator()
        stats = acc.memory_stats() or {}
        # Upstream reads torch.cuda.memory_stats(); DeepSpeed's CPU accelerator has only the allocated bytes
        # (the process's resident set), and no allocation count.
        reserved = stats.get("reserved_bytes.all.current", acc.memory_reserved())
        writer.add_scalar("mem-reserved-bytes", reserved, it)
        writer.add_scalar("mem-allocated-bytes", stats.get("allocated_bytes.all.current", acc.memory_allocated()), it)
        if "allocation.all.current" in stats:
            writer.add_scalar("mem-allocated-count", stats["allocation.all.current"], it)


def write_optimizer_stats(writer, stats: dict[str, float], it: int, tokens: int) -> None:
    for name, value in stats.items():
        writer.add_scalar(f"optimizer/{name} vs tokens", value, tokens)
    for name, value in stats.items():
        writer.add_scalar(f"optimizer/{name}", value, it)


def write_iteration_time(writer, seconds: float, it: int, samples: int, tokens: int) -> None:
    """--log-timers-to-tensorboard, at --log-interval: mean seconds per iteration over the interval."""
    _series(writer, "iteration-time/iteration-time", seconds, it, samples, tokens)


def write_evaluation(writer, opts: LogOptions, loss: float, it: int, samples: int, tokens: int,
                     test: bool = False) -> None:
    """Upstream evaluate_and_print_results' scalars: 'lm-loss-validation/lm loss validation' (or '... test')."""
    kind = "test" if test else "validation"
    _series(writer, f"lm-loss-validation/lm loss {kind}", loss, it, samples, tokens)
    if opts.validation_ppl_to_tb:
        _series(writer, f"lm-loss-validation/lm loss {kind} ppl", math.exp(min(20.0, loss)), it, samples, tokens)
