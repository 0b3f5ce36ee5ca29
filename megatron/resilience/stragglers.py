"""Stragglers: a rank that is only slow (a throttling GCD, a bad link, a noisy neighbour) drags every step. Every N
iterations one small all-gather brings each rank's own work per iteration since the last report (data, forward,
backward, optimizer: megatron/progress.py's phase times, collective waits and logging excluded); rank 0 logs the
slowest ranks against the median (with host and GCD), writes a per-rank view to TensorBoard, and names a rank that
stays over FACTOR x the median for K reports in a row, once: ``> WARNING: straggler: rank N (host H, GCD G) ...``.

The times are host times. On CPU that is the compute; on a GPU the host only waits where it syncs, so a slow device
shows in its host's times only as far as the step syncs on it (unverified on GPUs).
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from megatron.config.runtime import RuntimeConfig
from megatron.core import comm
from megatron.progress import COMM, PROGRESS, WORK_PHASES, Identity, Progress
from megatron.resilience.failure_record import STRAGGLER, FailureLog

AUTO_INTERVAL = 100
COST_SHARE = 0.005
"""The automatic interval keeps the report's all-gather under this share of the steps' time."""
WARMUP = 2
"""Iterations left out of the first report (compile, allocator warm-up)."""
SHOWN = 3
TB_EVERY_RANK = 128
"""Up to this many ranks TensorBoard gets one series per rank; above, the slowest ranks' and a histogram."""
COLUMNS = (*WORK_PHASES, COMM, "iterations", "wall", "gather")


class StragglerDetector:
    def __init__(self, rt: RuntimeConfig, rank: int, world: int, first_iteration: int, writer=None,
                 failures: FailureLog | None = None, progress: Progress = PROGRESS, idents: list | None = None) -> None:
        """Collective when enabled: one all-gather of every rank's (rank, host, GCD), unless ``idents`` gives them."""
        self.auto = rt.straggler_interval is None
        self.interval = AUTO_INTERVAL if self.auto else rt.straggler_interval
        self.factor, self.needed = rt.straggler_factor, rt.straggler_reports
        self.rank, self.world = rank, world
        self.writer, self.failures, self.progress = writer, failures, progress
        self.enabled = self.interval > 0 and world > 1
        self.baseline_at = first_iteration + WARMUP - 1
        self.next_at = self.baseline_at + self.interval
        self.streak = np.zeros(world, dtype=np.int64)
        self.named: dict[int, int] = {}
        """rank -> the iteration at which it was named."""
        self._last: dict[str, float] = {}
        self._last_it = self.baseline_at
        self._last_wall = 0.0
        self._gather_s = 0.0
        if idents is None:
            idents = comm.all_gather_object(tuple(progress.identity)) if self.enabled else []
        self.idents = idents
        """Every rank's (rank, host, GCD)."""

    def _mark(self, it: int) -> None:
        self._last = dict(self.progress.times)
        self._last_it, self._last_wall = it, time.monotonic()

    def after_iteration(self, it: int) -> None:
        """Every rank, after each iteration (the same iterations everywhere: the report is a collective)."""
        if not self.enabled:
            return
        if it == self.baseline_at:
            self._mark(it)
        if it < self.next_at:
            return
        times = self.progress.times
        row = [times.get(k, 0.0) - self._last.get(k, 0.0) for k in (*WORK_PHASES, COMM)]
        row += [float(it - self._last_it), time.monotonic() - self._last_wall, self._gather_s]
        began = time.monotonic()
        local = torch.tensor(row, dtype=torch.float64).to(comm.collective_device())
        table = comm.all_gather(local).reshape(self.world, len(COLUMNS)).cpu().numpy()  # [world, columns]
        self._gather_s = time.monotonic() - began
        self._report(it, table)
        self._mark(it)

    def _report(self, it: int, table: np.ndarray) -> None:
        """The same arithmetic on every rank (the next interval must agree); only rank 0 speaks."""
        iters = np.maximum(table[:, COLUMNS.index("iterations")], 1.0)
        work = table[:, :len(WORK_PHASES)].sum(axis=1) / iters  # seconds per iteration, [world]
        median = float(np.median(work))
        ratio = work / median if median > 0 else np.ones_like(work)
        slow = ratio > self.factor
        self.streak = np.where(slow, self.streak + 1, 0)
        first = it - int(iters[0]) + 1
        if self.auto:  # the report's own cost (the slowest rank's last all-gather) under COST_SHARE of the steps
            step = float(np.median(table[:, COLUMNS.index("wall")] / iters))
            gather = float(table[:, COLUMNS.index("gather")].max())
            need = math.ceil(gather / (COST_SHARE * step)) if step > 0 else AUTO_INTERVAL
            self.interval = max(AUTO_INTERVAL, need)
        self.next_at = it + self.interval
        newly = [r for r in np.flatnonzero(self.streak >= self.needed) if int(r) not in self.named]
        for r in newly:
            self.named[int(r)] = it
        order = np.argsort(-ratio, kind="stable")[:SHOWN]
        self._tensorboard(it, ratio, median, order)  # the rank that owns a writer (TensorBoard: 0, W&B: the last)
        if self.rank != 0:
            return
        shown = ", ".join(f"{self._who(r)} {ratio[r]:.2f}x ({self._phases(table[r], iters[r])})" for r in order)
        print(f"> stragglers, iterations {first}-{it}: median own work {median * 1e3:.1f} ms per iteration; "
              f"slowest: {shown}", flush=True)
        for r in newly:
            line = (f"straggler: {self._who(r)}: its own work took {ratio[r]:.2f}x the median ({work[r] * 1e3:.1f} "
                    f"vs {median * 1e3:.1f} ms per iteration) in {self.needed} reports in a row, up to iteration "
                    f"{it} (--straggler-factor {self.factor:g}, --straggler-reports {self.needed})")
            print(f"> WARNING: {line}", flush=True)
            if self.failures is not None:
                self.failures.write(int(r), self.idents[r][1], STRAGGLER, line)

    def _who(self, r) -> str:
        return str(Identity(*self.idents[r]))

    @staticmethod
    def _phases(row: np.ndarray, iters: float) -> str:
        return ", ".join(f"{k} {row[i] / iters * 1e3:.1f}" for i, k in enumerate((*WORK_PHASES, "waits"))) + " ms"

    def _tensorboard(self, it: int, ratio: np.ndarray, median: float, order: np.ndarray) -> None:
        w = self.writer
        if w is None:
            return
        w.add_scalar("stragglers/median own work ms", median * 1e3, it)
        w.add_scalar("stragglers/slowest vs median", float(ratio.max()), it)
        w.add_histogram("stragglers/own work vs median", ratio, it)
        ranks = range(self.world) if self.world <= TB_EVERY_RANK else [int(r) for r in order]
        for r in ranks:
            w.add_scalar(f"stragglers/rank {r:05d} vs median", float(ratio[r]), it)
