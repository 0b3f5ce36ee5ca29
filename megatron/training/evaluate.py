"""Validation during training and the evaluation at its end on the valid and test splits, as upstream
Megatron-DeepSpeed's ``evaluate_and_print_results``.

The validation split is read by one iterator for the whole run, as upstream's: every evaluation (each
--eval-interval, then the one at the end) takes the next --eval-iters global batches. A resumed run starts it
where the straight run would be: ``(iteration // eval_interval) * eval_iters * global_batch_size`` samples in,
or under --rampup-batch-size the sum of each evaluation's draw at its step's batch (upstream restores the same
count, consumed_valid_samples, from its checkpoint). The test split is read from its start, once.

Under Slurm with --save, an evaluation asks the supervisor after its first batches whether the rest fits before the
job's end (``goes_on``); if not, it stops unlogged and the next job, resumed from this iteration's checkpoint, runs
it whole from the same position: the same batches, the same number. Each evaluation's time is measured for the
job-end deadline's predictions.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from deepspeed.accelerator import get_accelerator

from megatron.config import RunConfig
from megatron.core import comm
from megatron.core.parallel_state import ParallelState
from megatron.errors import DataError
from megatron.progress import PROGRESS
from megatron.training.log import print_rank0
from megatron.training.pipe_step import pipe_evaluate_batch, pipe_microbatches
from megatron.training.step import set_num_microbatches


def dp_mean(value: float | torch.Tensor, pstate: ParallelState) -> float:
    if pstate.dp.size == 1:
        return comm.to_host(value)[0]
    return comm.reduce_host([value], pstate.dp.group)[0] / pstate.dp.size


GoesOn = Callable[[float, float, int], bool]
"""``goes_on(elapsed, batch_secs, batches_left)`` (collective; the supervisor's evaluation_guard): False stops the
evaluation."""
PROBE_BATCHES = 2
"""An evaluation asks ``goes_on`` after this many global batches (the second is timed alone: the first carries the
iterator's start), or after its first when it has two."""


class Probe:
    """Times an evaluation and asks ``goes_on`` once, after its probe batch (none when ``goes_on`` is None)."""

    def __init__(self, iters: int, goes_on: GoesOn | None, later_batches: int = 0) -> None:
        """``later_batches``: batches of a later split the same question covers (the test split after validation)."""
        self.iters, self.goes_on, self.later = iters, goes_on, later_batches
        self.at = min(PROBE_BATCHES, iters - 1) if goes_on is not None else 0
        self.began = self.batch_began = time.monotonic()

    def before(self, i: int) -> None:
        if i == self.at and i > 1:
            get_accelerator().synchronize()  # the batches before it are done: time this one alone
            self.batch_began = time.monotonic()

    def after(self, i: int) -> bool:
        """False: stop (the rest does not fit before the job's end)."""
        if i != self.at:
            return True
        get_accelerator().synchronize()
        now = time.monotonic()
        return self.goes_on(now - self.began, now - self.batch_began, self.iters - i + self.later)


def evaluate(engine, data, run: RunConfig, pstate: ParallelState, forward_step, iters: int,
             pipelined: bool = False, verbose: bool = False, num_microbatches: int | None = None,
             probe: Probe | None = None) -> float | None:
    """Mean lm loss over ``iters`` global batches, averaged over DP; None when ``probe`` stopped it. ``data``:
    micro-batches of this DP rank (the pipeline engine's tuples when ``pipelined``; DeepSpeed's eval_batch averages
    over DP itself). ``num_microbatches``: the current step's count under --rampup-batch-size (upstream evaluates
    with it)."""
    rank, log_interval = pstate.global_rank, run.training.log_interval
    probe = probe or Probe(iters, None)
    if pipelined:
        total = 0.0
        for i in range(1, iters + 1):
            if verbose and i % log_interval == 0:
                print_rank0(f"Evaluating iter {i}/{iters}", rank)
            probe.before(i)
            total += pipe_evaluate_batch(engine, data)
            if not probe.after(i):
                return None
        return total / max(1, iters)
    engine.eval()
    gas = num_microbatches or run.training.grad_accumulation_steps(pstate.dp.size)
    total, n = 0.0, 0
    with torch.no_grad():
        for i in range(1, iters + 1):
            if verbose and i % log_interval == 0:
                print_rank0(f"Evaluating iter {i}/{iters}", rank)
            probe.before(i)
            for _ in range(gas):
                PROGRESS.enter("eval")  # a move per batch: a long evaluation is no hang
                total = total + forward_step(engine, next(data)).float()  # summed on the device: no sync per batch
                n += 1
            if not probe.after(i):
                engine.train()
                return None
    engine.train()
    return dp_mean(total / max(1, n), pstate)


class Evaluation:
    """The run's validation iterator and its test split; ``periodic`` / ``at_end`` print and log as upstream."""

    def __init__(self, engine, run: RunConfig, pstate: ParallelState, forward_step, pipelined: bool, valid_ds,
                 test_ds, start_iteration: int, logger, batches, plan,
                 measured: Callable[[float, int], None] | None = None) -> None:
        """``batches(dataset, start)``: this DP rank's micro-batches of ``dataset`` from sample ``start`` on;
        ``plan``: the run's MicroBatchPlan (the global batch of each step); ``measured(secs, samples)``: told each
        evaluation's time (the supervisor's, for the job-end deadline)."""
        self.engine, self.run, self.pstate, self.forward_step = engine, run, pstate, forward_step
        self.pipelined, self.valid_ds, self.test_ds, self.logger = pipelined, valid_ds, test_ds, logger
        self.batches, self.plan = batches, plan
        self.measured = measured or (lambda secs, samples: None)
        t = run.training
        self.on = t.eval_iters > 0
        self.valid_start = plan.valid_samples_before(start_iteration, t.eval_interval, t.eval_iters)
        self._valid = None
        self.losses: dict[int, float] = {}  # iteration -> validation loss of the periodic evaluations

    def _data(self, dataset, start: int):
        def endless():  # a split smaller than the draws asked of it (the demo corpus's) starts over, never stops
            nonlocal start
            while True:
                got = False
                for batch in self.batches(dataset, start % len(dataset)):
                    got = True
                    yield batch
                if not got and start == 0:
                    raise DataError(f"an evaluation split has {len(dataset)} samples, fewer than one step of "
                                    "--micro-batch-size x data-parallel size: give it more (--split)")
                start = 0

        return pipe_microbatches(endless(), self.run.model.moe.enabled) if self.pipelined else endless()

    def _loss(self, data, verbose: bool, num_microbatches: int | None, goes_on: GoesOn | None = None,
              later_batches: int = 0) -> float | None:
        """The mean loss (None: ``goes_on`` stopped it), its time told to ``measured``."""
        if self.pipelined and num_microbatches:  # the pipeline engine's eval_batch runs its accumulation steps
            set_num_microbatches(self.engine, num_microbatches)
        t, dp = self.run.training, self.pstate.dp.size
        probe = Probe(t.eval_iters, goes_on, later_batches)
        loss = evaluate(self.engine, data, self.run, self.pstate, self.forward_step, t.eval_iters, self.pipelined,
                        verbose, num_microbatches, probe)
        batch = (num_microbatches or t.grad_accumulation_steps(dp)) * t.micro_batch_size * dp
        self.measured(time.monotonic() - probe.began, (t.eval_iters if loss is not None else probe.at) * batch)
        return loss

    def _valid_data(self):
        if self._valid is None:
            self._valid = self._data(self.valid_ds, self.valid_start)
        return self._valid

    def _restart_valid(self, after_iteration: int) -> None:
        """The validation iterator where the straight run's is after the evaluations up to ``after_iteration``."""
        t = self.run.training
        self.valid_start = self.plan.valid_samples_before(after_iteration, t.eval_interval, t.eval_iters)
        self._valid = None

    def periodic(self, it: int, consumed: int, num_microbatches: int | None = None,
                 goes_on: GoesOn | None = None) -> bool:
        """At every --eval-interval during training; True when one ran whole (False: none was due, or ``goes_on``
        stopped it: it moves to the next job)."""
        if not (self.on and self.valid_ds is not None and it % self.run.training.eval_interval == 0):
            return False
        PROGRESS.enter("eval")
        loss = self._loss(self._valid_data(), False, num_microbatches, goes_on)
        if loss is None:
            self._restart_valid(it)  # a later evaluation draws where the straight run's does
            return False
        self.losses[it] = loss
        self.logger.validation(f"iteration {it}", loss, it, consumed)
        return True

    def moved(self, it: int, consumed: int, goes_on: GoesOn | None = None) -> bool:
        """The periodic evaluation of iteration ``it`` that the job before this one moved here (this job resumed
        from that iteration): from the validation position before it, with that step's micro-batch count."""
        self._restart_valid(it - 1)
        return self.periodic(it, consumed, self.plan.num_microbatches(self.plan.samples_after(it - 1)), goes_on)

    def at_end(self, it: int, consumed: int, write_tensorboard: bool, num_microbatches: int | None = None,
               goes_on: GoesOn | None = None) -> dict[str, float] | None:
        """Valid then test, each on eval_iters global batches; returns {'valid': loss, 'test': loss} for those run,
        None when ``goes_on`` stopped it (it moves to the next job)."""
        out = {}
        t = self.run.training
        draw = t.eval_iters * t.global_batch_size
        splits = [(name, ds, label) for name, ds, label in (("valid", self.valid_ds, "validation"),
                                                              ("test", self.test_ds, "test")) if ds is not None]
        if not self.on or not splits:
            return out
        PROGRESS.enter("eval")
        for k, (name, dataset, label) in enumerate(splits):
            data = self._valid_data() if name == "valid" else self._data(dataset, 0)
            # the first split's question covers the splits after it
            ask, later = (goes_on, t.eval_iters * (len(splits) - 1)) if k == 0 else (None, 0)
            loss = self._loss(data, True, num_microbatches, ask, later)
            if loss is None:
                return None
            out[name] = loss
            self.logger.validation(f"iteration {it} on {draw}-sample draw from {label} set", loss, it, consumed,
                                   test=name == "test", write=write_tensorboard)
        return out
