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
from collections.abc import Callable
from dataclasses import dataclass

from deepspeed.accelerator import get_accelerator

from megatron import faults, initialize, topology
from megatron.checkpointing import Resume, open_checkpoint
from megatron.checkpointing.support import check_supported as check_checkpoint_support
from megatron.config import DataConfig, RunConfig
from megatron.core.parallel_state import ParallelState
from megatron.engine import build_ds_config, initialize_engine, is_pipeline, log_notes
from megatron.errors import MegatronError
from megatron.optim.schedule_config import micro_batch_plan
from megatron.preflight import preflight
from megatron.preflight.layout import check_layout
from megatron.preflight.node_range import check_node_range
from megatron.progress import PROGRESS
from megatron.resilience.control import Decision
from megatron.resilience.supervisor import SaveFn, Supervisor, tracks_collectives
from megatron.tokenizer import Vocabulary
from megatron.training.evaluate import Evaluation, dp_mean
from megatron.training.iteration_log import IterationLog
from megatron.training.layout_report import layout_report, model_features
from megatron.training.log import print_rank0
from megatron.training.memory_check import check_memory
from megatron.training.pipe_step import pipe_train_step
from megatron.training.profiler import StepProfiler
from megatron.training.step import set_num_microbatches, train_step
from megatron.training.streams import data_streams


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
    check_node_range(run, max(1, ranks.local_world_size))  # every node count a campaign's successor may get
    rt = run.runtime
    PROGRESS.restart(faults.from_environ())  # a test's MEGATRON_FAULT, armed for this run (docs/faults.md)
    pstate = initialize.initialize_megatron(run.parallel.tp, run.parallel.pp, run.training.seed,
                                            rt.distributed_backend, rt.distributed_timeout_minutes, rt.master_addr,
                                            rt.master_port, rt.rendezvous_timeout_secs, ulysses=run.parallel.ulysses,
                                            track_collectives=tracks_collectives(rt),
                                            ep=run.parallel.ep if run.model.moe.enabled else None)
    rank = pstate.global_rank
    print_rank0(f"> ranks discovered via {ranks.source} ({ranks.world_size} ranks, "
                f"{ranks.local_world_size} per node)", rank)
    supervisor = Supervisor(run, rank, pstate.world_size, ranks.local_world_size)
    together = True
    try:
        supervisor.start()  # the watchdog: lost and stuck ranks are named from the model build on
        check_memory(run, pstate, ranks.local_world_size)  # one line, before anything is allocated
        if rank == 0:
            print(layout_report(run, pstate), flush=True)
        model = providers.model(run, pstate)
        n_params = sum(p.numel() for p in model.parameters())
        print_rank0(f"> built {type(model).__name__}: {run.model.num_layers} layers, "
                    f"{n_params / 1e6:.3f}M parameters on this rank (full model "
                    f"{run.model.num_parameters(run.parallel.tp) / 1e6:.3f}M)", rank)
        print_rank0(model_features(model), rank)
        checkpointer = open_checkpoint(run, pstate, ds_config)  # what --load holds; the format this engine writes
        checkpointer.load_into_model(model)  # a full-state or upstream --load goes in before ZeRO partitions it
        engine = initialize_engine(model, run, pstate, ds_config)
        print_rank0(f"> DeepSpeed engine ready (ZeRO-{run.parallel.zero_stage}, "
                    f"grad accumulation {run.training.grad_accumulation_steps(pstate.dp.size)})", rank)
        PROGRESS.enter("load")
        resume = checkpointer.resume(engine)
        return _train(run, pstate, engine, providers, tokenizer, resume, supervisor,
                      lambda it, consumed, saver: checkpointer.save(engine, it, consumed, saver), eod)
    except BaseException as e:
        # A MegatronError not marked every_rank is raised by every rank at the same point: they can still meet.
        together = isinstance(e, MegatronError) and not e.every_rank
        supervisor.on_error(e)  # the failure record; out of memory or a failed collective: the watchdog's line
        raise
    finally:
        supervisor.stop()
        initialize.shutdown(barrier=together)


def _train(run: RunConfig, pstate: ParallelState, engine, providers: Providers, tokenizer: Vocabulary,
           resume: Resume, supervisor: Supervisor, save: SaveFn, eod: int | None = None) -> dict:
    """The training loop: the data, the log and the evaluation set up, then one step after another from ``resume``
    until the end, a stop or an error, with ``supervisor`` told after each step (``save``: one checkpoint).
    ``eod``: the end-of-document token --eod-mask-loss masks (None: no mask)."""
    opts, t, rank, dp = run.logging, run.training, pstate.global_rank, pstate.dp
    for note in opts.notes:
        print_rank0(f"> {note}", rank)
    plan = micro_batch_plan(run)  # the global batch of each step (--rampup-batch-size), from the consumed samples
    pipelined = is_pipeline(engine)
    data = data_streams(run, pstate, providers.datasets, tokenizer, plan, resume.consumed_samples, eod, pipelined)
    log = IterationLog(run, pstate, engine, resume.iteration)
    evaluation = Evaluation(engine, run, pstate, providers.forward_step, pipelined, data.valid, data.test,
                            resume.iteration, log.logger, data.batches, plan, supervisor.evaluated)
    # deadline, --async-save, signals, stragglers; an evaluation an earlier job moved here
    supervisor.begin(resume.iteration, save, log.writer, data.valid is not None, data.test is not None)
    profiler = StepProfiler(run.profile, rank, get_accelerator().device_name())  # --profile: upstream's window
    resume.restore_rng()
    _announce(run, rank)
    scheduler, seq = getattr(engine, "lr_scheduler", None), run.model.seq_length
    it, consumed, decision = resume.iteration, resume.consumed_samples, Decision()
    if supervisor.moved_evaluation is not None:  # the straight run's evaluation of this iteration, first
        if evaluation.moved(it, consumed, supervisor.evaluation_guard("moved", it)):
            supervisor.moved_evaluation_done()
        decision = supervisor.stopped_before_training() or decision
    for it in range(resume.iteration + 1, 0 if opts.skip_train or decision.exit else t.train_iters + 1):
        if t.train_tokens is not None and consumed * seq >= t.train_tokens:
            it -= 1  # upstream's loop condition: stop once --train-tokens are consumed
            print_rank0(f"> --train-tokens {t.train_tokens} consumed after iteration {it}", rank)
            break
        if scheduler is not None:
            scheduler.consumed_tokens = consumed * seq  # upstream's args.consumed_train_tokens, before the step
        step_gbs = plan.global_batch(consumed)
        n_micro = step_gbs // (t.micro_batch_size * dp.size)
        PROGRESS.start_iteration(it)
        profiler.begin()
        if pipelined:
            set_num_microbatches(engine, n_micro)  # the pipeline engine's schedule follows its accumulation steps
            res = pipe_train_step(engine, data.train)
        else:
            res = train_step(engine, data.train, n_micro, providers.forward_step, log.timers)
        consumed += step_gbs
        # Every rank's flags (signal, time, kill switch, job end, NaN, the save in flight) and this step's loss and
        # grad norm in one read-back: the iteration's one host sync. Acted on after the log: a failure is logged.
        supervisor.after_step(it, res)
        profiler.end()
        log.record(it, res, consumed, step_gbs)
        evaluation.periodic(it, consumed, n_micro, supervisor.evaluation_guard("periodic", it))
        decision = supervisor.decide(it, consumed)  # save? exit? why (it saves when due)
        if decision.exit:
            break
    supervisor.end(it, consumed)  # the final save, the save in flight committed
    final = None
    # Upstream evaluates at the end with the micro-batch count of the last step it ran (the one a checkpoint
    # set under --skip-train): they differ when a ramp step falls on the last iteration.
    end_micro = n_micro if it > resume.iteration else plan.global_batch(consumed) // (t.micro_batch_size * dp.size)
    if not decision.exit:  # upstream exits (sys.exit) on these before its final evaluation
        final = evaluation.at_end(it, consumed, write_tensorboard=not opts.skip_train, num_microbatches=end_micro,
                                  goes_on=supervisor.evaluation_guard("end", it))
    supervisor.finish(it, consumed, evaluated=final is not None)  # the ``finished`` marker
    final = final or {}
    log.close()
    return log.summary(it, consumed, decision.reason if decision.exit else None, final, evaluation.losses,
                       supervisor.named_stragglers)


def _announce(run: RunConfig, rank: int) -> None:
    """What the loop is about to do, where upstream says it: --skip-train, the batch ramp."""
    t = run.training
    if run.logging.skip_train:
        print_rank0("skipping training (--skip-train is on) ...", rank)  # upstream's words
    if t.rampup_batch_size is not None:
        start, incr, ramp = t.rampup_batch_size
        print_rank0(f"> global batch size ramps from {start} to {t.global_batch_size} by {incr} over {ramp} samples "
                    f"({t.train_iters} iterations in all)", rank)
