"""``pretrain()``: set up and train from a validated RunConfig. Entry scripts parse the flags once
(megatron/arguments ``configure``, as pretrain_gpt.py does) and supply providers; this runs the loop.

    pretrain(run, tokenizer, Providers(model, datasets, forward_step, tokenizer), ranks)

model(run, pstate) -> nn.Module
datasets(run, tokenizer, train_valid_test_num_samples) -> (train, valid, test); test (or valid) may be None
forward_step(model, batch) -> scalar loss
tokenizer(data: DataConfig) -> the data's tokenizer (``vocab_size``; ``eod``, None when the data has no documents)

Only config objects travel from here on. Every check a user can fail happens before any process group exists: one
line, exit 2, no hang.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from deepspeed.accelerator import get_accelerator

from megatron import initialize, topology
from megatron.checkpointing import Resume, load_checkpoint, load_full_state, save_checkpoint
from megatron.checkpointing.async_save import AsyncSaver
from megatron.checkpointing.support import check_supported as check_checkpoint_support
from megatron.config import DataConfig, RunConfig
from megatron.core.parallel_state import ParallelState
from megatron.core.ulysses import sequence_slices
from megatron.data.num_samples import train_valid_test_num_samples
from megatron.engine import build_ds_config, initialize_engine, is_pipeline, log_notes
from megatron.errors import MegatronError
from megatron.optim.schedule_config import micro_batch_plan
from megatron.preflight import preflight
from megatron.preflight.layout import check_layout
from megatron.progress import PROGRESS, describe_out_of_memory, is_out_of_memory
from megatron.training.batches import eod_loss_mask, microbatches
from megatron.training.control import RunControl
from megatron.training.deadline import DeadlineSettings, start_deadline
from megatron.training.evaluate import Evaluation, dp_mean
from megatron.training.failure_record import DEVICE_ERROR, OUT_OF_MEMORY, FailureLog, device_error
from megatron.training.layout_report import layout_report, model_features
from megatron.training.log import TrainingLogger, print_rank0
from megatron.training.memory_check import check_memory
from megatron.training.model_stats import optimizer_stats, params_norm
from megatron.training.peak import device_peak_tflops
from megatron.training.pipe_step import pipe_microbatches, pipe_train_step
from megatron.training.profiler import StepProfiler
from megatron.training.run_files import write_finished
from megatron.training.step import set_num_microbatches, train_step
from megatron.training.stragglers import StragglerDetector
from megatron.training.tensorboard import open_writer, write_optimizer_stats
from megatron.training.timers import Timers
from megatron.tokenizer import Vocabulary
from megatron.training.watchdog import WatchdogSettings, start_watchdog


@dataclass
class Providers:
    model: Callable
    datasets: Callable
    forward_step: Callable
    tokenizer: Callable[[DataConfig], Vocabulary]
    """The data's tokenizer, built once from the data settings: its vocabulary (before padding) sizes the model,
    its end-of-document token is what --eod-mask-loss masks."""


_dp_mean = dp_mean  # the DP average of a host number or device scalar (tests import it from here)


def pretrain(run: RunConfig, tokenizer: Vocabulary, providers: Providers, ranks: topology.RankInfo) -> dict:
    """Set up and train. ``ranks``: this process's place, as discovered from the launcher (the world size ``run`` was
    configured for). Returns a summary (first/last loss) for scripts and tests."""
    kill = run.runtime.kill_switch_file
    if kill and os.path.exists(kill):  # upstream: exit 0 before training
        print(f"> kill switch {kill} is present: exiting before training (remove it to train)", flush=True)
        return {"iterations": 0, "exit_reason": f"kill switch {kill}"}
    eod = tokenizer.eod if run.data.eod_mask_loss else None
    # Ranks per node come from the launcher (Slurm/torchrun/MPI), never from device_count(): under
    # Frontier's --gpus-per-task=1 every process sees exactly one device.
    topology.check_tp_within_node(ranks.world_size, run.parallel.tp, run.parallel.pp,
                                  ranks_per_node=max(1, ranks.local_world_size),
                                  allow_tp_across_nodes=run.runtime.allow_tp_across_nodes)
    ds_config = build_ds_config(run)
    log_notes(ds_config, ranks.rank)  # JSON keys with no effect, unused optimizer/scheduler sections: said once
    check_checkpoint_support(run, ds_config, run.checkpoint)  # engine x --save/--load: refused now, not at a save
    preflight(run)  # data files, --load metadata, --save writable: still no process group
    check_layout(ds_config)  # hierarchical ZeRO needs whole nodes
    rt = run.runtime
    PROGRESS.restart()
    # Collectives record where each rank waits when something reads it: the hang watchdog or the straggler report.
    tracked = rt.watchdog_timeout_secs > 0 or rt.straggler_interval != 0
    pstate = initialize.initialize_megatron(run.parallel.tp, run.parallel.pp, run.training.seed,
                                            rt.distributed_backend, rt.distributed_timeout_minutes, rt.master_addr,
                                            rt.master_port, rt.rendezvous_timeout_secs, sp=run.parallel.sp,
                                            track_collectives=tracked,
                                            ep=run.parallel.ep if run.model.moe.enabled else None)
    rank = pstate.global_rank
    print_rank0(f"> ranks discovered via {ranks.source} ({ranks.world_size} ranks, "
                f"{ranks.local_world_size} per node)", rank)
    watchdog, failed, together = None, False, True
    try:
        watchdog = start_watchdog(WatchdogSettings.from_runtime(rt, run.checkpoint.save))
        check_memory(run, pstate, ranks.local_world_size)  # one line, before anything is allocated
        if rank == 0:
            print(layout_report(run, pstate), flush=True)
        model = providers.model(run, pstate)
        n_params = sum(p.numel() for p in model.parameters())
        print_rank0(f"> built {type(model).__name__}: {run.model.num_layers} layers, "
                    f"{n_params / 1e6:.3f}M parameters on this rank (full model "
                    f"{run.model.num_parameters(run.parallel.tp) / 1e6:.3f}M)", rank)
        print_rank0(model_features(model), rank)
        full = load_full_state(model, run, pstate, run.checkpoint)  # a full-state --load goes in before ZeRO
        engine = initialize_engine(model, run, pstate, ds_config)
        print_rank0(f"> DeepSpeed engine ready (ZeRO-{run.parallel.zero_stage}, "
                    f"grad accumulation {run.training.grad_accumulation_steps(pstate.dp.size)})", rank)
        PROGRESS.enter("load")
        resume = load_checkpoint(engine, run, pstate, run.checkpoint, full)
        return _train(run, pstate, engine, providers, tokenizer, resume, eod, max(1, ranks.local_world_size))
    except BaseException as e:
        failed = True
        # A MegatronError not marked every_rank is raised by every rank at the same point: they can still meet.
        together = isinstance(e, MegatronError) and not e.every_rank
        failures = FailureLog.in_folder(run.checkpoint.save)  # for the next job's choice of nodes
        if failures is not None and isinstance(e, Exception) and is_out_of_memory(e):  # run_cli prints the same line
            failures.write(rank, PROGRESS.identity.host, OUT_OF_MEMORY, describe_out_of_memory(e))
        elif failures is not None and device_error(e):
            failures.write(rank, PROGRESS.identity.host, DEVICE_ERROR, str(e))
        if watchdog is not None and isinstance(e, Exception):
            watchdog.on_error(e)  # out of memory: the others exit with its line; a failed collective: the verdict
        raise
    finally:
        if watchdog is not None:
            watchdog.stop(clean=not failed)
        initialize.shutdown(barrier=together)


def _train(run: RunConfig, pstate: ParallelState, engine, providers: Providers, tokenizer: Vocabulary,
           resume: Resume, eod: int | None = None, ranks_per_node: int = 1) -> dict:
    """The training loop. ``eod``: the end-of-document token --eod-mask-loss masks (None: no mask).
    ``ranks_per_node``: ranks sharing this host's memory (--async-save's host copies)."""
    opts, ckpt, t = run.logging, run.checkpoint, run.training
    rank = pstate.global_rank
    gbs = t.global_batch_size
    for note in opts.notes:
        print_rank0(f"> {note}", rank)
    plan = micro_batch_plan(run)  # the global batch of each step (--rampup-batch-size), from the consumed samples
    # Upstream's sample counts: train (--train-samples, else iterations x global batch, and never fewer than the
    # iterations consume: upstream's ramp arithmetic can overshoot a tiny --train-samples), every evaluation's valid
    # batches, and one evaluation's test batches.
    num_samples = train_valid_test_num_samples(t.train_iters, max(plan.samples_after(t.train_iters),
                                                                  t.train_samples or 0), gbs,
                                               t.eval_interval, t.eval_iters)
    train_ds, valid_ds, test_ds = (*providers.datasets(run, tokenizer, num_samples), None)[:3]
    mbs, dp = t.micro_batch_size, pstate.dp
    loading = {"num_workers": run.data.num_workers, "dataloader_type": run.data.dataloader_type, "seed": t.seed,
               "data_sharding": run.data.data_sharding}
    def stream(dataset, start: int):
        """This DP rank's micro-batches of ``dataset`` from sample ``start`` (--eod-mask-loss masks added); SP
        peers load the same micro-batches (same DP rank), then each keeps its slice of the sequence."""
        batches = microbatches(dataset, start, mbs, dp.rank, dp.size, **loading)
        return sequence_slices(batches if eod is None else eod_loss_mask(batches, eod), pstate.sp)

    train_data = stream(train_ds, resume.consumed_samples)
    seq = run.model.seq_length
    scheduler = getattr(engine, "lr_scheduler", None)
    pipelined = is_pipeline(engine)
    if pipelined:  # the engine pulls (tokens, (labels, mask)) micro-batches itself, gas of them per step
        train_data = pipe_microbatches(train_data, sample_index=run.model.moe.enabled)

    peak, peak_src = device_peak_tflops(run.precision.name, t.peak_tflops)
    print_rank0(f"> MFU peak: {peak:.3f} TFLOP/s per device ({peak_src})", rank)
    # Upstream writes nothing to TensorBoard under --skip-train (not even the flags).
    writer = None if opts.skip_train else open_writer(opts, rank, run.flags, resume.iteration)
    logger = TrainingLogger(run, rank, run.model.padded_vocab_size(run.parallel.tp), peak, writer, opts)
    timers = Timers(opts.timing_level, opts.timing_option, opts.barrier_l1)
    evaluation = Evaluation(engine, run, pstate, providers.forward_step, pipelined, valid_ds, test_ds,
                            resume.iteration, logger, stream, plan)
    first_loss = last_loss = None
    consumed, interval_sum, interval_n, interval_moe = resume.consumed_samples, 0.0, 0, 0.0
    rt = run.runtime
    deadline = start_deadline(DeadlineSettings.from_run(run), run, pstate.world_size, rank)
    saver = AsyncSaver(run, ranks_per_node) if ckpt.save and ckpt.async_save else None
    control = RunControl(ckpt.save_interval, rt.exit_interval, rt.exit_duration_in_mins, rt.max_nonfinite_loss_iters,
                         saving=bool(ckpt.save), kill_switch_file=rt.kill_switch_file, checks_files=rank == 0,
                         saver=saver, deadline=deadline)
    if saver is not None and deadline is not None:  # a background save's whole cost: copy, write and commit
        saver.on_committed = deadline.saved

    def save(it: int) -> None:
        PROGRESS.enter("save")
        began = time.monotonic()
        save_checkpoint(engine, it, consumed, run, pstate, saver)
        if deadline is not None and saver is None:  # the measure the next save is predicted from (this job, the next)
            deadline.saved(time.monotonic() - began, it)

    losses, moe_losses, lrs, printed_lrs, batch_sizes, it, decision = {}, {}, {}, {}, {}, resume.iteration, None
    profiler = StepProfiler(run.profile, rank, get_accelerator().device_name())  # --profile: upstream's window
    stragglers = StragglerDetector(rt, rank, pstate.world_size, resume.iteration + 1, writer,
                                   FailureLog.in_folder(ckpt.save))
    resume.restore_rng()
    if opts.skip_train:
        print_rank0("skipping training (--skip-train is on) ...", rank)  # upstream's words
    if t.rampup_batch_size is not None:
        start, incr, ramp = t.rampup_batch_size
        print_rank0(f"> global batch size ramps from {start} to {gbs} by {incr} over {ramp} samples "
                    f"({t.train_iters} iterations in all)", rank)
    if deadline is not None:
        deadline.begin()  # the set-up above is no step
    for it in range(resume.iteration + 1, 0 if opts.skip_train else t.train_iters + 1):
        if t.train_tokens is not None and consumed * seq >= t.train_tokens:
            it -= 1  # upstream's loop condition: stop once --train-tokens are consumed
            print_rank0(f"> --train-tokens {t.train_tokens} consumed after iteration {it}", rank)
            break
        if scheduler is not None:
            scheduler.consumed_tokens = consumed * seq  # upstream's args.consumed_train_tokens, before the step
        step_gbs = plan.global_batch(consumed)
        n_micro = step_gbs // (mbs * dp.size)
        PROGRESS.start_iteration(it)
        profiler.begin()
        if pipelined:
            set_num_microbatches(engine, n_micro)  # the pipeline engine's schedule follows its accumulation steps
            res = pipe_train_step(engine, train_data)
        else:
            res = train_step(engine, train_data, n_micro, providers.forward_step, timers)
        consumed += step_gbs
        # All ranks agree on signal / time / NaN; the same read-back brings res.loss and res.grad_norm to the
        # host (the iteration's one host sync). Acted on after the log, so a failing iteration is logged first.
        flags = control.exchange(res)
        profiler.end()
        PROGRESS.end_step()
        stragglers.after_iteration(it)
        interval_sum, interval_n = interval_sum + res.loss, interval_n + 1
        interval_moe += res.moe_loss or 0.0  # MoE layers: their loss, logged beside the lm loss
        log_now = it % t.log_interval == 0 or it == t.train_iters
        tb_now = opts.tb_step(it)  # the same on every rank: the reductions below are collectives
        if opts.params_norm and (log_now or tb_now):
            logger.params_norm = params_norm(engine.module, pstate)
        if tb_now:  # upstream writes each iteration's own loss (DP mean), not the interval's
            moe_tb = None if res.moe_loss is None else res.moe_loss if dp.size == 1 else dp_mean(res.moe_loss, pstate)
            logger.tensorboard(it, res.loss if dp.size == 1 else dp_mean(res.loss, pstate), res, consumed,
                               step_gbs, moe_loss=moe_tb)
            if opts.optimizer_states_to_tb:
                stats = optimizer_stats(engine.optimizer, pstate, engine.zero_optimization_stage())
                if writer is not None:
                    write_optimizer_stats(writer, stats, it, consumed * run.model.seq_length)
            timers.write(writer, it, normalizer=max(1, interval_n))
        loss = None
        if log_now:  # Megatron's log: the mean over the interval, averaged over DP (one all-reduce)
            loss = dp_mean(interval_sum / interval_n, pstate)
            logger.moe_loss = None if res.moe_loss is None else dp_mean(interval_moe / interval_n, pstate)
            if logger.moe_loss is not None:
                moe_losses[it] = logger.moe_loss
            interval_sum, interval_n, interval_moe = 0.0, 0, 0.0
            losses[it] = loss
            first_loss = loss if first_loss is None else first_loss
            last_loss = loss
        logger.iteration(it, loss, res, consumed, step_gbs)
        if log_now:
            report = timers.report(normalizer=t.log_interval)
            if report:
                print_rank0(report, rank)
        lrs[it] = res.lr  # the lr this iteration's update used (tests compare resumed and straight runs)
        printed_lrs[it] = res.next_lr  # the lr the log prints (upstream's: the next update's)
        batch_sizes[it] = step_gbs
        PROGRESS.enter("eval")
        evaluation.periodic(it, consumed, n_micro)
        decision = control.decide(it, flags)  # save? exit? persistent NaN? a background save to commit?
        if decision.save:
            save(it)
        if decision.exit:
            print_rank0(f"> exiting at iteration {it} after a checkpoint: {decision.reason}", rank)
            break
    control.close()
    if ckpt.save and it > resume.iteration and not (decision and decision.save):
        save(it)  # the end of training is always kept
    if saver is not None:  # every end of a run (signal, --exit-*, kill switch, deadline, last iteration) commits it
        saver.finish("before exiting")
    reached_end = it >= t.train_iters or not (decision and decision.exit)  # (an exit may fall on the last step)
    if ckpt.save and rank == 0 and not opts.skip_train and reached_end:
        write_finished(ckpt.save, it, consumed)  # the batch scripts stop the job chain on it
    PROGRESS.enter("eval")
    final = {}
    # Upstream evaluates at the end with the micro-batch count of the last step it ran (the one a checkpoint
    # set under --skip-train): they differ when a ramp step falls on the last iteration.
    end_micro = n_micro if it > resume.iteration else plan.global_batch(consumed) // (mbs * dp.size)
    if not (decision and decision.exit):  # upstream exits (sys.exit) on these before its final evaluation
        final = evaluation.at_end(it, consumed, write_tensorboard=not opts.skip_train,
                                  num_microbatches=end_micro)
    if writer is not None:
        writer.close()
        print_rank0(f"> TensorBoard event files in {opts.tensorboard_dir}", rank)
    return {"first_loss": first_loss, "last_loss": last_loss, "iterations": it, "losses": losses,
            "moe_losses": moe_losses, "lrs": lrs,
            "printed_lrs": printed_lrs, "batch_sizes": batch_sizes, "consumed_samples": consumed,
            "exit_reason": decision.reason if decision and decision.exit else None, "final_eval": final,
            "valid_losses": evaluation.losses, "stragglers": stragglers.named}
