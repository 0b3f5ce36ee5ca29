"""Training log in Megatron-DeepSpeed's line format (users' tools parse it), plus MFU, memory and ETA,
and the TensorBoard / W&B scalars. Only rank 0 prints; each writer is on the rank that owns it."""

from __future__ import annotations

import datetime
import resource
import sys
import time

from deepspeed.accelerator import get_accelerator

from megatron.config import RunConfig
from megatron.config.log import LogOptions
from megatron.perf.flops import iteration_flops
from megatron.training import tensorboard as tb
from megatron.training.wandb_writer import write_throughput
from megatron.training.writers import ScalarWriters


def print_rank0(msg: str, rank: int) -> None:
    if rank == 0:
        print(msg, flush=True)


def memory_gb() -> float:
    """Peak device memory (GPU) or peak resident set size of this process (CPU), in GB."""
    acc = get_accelerator()
    if acc.device_name() != "cpu":
        return acc.max_memory_allocated() / 1e9
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb * 1024 / 1e9 if sys.platform != "darwin" else kb / 1e9


class TrainingLogger:
    def __init__(self, run: RunConfig, rank: int, padded_vocab: int, peak_tflops: float,
                 writer: ScalarWriters | None = None, opts: LogOptions | None = None) -> None:
        self.run, self.rank, self.writer = run, rank, writer
        self.opts = opts or run.logging
        self.params_norm: float | None = None
        """--log-params-norm: the latest value (set by the loop on log steps), printed in the log line."""
        self.moe_loss: float | None = None
        """A model with MoE layers: the interval's MoE loss, DP-averaged (set by the loop on log steps), printed after
        the lm loss as upstream's "moe loss"."""
        self.own_losses: tuple[float, float | None] | None = None
        """This iteration's own DP-mean (lm, MoE) losses on log steps with W&B (set by the loop): upstream's W&B-only
        loss/<key> series."""
        t, m = run.training, run.model
        flops = iteration_flops(m, t.global_batch_size, padded_vocab, m.recompute_granularity, m.recompute_num_layers)
        self.flops = flops
        self.parameters = m.num_parameters(run.parallel.tp)
        self.peak = peak_tflops
        self.world = run.parallel.world_size
        self.recompute = m.recompute_granularity or "none"
        self._reset()
        self.start = time.perf_counter()
        self.iters_done = 0

    def _reset(self) -> None:
        self.loss_sum, self.n, self.time_sum, self.skipped = 0.0, 0, 0.0, 0
        self.last = time.perf_counter()

    def iteration(self, it: int, dp_mean_loss: float | None, res, consumed: int,
                  global_batch: int | None = None) -> None:
        """Record one iteration; print at --log-interval. ``dp_mean_loss`` is only needed on log steps.
        ``global_batch``: this iteration's (it changes under --rampup-batch-size); default --global-batch-size."""
        self.global_batch = global_batch or self.run.training.global_batch_size
        now = time.perf_counter()
        self.time_sum += now - self.last
        self.last = now
        self.n += 1
        self.iters_done += 1
        self.skipped += int(res.skipped)
        if dp_mean_loss is None:
            return
        self.loss_sum = dp_mean_loss
        self._emit(it, res, consumed)
        self._reset()

    def tensorboard(self, it: int, loss: float, res, consumed: int, batch_size: int,
                    moe_loss: float | None = None) -> None:
        """This iteration's scalars under upstream's tags (the loop calls it at --tensorboard-log-interval with the
        iteration's own DP-mean loss, and MoE loss for a model with experts, as upstream's)."""
        if self.writer is None:
            return
        seq = self.run.model.seq_length
        tb.write_training(self.writer, self.opts, it, consumed, consumed * seq, loss=loss, lr=res.lr,
                          batch_size=batch_size, loss_scale=res.loss_scale, world_size=self.world,
                          grad_norm=res.grad_norm, params_norm=self.params_norm, seq_length=seq, moe_loss=moe_loss)

    def _emit(self, it: int, res, consumed: int) -> None:
        t = self.run.training
        dt = self.time_sum / self.n
        seq = self.run.model.seq_length
        gbs = self.global_batch
        tokens_per_s = gbs * seq / dt
        scale_flops = gbs / t.global_batch_size  # the FLOPs were counted for --global-batch-size
        tflops = self.flops.total * scale_flops / dt / self.world / 1e12
        # Megatron prints %.2f; tiny CPU runs need more digits for the tuner to rank them.
        tflops_str = f"{tflops:.2f}" if tflops >= 1 else f"{tflops:.4f}"
        mfu = 100.0 * self.flops.model * scale_flops / dt / self.world / 1e12 / self.peak
        eta = (time.perf_counter() - self.start) / self.iters_done * (t.train_iters - it)
        mem = memory_gb()
        norm = "n/a" if res.grad_norm is None else f"{res.grad_norm:.3f}"
        if self.opts.params_norm and self.params_norm is not None:
            norm += f" | params norm: {self.params_norm:.3f}"  # upstream's place for it: after the grad norm
        scale = "1.0" if res.loss_scale is None else f"{res.loss_scale:.1f}"
        lr = res.lr if getattr(res, "next_lr", None) is None else res.next_lr  # upstream prints the next update's
        moe = "" if self.moe_loss is None else f"moe loss: {self.moe_loss:.6E} | "
        line = (
            f" iteration {it:8d}/{t.train_iters:8d} | consumed samples: {consumed:12d} | "
            f"consumed tokens: {consumed * seq:14d} | elapsed time per iteration (ms): {dt * 1000:.1f} | "
            f"learning rate: {lr:.3E} | global batch size: {gbs:5d} | "
            f"lm loss: {self.loss_sum:.6E} | {moe}loss scale: {scale} | grad norm: {norm} | "
            f"number of skipped iterations: {self.skipped:3d} | number of nan iterations: 0 | "
            f"samples per second: {gbs / dt:.3f} | tokens per second: {tokens_per_s:.1f} | "
            f"tokens per gpu per second (tgs): {tokens_per_s / self.world:.1f} | TFLOPs: {tflops_str} | "
            f"MFU: {mfu:.2f}% | recompute: {self.recompute} | mem (GB): {mem:.2f} | "
            f"ETA: {datetime.timedelta(seconds=int(eta))} |"
        )
        print_rank0(line, self.rank)
        if self.writer is not None:
            # Our own throughput series (upstream has no TensorBoard tags for these); the rest: tensorboard.py.
            for name, val in (("tokens-per-sec", tokens_per_s), ("TFLOPs", tflops), ("MFU", mfu), ("mem-GB", mem)):
                self.writer.add_scalar(name, val, it)
            if self.opts.timers_to_tb:
                tb.write_iteration_time(self.writer, dt, it, consumed, consumed * seq)
            if self.writer.wandb is not None and self.own_losses is not None:
                write_throughput(self.writer.wandb, it, seconds=dt, samples_per_sec=gbs / dt, seq_length=seq,
                                 dp=self.run.parallel.dp,
                                 world=self.world, tflops=tflops, parameters=self.parameters,
                                 losses=self.own_losses)

    def validation(self, prefix: str, loss: float, it: int, consumed: int, test: bool = False,
                   write: bool = True) -> None:
        """Upstream's block: ' validation loss at <prefix> | lm loss value: ... | lm loss PPL: ... | ' between two
        dashed lines as long as it, and the 'lm-loss-validation/...' scalars (not under --skip-train, as upstream)."""
        import math

        ppl = math.exp(min(20.0, loss))
        line = f" validation loss at {prefix} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} | "
        bar = "-" * (len(line) + 1)
        print_rank0(f"{bar}\n{line}\n{bar}", self.rank)
        if write and self.writer is not None:
            tb.write_evaluation(self.writer, self.opts, loss, it, consumed, consumed * self.run.model.seq_length, test)
