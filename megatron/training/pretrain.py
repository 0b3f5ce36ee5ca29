"""``pretrain()``: the Megatron-style entry point. Entry scripts supply providers; this runs the loop.

    pretrain(argv, model_provider, datasets_provider, forward_step)

model_provider(run, pstate) -> nn.Module
datasets_provider(args, run, train_valid_test_num_samples) -> (train, valid, vocab_size-independent)
forward_step(model, batch) -> scalar loss
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron.arguments import parse_args, run_config_from_args
from megatron.checkpointing import CheckpointSettings, Resume, load_checkpoint, load_full_state, save_checkpoint
from megatron.checkpointing.support import check_supported as check_checkpoint_support
from megatron.config import RunConfig
from megatron.core import comm
from megatron.core.parallel_state import ParallelState
from megatron.core.ulysses import sequence_slices
from megatron.errors import ConfigError
from megatron.preflight import preflight
from megatron.preflight.layout import check_layout
from megatron.training.batches import microbatches
from megatron.training.control import RunControl
from megatron.training.log import TrainingLogger, print_rank0
from megatron.training.peak import device_peak_tflops
from megatron.training.pipe_step import pipe_evaluate_batch, pipe_microbatches, pipe_train_step
from megatron.training.step import train_step
from megatron.training.watchdog import start_watchdog


@dataclass
class Providers:
    model: Callable
    datasets: Callable
    forward_step: Callable
    vocab_size: Callable[[argparse.Namespace], int]
    """Vocabulary size (before padding) implied by the data/tokenizer flags."""


def _dp_mean(value: float | torch.Tensor, pstate: ParallelState) -> float:
    if pstate.dp.size == 1:
        return comm.to_host(value)[0]
    return comm.reduce_host([value], pstate.dp.group)[0] / pstate.dp.size


def evaluate(engine, data, run: RunConfig, pstate: ParallelState, forward_step, iters: int) -> float:
    """Mean lm loss over ``iters`` global batches of the validation set, averaged over DP."""
    engine.eval()
    gas = run.training.grad_accumulation_steps(pstate.dp.size)
    total, n = 0.0, 0
    with torch.no_grad():
        for _ in range(iters * gas):
            total = total + forward_step(engine, next(data)).float()  # summed on the device: no sync per batch
            n += 1
    engine.train()
    return _dp_mean(total / max(1, n), pstate)


def _tensorboard(run: RunConfig, rank: int):
    if not run.training.tensorboard_dir or rank != 0:
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=run.training.tensorboard_dir)


def pretrain(argv, providers: Providers, extra_args=None) -> dict:
    """Parse flags, set up, train. Returns a summary (first/last loss) for scripts and tests."""
    from megatron import topology
    from megatron.engine import build_ds_config, initialize_engine
    from megatron.initialize import initialize_megatron, shutdown

    args = parse_args(argv, extra_args)
    ranks = topology.discover_ranks(os.environ)
    run = run_config_from_args(args, ranks.world_size, providers.vocab_size(args))
    # Ranks per node come from the launcher (Slurm/torchrun/MPI), never from device_count(): under
    # Frontier's --gpus-per-task=1 every process sees exactly one device.
    topology.check_tp_within_node(ranks.world_size, run.parallel.tp, run.parallel.pp,
                                  ranks_per_node=max(1, ranks.local_world_size),
                                  allow_tp_across_nodes=args.allow_tp_across_nodes)
    if run.parallel.pp > 1 and args.no_pipeline_parallel:
        raise ConfigError(f"--no-pipeline-parallel with --pipeline-model-parallel-size {run.parallel.pp}: the plain "
                          "GPTModel has no stages; drop --no-pipeline-parallel or use PP=1")

    # Every check a user can fail happens before any process group exists: one line, exit 2, no hang.
    ds_config = build_ds_config(run, args.deepspeed_config, zero_stage_given=args.zero_stage is not None)
    ckpt = CheckpointSettings.from_args(args)
    check_checkpoint_support(run, ds_config, ckpt)  # engine x --save/--load: refused now, not at the first save
    preflight(args, run, ckpt)  # data files, --load metadata, --save writable: still no process group
    check_layout(ds_config)  # hierarchical ZeRO needs whole nodes
    pstate = initialize_megatron(run.parallel.tp, run.parallel.pp, run.training.seed, args.distributed_backend,
                                 args.distributed_timeout_minutes, sp=run.parallel.sp)
    rank = pstate.global_rank
    print_rank0(f"> ranks discovered via {ranks.source} ({ranks.world_size} ranks, "
                f"{ranks.local_world_size} per node)", rank)
    watchdog = None
    try:
        if rank == 0:
            from megatron.training.layout_report import layout_report

            print(layout_report(run, pstate), flush=True)
        model = providers.model(run, pstate)
        n_params = sum(p.numel() for p in model.parameters())
        print_rank0(f"> built {type(model).__name__}: {run.model.num_layers} layers, "
                    f"{n_params / 1e6:.3f}M parameters on this rank (full model "
                    f"{run.model.num_parameters(run.parallel.tp) / 1e6:.3f}M)", rank)
        full = load_full_state(model, run, pstate, ckpt)  # a full-state --load goes in before ZeRO partitions
        engine = initialize_engine(model, run, pstate, ds_config)
        print_rank0(f"> DeepSpeed engine ready (ZeRO-{run.parallel.zero_stage}, "
                    f"grad accumulation {run.training.grad_accumulation_steps(pstate.dp.size)})", rank)
        resume = load_checkpoint(engine, run, pstate, ckpt, full)
        watchdog = start_watchdog(args.watchdog_timeout_secs)
        return _train(args, run, pstate, engine, providers, resume, ckpt)
    except RuntimeError as e:  # gloo reports a dead peer as DistBackendError or a plain RuntimeError
        if watchdog is not None and (isinstance(e, torch.distributed.DistError) or "peer" in str(e)
                                     or "remote worker" in str(e)):
            watchdog.wait_for_verdict()  # a lost peer: let the watchdog name it in one line
        raise
    finally:
        if watchdog is not None:
            watchdog.stop()
        shutdown()


def _train(args, run: RunConfig, pstate: ParallelState, engine, providers: Providers, resume: Resume,
           ckpt: CheckpointSettings) -> dict:
    from megatron.engine import is_pipeline

    t = run.training
    rank = pstate.global_rank
    gbs = t.global_batch_size
    eval_runs = t.train_iters // t.eval_interval + 1 if t.eval_iters > 0 else 0
    train_ds, valid_ds = providers.datasets(args, run, (t.train_iters * gbs, eval_runs * t.eval_iters * gbs))
    mbs, dp = t.micro_batch_size, pstate.dp
    # SP peers load the same micro-batches (same DP rank), then each keeps its slice of the sequence.
    train_data = sequence_slices(microbatches(train_ds, resume.consumed_samples, mbs, dp.rank, dp.size), pstate.sp)
    gas = t.grad_accumulation_steps(dp.size)
    pipelined = is_pipeline(engine)
    if pipelined:  # the engine pulls (tokens, (labels, mask)) micro-batches itself, gas of them per step
        train_data = pipe_microbatches(train_data)

    peak, peak_src = device_peak_tflops(run.precision.name, t.peak_tflops)
    print_rank0(f"> MFU peak: {peak:.3f} TFLOP/s per device ({peak_src})", rank)
    writer = _tensorboard(run, rank)
    logger = TrainingLogger(run, rank, run.model.padded_vocab_size(run.parallel.tp), peak, writer)
    first_loss = last_loss = None
    consumed, interval_sum, interval_n = resume.consumed_samples, 0.0, 0
    control = RunControl(ckpt.save_interval, args.exit_interval, args.exit_duration_in_mins,
                         args.max_nonfinite_loss_iters, saving=bool(ckpt.save))
    losses, lrs, it, decision = {}, {}, resume.iteration, None
    resume.restore_rng()
    for it in range(resume.iteration + 1, t.train_iters + 1):
        res = pipe_train_step(engine, train_data) if pipelined else train_step(engine, train_data, gas,
                                                                                 providers.forward_step)
        consumed += gbs
        # All ranks agree on signal / time / NaN; the same read-back brings res.loss and res.grad_norm to the
        # host (the iteration's one host sync). Acted on after the log, so a failing iteration is logged first.
        flags = control.exchange(res)
        interval_sum, interval_n = interval_sum + res.loss, interval_n + 1
        log_now = it % t.log_interval == 0 or it == t.train_iters
        loss = None
        if log_now:  # Megatron's log: the mean over the interval, averaged over DP (one all-reduce)
            loss = _dp_mean(interval_sum / interval_n, pstate)
            interval_sum, interval_n = 0.0, 0
            losses[it] = loss
            first_loss = loss if first_loss is None else first_loss
            last_loss = loss
        logger.iteration(it, loss, res, consumed)
        lrs[it] = res.lr  # the lr this iteration's update used (tests compare resumed and straight runs)
        if valid_ds is not None and t.eval_iters > 0 and it % t.eval_interval == 0:
            valid = sequence_slices(microbatches(valid_ds, 0, mbs, dp.rank, dp.size), pstate.sp)
            if pipelined:
                valid = pipe_microbatches(valid)
                loss = sum(pipe_evaluate_batch(engine, valid) for _ in range(t.eval_iters)) / t.eval_iters
                logger.validation(it, loss)
            else:
                logger.validation(it, evaluate(engine, valid, run, pstate, providers.forward_step, t.eval_iters))
        decision = control.decide(it, flags)  # save? exit? persistent NaN?
        if decision.save:
            save_checkpoint(engine, it, consumed, args, run, pstate, ckpt)
        if decision.exit:
            print_rank0(f"> exiting at iteration {it} after a checkpoint: {decision.reason}", rank)
            break
    control.close()
    if ckpt.save and it > resume.iteration and not (decision and decision.save):
        save_checkpoint(engine, it, consumed, args, run, pstate, ckpt)  # the end of training is always kept
    if writer is not None:
        writer.close()
        print_rank0(f"> TensorBoard event files in {run.training.tensorboard_dir}", rank)
    return {"first_loss": first_loss, "last_loss": last_loss, "iterations": it, "losses": losses, "lrs": lrs,
            "exit_reason": decision.reason if decision and decision.exit else None}
