"""The supervisor: a run's life outside the step (lost and stuck ranks, the job's end, signals, stragglers, failure
records, the save in flight) behind one object that pretrain() and the loop call at fixed points.

    supervisor = Supervisor(run, rank, world_size, ranks_per_node)
    supervisor.start()                         before the model build: the watchdog
    supervisor.begin(start_iteration, save)    before the loop: deadline, --async-save saver, run control, stragglers
                                               (and ``moved_evaluation``: an earlier job's, to run first)
    supervisor.after_step(it, res)             after each step: the iteration's one host sync, the straggler report
    supervisor.evaluation_guard(kind, it)      what an evaluation asks after its first batches: go on, or move?
    decision = supervisor.decide(it, consumed) after its log and evaluation: save? exit? why (saves when due)
    supervisor.end(it, consumed)               after the loop: the final save, the save in flight
    supervisor.finish(it, consumed, evaluated) after the end-of-training evaluation: the ``finished`` marker
    supervisor.on_error(error)                 a rank's error: its failure record, the watchdog's verdict
    supervisor.stop()                          always, last: the watchdog stops

Every call is made by every rank at the same point; the collectives inside (the flags all-reduce, the straggler
all-gather, a save, finishing a background save, an evaluation's verdict) are therefore the same, in the same order,
on every rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from megatron.checkpointing.live.async_save import AsyncSaver
from megatron.config import RunConfig
from megatron.config.runtime import RuntimeConfig
from megatron.core import comm
from megatron.progress import PROGRESS, describe_out_of_memory, is_out_of_memory
from megatron.resilience import eval_budget
from megatron.resilience.control import Decision, Flags, RunControl, StepValues
from megatron.resilience.deadline import Deadline, DeadlineSettings, start_deadline
from megatron.resilience.eval_budget import EvalPlan
from megatron.resilience.failure_record import DEVICE_ERROR, OUT_OF_MEMORY, FailureLog, device_error
from megatron.resilience.run_files import (
    clear_moved_evaluation,
    read_moved_evaluation,
    write_finished,
    write_moved_evaluation,
)
from megatron.resilience.stragglers import StragglerDetector
from megatron.resilience.watchdog import Watchdog, WatchdogSettings, start_watchdog

SaveFn = Callable[[int, int, AsyncSaver | None], None]
"""``save(iteration, consumed_samples, saver)``: one checkpoint (collective), written by ``saver`` under
--async-save (None: synchronously)."""
EvalGuard = Callable[[float, float, int], bool]
"""``goes_on(elapsed, batch_secs, batches_left)``: an evaluation's question after its first batches (collective):
``elapsed`` seconds so far, the last batch's seconds, the batches still to run; False: stop it, it moves."""


def tracks_collectives(rt: RuntimeConfig) -> bool:
    """Collectives record where each rank waits when something reads it: the hang watchdog or the straggler report."""
    return rt.watchdog_timeout_secs > 0 or rt.straggler_interval != 0


class Supervisor:
    """One rank's supervisor (see the module docstring for the order of the calls)."""

    def __init__(self, run: RunConfig, rank: int, world_size: int, ranks_per_node: int = 1) -> None:
        """``ranks_per_node``: ranks sharing this host's memory (--async-save's host copies)."""
        self.run, self.rank, self.world_size = run, rank, world_size
        self.ranks_per_node = max(1, ranks_per_node)
        self.failures = FailureLog.in_folder(run.checkpoint.save)
        """--save's failures.jsonl (None without --save), for the next job's choice of nodes."""
        self.watchdog: Watchdog | None = None
        self.deadline: Deadline | None = None
        self.saver: AsyncSaver | None = None
        self.control: RunControl | None = None
        self.stragglers: StragglerDetector | None = None
        self._save_fn: SaveFn | None = None
        self._start_iteration = 0
        self._flags: Flags | None = None
        self._decision: Decision | None = None
        self._failed = False
        self.evals = EvalPlan()
        self._chained = False
        """Evaluations can move to the next job: under Slurm, with --save (the next job resumes from it)."""
        self.moved_evaluation: int | None = None
        """The iteration whose periodic evaluation an earlier job moved to this one (run before the first step)."""
        self._verdict = eval_budget.GO
        """The agreed verdict of the last evaluation judged (reset by ``decide``)."""
        self._stop_reason = ""
        self._job_id: str | None = None

    # ------------------------------------------------------------------ before training
    def start(self) -> None:
        """Every rank, once its process group exists: the watchdog (its own clients of the rendezvous store), so lost
        and stuck ranks are named from here on (before the model build, whose allocations and loads can hang too)."""
        rt, save = self.run.runtime, self.run.checkpoint.save
        self.watchdog = start_watchdog(WatchdogSettings.from_runtime(rt, save, self.failures))

    def begin(self, start_iteration: int, save: SaveFn, writer=None, valid: bool = False, test: bool = False) -> None:
        """Before the loop, which resumes after ``start_iteration``: rank 0's job-end deadline (under Slurm), the
        --async-save saver, run control (its signal handlers from now on), the straggler detector (collective
        when enabled) and ``moved_evaluation`` (collective under Slurm with --save, when an evaluation is due at
        ``start_iteration``). ``writer``: this rank's scalar writers (TensorBoard, W&B), for the straggler series;
        ``valid``/``test``: the run has that split (its evaluations are budgeted with the steps)."""
        run, rt, ckpt = self.run, self.run.runtime, self.run.checkpoint
        self._save_fn, self._start_iteration = save, start_iteration
        settings = DeadlineSettings.from_run(run)
        self.evals = EvalPlan.from_run(run, valid, test)
        self._chained = bool(settings.job_id and ckpt.save) and not run.logging.skip_train
        self._job_id = settings.job_id
        self.deadline = start_deadline(settings, run, self.world_size, self.rank, self.evals)
        self.saver = AsyncSaver(run, self.ranks_per_node) if ckpt.save and ckpt.async_save else None
        self.control = RunControl(ckpt.save_interval, rt.exit_interval, rt.exit_duration_in_mins,
                                  rt.max_nonfinite_loss_iters, saving=bool(ckpt.save),
                                  kill_switch_file=rt.kill_switch_file, checks_files=self.rank == 0,
                                  saver=self.saver, deadline=self.deadline)
        if self.saver is not None:  # a background save's whole cost (copy, write and commit) is its measure
            self.saver.on_committed = self._saved
        self.stragglers = StragglerDetector(rt, self.rank, self.world_size, start_iteration + 1, writer,
                                            self.failures)
        self.moved_evaluation = self._agree_moved_evaluation(start_iteration)
        if self.deadline is not None:
            self.deadline.begin()  # the set-up above is no step

    # ------------------------------------------------------------------ every iteration
    def after_step(self, it: int, res: StepValues | float) -> None:
        """Collective, right after step ``it``: every rank's flags (signal, time, kill switch, job end, non-finite
        loss, the background save's state) in one MAX all-reduce whose read-back also brings ``res``'s loss and
        grad norm to the host (the iteration's one host sync); then the straggler report when one is due."""
        self._flags = self.control.exchange(res, it)
        PROGRESS.end_step()
        self.stragglers.after_iteration(it)

    def decide(self, it: int, consumed_samples: int) -> Decision:
        """Collective, after iteration ``it`` was logged and evaluated (a failing iteration is logged first): what
        every rank does, on the flags ``after_step`` agreed. Saves when due and says why it exits; raises
        TrainingError after --max-nonfinite-loss-iters non-finite iterations, or a background save's failure."""
        decision = self.control.decide(it, self._flags)
        if self._verdict != eval_budget.GO and not decision.exit and not self._flags.nonfinite:
            # the evaluation left no time to go on (rank 0 knows the numbers)
            decision = Decision(self.control.saving, True, self._stop_reason or "the Slurm job's end is near")
        moved, self._verdict = self._verdict == eval_budget.MOVE, eval_budget.GO
        self._decision = decision
        if decision.save:
            self._save(it, consumed_samples)
            if moved and self.rank == 0:
                write_moved_evaluation(self.run.checkpoint.save, it, self._job_id)
        if decision.exit:
            self._say(f"> exiting at iteration {it} after a checkpoint: {decision.reason}")
        return decision

    # ------------------------------------------------------------------ the end of training
    def end(self, it: int, consumed_samples: int) -> None:
        """Collective, after the loop stopped at ``it``: the signal handlers restored, the end of training saved
        (unless that iteration just was) and the save in flight committed."""
        ckpt, last = self.run.checkpoint, self._decision
        self.control.close()
        if ckpt.save and it > self._start_iteration and not (last and last.save):
            self._save(it, consumed_samples)  # the end of training is always kept
        if self.saver is not None:  # every end of a run (signal, --exit-*, kill switch, deadline, last iteration)
            self.saver.finish("before exiting")
        if last and last.exit and it >= self.run.training.train_iters and self.evals.at_end() and ckpt.save:
            self._say(f"> the end-of-training evaluation ({self.evals.end_splits()}) did not run (stopped: "
                      f"{last.reason}): the next job runs it; the run is marked finished after it")

    def finish(self, it: int, consumed_samples: int, evaluated: bool) -> None:
        """After the end-of-training evaluation (``evaluated``: it ran, or the run has none): on rank 0 the
        ``finished`` marker once the run reached its end and that evaluation ran (the batch scripts stop the job
        chain on it; a job that moved the evaluation leaves the run to the next)."""
        ckpt, last = self.run.checkpoint, self._decision
        reached_end = it >= self.run.training.train_iters or not (last and last.exit)  # an exit may be the last step
        evaluated = evaluated or not self.evals.at_end()
        if ckpt.save and self.rank == 0 and not self.run.logging.skip_train and reached_end and evaluated:
            write_finished(ckpt.save, it, consumed_samples)

    def on_error(self, error: BaseException) -> None:
        """This rank's set-up or training raised ``error`` (every rank that raises calls this): its failure record
        (out of memory, a device error), then the watchdog (out of memory: the others exit with its line; a failed
        collective: the hang verdict)."""
        self._failed = True
        host = PROGRESS.identity.host
        if self.failures is not None and isinstance(error, Exception) and is_out_of_memory(error):
            self.failures.write(self.rank, host, OUT_OF_MEMORY, describe_out_of_memory(error))  # run_cli says it too
        elif self.failures is not None and device_error(error):
            self.failures.write(self.rank, host, DEVICE_ERROR, str(error))
        if self.watchdog is not None and isinstance(error, Exception):
            self.watchdog.on_error(error)

    def stop(self) -> None:
        """Last, on every path out: the watchdog stops (after ``on_error``, this rank's silence is not clean)."""
        if self.watchdog is not None:
            self.watchdog.stop(clean=not self._failed)

    @property
    def named_stragglers(self) -> dict[int, int]:
        """Rank -> the iteration at which the straggler report named it (empty before ``begin``)."""
        return self.stragglers.named if self.stragglers is not None else {}

    # ------------------------------------------------------------------ evaluations against the job's end
    def evaluation_guard(self, kind: str, it: int) -> EvalGuard | None:
        """What the evaluation about to run asks after its first batches; None when evaluations cannot move (outside
        Slurm, without --save, under --skip-train: it runs whole, as upstream's). ``kind``: "periodic" (after step
        ``it``, the flags of which are agreed), "moved" (``moved_evaluation``, before this job's first step) or
        "end" (the end of training at ``it``)."""
        if not self._chained:
            return None
        return lambda elapsed, batch_secs, left: self._goes_on(kind, it, elapsed, batch_secs, left)

    def evaluated(self, secs: float, samples: int) -> None:
        """An evaluation of ``samples`` samples took ``secs`` (rank 0's deadline predicts the next ones from it)."""
        if self.deadline is not None:
            self.deadline.evaluated(secs, samples)

    def moved_evaluation_done(self) -> None:
        """``moved_evaluation`` ran: a later resume from the same checkpoint does not repeat it."""
        self.moved_evaluation = None
        if self.rank == 0 and self.run.checkpoint.load:
            clear_moved_evaluation(self.run.checkpoint.load)

    def stopped_before_training(self) -> Decision | None:
        """The job's moved evaluation left no time to train (or did not fit at all): the loop runs no step."""
        if self._verdict == eval_budget.GO:
            return None
        self._decision = Decision(False, True, self._stop_reason or "the Slurm job's end is near")
        self._verdict = eval_budget.GO
        return self._decision

    def _agree_moved_evaluation(self, start: int) -> int | None:
        if not self._chained or start <= 0 or not self.evals.periodic(start):
            return None
        mine = 0.0
        if self.rank == 0:  # the record sits beside the checkpoint this job resumed from
            got = read_moved_evaluation(self.run.checkpoint.load)
            if got is not None and got["iteration"] == start:
                mine = 1.0
                self._say(f"> the evaluation at iteration {start} was moved here from job {got.get('job') or '?'}: it "
                          "runs before the first step")
        return start if comm.reduce_host([mine], op=torch.distributed.ReduceOp.MAX)[0] else None

    def _goes_on(self, kind: str, it: int, elapsed: float, batch_secs: float, left_batches: int) -> bool:
        """Collective: rank 0 judges the rest of the evaluation against the job's end; every rank gets its verdict."""
        mine = eval_budget.GO
        if self.deadline is not None:
            name = (f"the end-of-training evaluation ({self.evals.end_splits()})" if kind == "end"
                    else f"the evaluation at iteration {it}")
            mine, self._stop_reason, line = self.deadline.judge_evaluation(
                kind, it, name, elapsed, batch_secs * left_batches, self.control.agreed_drain,
                did_steps=it > self._start_iteration)
            if line:
                self._say(line)
        self._verdict = int(comm.reduce_host([float(mine)], op=torch.distributed.ReduceOp.MAX)[0])
        return self._verdict != eval_budget.MOVE

    # ------------------------------------------------------------------ saves
    def _save(self, it: int, consumed_samples: int) -> None:
        began = time.monotonic()
        PROGRESS.enter("save")  # after ``began``: a fault a test injects here (a slow save) is part of the save
        self._save_fn(it, consumed_samples, self.saver)
        if self.saver is None:  # a background save is measured at its commit (``_saved``, from the saver)
            self._saved(time.monotonic() - began, it)

    def _saved(self, secs: float, iteration: int) -> None:
        """A save's measure, the one the next save is predicted from (this job, the next)."""
        if self.deadline is not None:
            self.deadline.saved(secs, iteration)

    def _say(self, msg: str) -> None:
        if self.rank == 0:
            print(msg, flush=True)
