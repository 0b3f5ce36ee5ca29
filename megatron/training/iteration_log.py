"""What the loop logs and keeps of each iteration: the log line, TensorBoard and W&B (their DP averages are
collectives, in the same order on every rank), the interval's loss sums, and the summary pretrain() returns."""

from __future__ import annotations

from megatron.config import RunConfig
from megatron.core.parallel_state import ParallelState
from megatron.training.evaluate import dp_mean
from megatron.training.log import TrainingLogger, print_rank0
from megatron.training.model_stats import optimizer_stats, params_norm
from megatron.training.peak import device_peak_tflops
from megatron.training.step import StepResult
from megatron.training.tensorboard import write_optimizer_stats
from megatron.training.timers import Timers
from megatron.training.writers import open_writers


class IterationLog:
    """The run's log line, scalar writers (TensorBoard, W&B) and timers, opened once, and the record of every
    iteration."""

    def __init__(self, run: RunConfig, pstate: ParallelState, engine, start_iteration: int) -> None:
        opts, rank = run.logging, pstate.global_rank
        self.run, self.pstate, self.engine, self.rank = run, pstate, engine, rank
        peak, peak_src = device_peak_tflops(run.precision.name, run.training.peak_tflops)
        print_rank0(f"> MFU peak: {peak:.3f} TFLOP/s per device ({peak_src})", rank)
        # Upstream writes nothing to TensorBoard or W&B under --skip-train (not even the flags).
        self.writer = open_writers(opts, rank, pstate.world_size, run.flags, start_iteration)
        self.logger = TrainingLogger(run, rank, run.model.padded_vocab_size(run.parallel.tp), peak, self.writer, opts)
        self.timers = Timers(opts.timing_level, opts.timing_option, opts.barrier_l1)
        self.first_loss: float | None = None
        self.last_loss: float | None = None
        self.losses: dict[int, float] = {}
        """Iteration -> the DP-mean lm loss over the log interval ending there (log steps only)."""
        self.moe_losses: dict[int, float] = {}
        self.lrs: dict[int, float] = {}
        """The lr each iteration's update used (tests compare resumed and straight runs)."""
        self.printed_lrs: dict[int, float | None] = {}
        """The lr the log prints (upstream's: the next update's)."""
        self.batch_sizes: dict[int, int] = {}
        self._sum, self._n, self._moe = 0.0, 0, 0.0

    def record(self, it: int, res: StepResult, consumed: int, batch_size: int) -> None:
        """After iteration ``it`` (``batch_size``: its global batch; ``consumed``: the samples after it). On every
        rank: the reductions here are collectives."""
        opts, t, pstate, logger = self.run.logging, self.run.training, self.pstate, self.logger
        dp = pstate.dp
        self._sum, self._n = self._sum + res.loss, self._n + 1
        self._moe += res.moe_loss or 0.0  # MoE layers: their loss, logged beside the lm loss
        log_now = it % t.log_interval == 0 or it == t.train_iters
        tb_now = opts.tb_step(it)  # the same on every rank: the reductions below are collectives
        wandb_now = log_now and opts.wandb  # upstream's W&B-only loss/<key> series, at --log-interval
        if self.writer is not None:
            self.writer.set_iteration(it)
        if opts.params_norm and (log_now or tb_now):
            logger.params_norm = params_norm(self.engine.module, pstate)
        own = None
        if tb_now or wandb_now:  # upstream writes each iteration's own loss (DP mean), not the interval's
            own = (res.loss if dp.size == 1 else dp_mean(res.loss, pstate),
                   None if res.moe_loss is None else res.moe_loss if dp.size == 1 else dp_mean(res.moe_loss, pstate))
        logger.own_losses = own if wandb_now else None
        if tb_now:
            logger.tensorboard(it, own[0], res, consumed, batch_size, moe_loss=own[1])
            if opts.optimizer_states_to_tb:
                stats = optimizer_stats(self.engine.optimizer, pstate, self.engine.zero_optimization_stage())
                if self.writer is not None:
                    write_optimizer_stats(self.writer, stats, it, consumed * self.run.model.seq_length)
            self.timers.write(self.writer, it, normalizer=max(1, self._n))
        loss = None
        if log_now:  # Megatron's log: the mean over the interval, averaged over DP (one all-reduce)
            loss = dp_mean(self._sum / self._n, pstate)
            logger.moe_loss = None if res.moe_loss is None else dp_mean(self._moe / self._n, pstate)
            if logger.moe_loss is not None:
                self.moe_losses[it] = logger.moe_loss
            self._sum, self._n, self._moe = 0.0, 0, 0.0
            self.losses[it] = loss
            self.first_loss = loss if self.first_loss is None else self.first_loss
            self.last_loss = loss
        logger.iteration(it, loss, res, consumed, batch_size)
        if log_now:
            report = self.timers.report(normalizer=t.log_interval)
            if report:
                print_rank0(report, self.rank)
        self.lrs[it], self.printed_lrs[it], self.batch_sizes[it] = res.lr, res.next_lr, batch_size

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            if self.writer.tensorboard is not None:
                print(f"> TensorBoard event files in {self.run.logging.tensorboard_dir}", flush=True)

    def summary(self, it: int, consumed: int, exit_reason: str | None, final_eval: dict[str, float],
                valid_losses: dict[int, float], stragglers: dict[int, int]) -> dict:
        """What pretrain() returns (scripts and tests read it)."""
        return {"first_loss": self.first_loss, "last_loss": self.last_loss, "iterations": it, "losses": self.losses,
                "moe_losses": self.moe_losses, "lrs": self.lrs, "printed_lrs": self.printed_lrs,
                "batch_sizes": self.batch_sizes, "consumed_samples": consumed, "exit_reason": exit_reason,
                "final_eval": final_eval, "valid_losses": valid_losses, "stragglers": stragglers}
