"""Validation during training and the evaluation at its end on the valid and test splits, as upstream
Megatron-DeepSpeed's ``evaluate_and_print_results``.

The validation split is read by one iterator for the whole run, as upstream's: every evaluation (each
--eval-interval, then the one at the end) takes the next --eval-iters global batches. A resumed run starts it
where the straight run would be: ``(iteration // eval_interval) * eval_iters * global_batch_size`` samples in,
or under --rampup-batch-size the sum of each evaluation's draw at its step's batch (upstream restores the same
count, consumed_valid_samples, from its checkpoint). The test split is read from its start, once.
"""

from __future__ import annotations

import torch

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


def evaluate(engine, data, run: RunConfig, pstate: ParallelState, forward_step, iters: int,
             pipelined: bool = False, verbose: bool = False, num_microbatches: int | None = None) -> float:
    """Mean lm loss over ``iters`` global batches, averaged over DP. ``data``: micro-batches of this DP rank (the
    pipeline engine's tuples when ``pipelined``; DeepSpeed's eval_batch averages over DP itself).
    ``num_microbatches``: the current step's count under --rampup-batch-size (upstream evaluates with it)."""
    rank, log_interval = pstate.global_rank, run.training.log_interval
    if pipelined:
        total = 0.0
        for i in range(1, iters + 1):
            if verbose and i % log_interval == 0:
                print_rank0(f"Evaluating iter {i}/{iters}", rank)
            total += pipe_evaluate_batch(engine, data)
        return total / max(1, iters)
    engine.eval()
    gas = num_microbatches or run.training.grad_accumulation_steps(pstate.dp.size)
    total, n = 0.0, 0
    with torch.no_grad():
        for i in range(1, iters + 1):
            if verbose and i % log_interval == 0:
                print_rank0(f"Evaluating iter {i}/{iters}", rank)
            for _ in range(gas):
                PROGRESS.enter("eval")  # a move per batch: a long evaluation is no hang
                total = total + forward_step(engine, next(data)).float()  # summed on the device: no sync per batch
                n += 1
    engine.train()
    return dp_mean(total / max(1, n), pstate)


class Evaluation:
    """The run's validation iterator and its test split; ``periodic`` / ``at_end`` print and log as upstream."""

    def __init__(self, engine, run: RunConfig, pstate: ParallelState, forward_step, pipelined: bool, valid_ds,
                 test_ds, start_iteration: int, logger, batches, plan) -> None:
        """``batches(dataset, start)``: this DP rank's micro-batches of ``dataset`` from sample ``start`` on;
        ``plan``: the run's MicroBatchPlan (the global batch of each step)."""
        self.engine, self.run, self.pstate, self.forward_step = engine, run, pstate, forward_step
        self.pipelined, self.valid_ds, self.test_ds, self.logger = pipelined, valid_ds, test_ds, logger
        self.batches = batches
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

    def _loss(self, data, verbose: bool, num_microbatches: int | None) -> float:
        if self.pipelined and num_microbatches:  # the pipeline engine's eval_batch runs its accumulation steps
            set_num_microbatches(self.engine, num_microbatches)
        return evaluate(self.engine, data, self.run, self.pstate, self.forward_step, self.run.training.eval_iters,
                        self.pipelined, verbose, num_microbatches)

    def _valid_data(self):
        if self._valid is None:
            self._valid = self._data(self.valid_ds, self.valid_start)
        return self._valid

    def periodic(self, it: int, consumed: int, num_microbatches: int | None = None) -> None:
        """At every --eval-interval during training."""
        if self.on and self.valid_ds is not None and it % self.run.training.eval_interval == 0:
            self.losses[it] = loss = self._loss(self._valid_data(), False, num_microbatches)
            self.logger.validation(f"iteration {it}", loss, it, consumed)

    def at_end(self, it: int, consumed: int, write_tensorboard: bool,
               num_microbatches: int | None = None) -> dict[str, float]:
        """Valid then test, each on eval_iters global batches; returns {'valid': loss, 'test': loss} for those run."""
        out = {}
        draw = self.run.training.eval_iters * self.run.training.global_batch_size
        for name, dataset, label in (("valid", self.valid_ds, "validation"), ("test", self.test_ds, "test")):
            if not self.on or dataset is None:
                continue
            data = self._valid_data() if name == "valid" else self._data(dataset, 0)
            out[name] = loss = self._loss(data, True, num_microbatches)
            self.logger.validation(f"iteration {it} on {draw}-sample draw from {label} set", loss, it, consumed,
                                   test=name == "test", write=write_tensorboard)
        return out
