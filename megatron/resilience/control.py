"""When to save and when to stop: --save-interval, --exit-interval, --exit-duration-in-mins, --kill-switch-file,
SIGTERM/SIGUSR1 from Slurm (``#SBATCH --signal=USR1@120``), the Slurm job's end (megatron/resilience/deadline.py)
and persistent non-finite losses. megatron/resilience/supervisor.py wires it for the loop.

A signal handler only sets a flag. At each iteration boundary every rank contributes its flags to one
small MAX all-reduce, so all ranks take the same decision at the same iteration (a rank that saves
alone would hang in DeepSpeed's collectives). Under --async-save the background save's state (still writing, a
failed write's errno) travels in the same all-reduce: no collective of its own in the step.
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from megatron.checkpointing.live.async_save import AsyncSaver
from megatron.core import comm
from megatron.errors import TrainingError
from megatron.resilience.deadline import Deadline

EXIT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
UNKNOWN_DRAIN = 1e9
"""A rank's drain estimate before its first file is written (MAX over ranks: unknown wins)."""


@dataclass
class Decision:
    save: bool = False
    exit: bool = False
    reason: str = ""


class StepValues(Protocol):
    """A step's outcome whose values may still be on the device (megatron/training/step.py's StepResult)."""

    loss_value: torch.Tensor | float

    def pending(self) -> list[torch.Tensor]: ...

    def resolve(self, read: Sequence[float]) -> None: ...


class Flags(NamedTuple):
    """What every rank agreed on after an iteration (MAX over ranks)."""
    signal: bool
    timed_out: bool
    nonfinite: bool
    killed: bool
    ending: bool = False
    """Rank 0's deadline: the next step, a save and the margin no longer fit before the Slurm job's end."""
    save_state: tuple[float, ...] = ()
    """The background save's agreed state (AsyncSaver.status, MAX over ranks); empty without --async-save."""


class RunControl:
    def __init__(self, save_interval: int | None, exit_interval: int | None, exit_duration_mins: float | None,
                 max_nonfinite: int, saving: bool, kill_switch_file: str | None = None,
                 checks_files: bool = True, saver: AsyncSaver | None = None,
                 deadline: Deadline | None = None) -> None:
        """``checks_files``: this rank looks for ``kill_switch_file`` (rank 0 only: the MAX all-reduce tells the
        others, where upstream has every rank stat the file each iteration, a metadata storm on Lustre).
        ``saver``: --async-save's background saver, whose state joins the flags all-reduce.
        ``deadline``: rank 0's judge of the job's end (None elsewhere); its verdict rides the same all-reduce."""
        self.saver, self.deadline = saver, deadline
        self._agreed_drain: float | None = 0.0
        """The slowest rank's remaining background write (s) as last agreed; None: unknown (a whole save)."""
        self.save_interval, self.exit_interval = save_interval, exit_interval
        self.kill_switch_file = kill_switch_file if checks_files else None
        self._kill_switch_name = kill_switch_file
        self.exit_duration_s = None if exit_duration_mins is None else 60.0 * exit_duration_mins
        self.max_nonfinite, self.saving = max_nonfinite, saving
        self.start = time.monotonic()
        self.signal_received: int | None = None
        self.nonfinite_run = 0
        self._previous = {}
        for sig in EXIT_SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread (e.g. some test harnesses): signals stay default
                pass

    def _on_signal(self, signum, frame) -> None:
        self.signal_received = signum

    def close(self) -> None:
        if self.deadline is not None:
            self.deadline.close()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def after_iteration(self, it: int, loss: float | torch.Tensor | StepValues) -> Decision:
        """Collective over all ranks: ``decide(it, exchange(loss, it))``."""
        return self.decide(it, self.exchange(loss, it))

    def exchange(self, loss: float | torch.Tensor | StepValues, it: int | None = None) -> Flags:
        """Collective: (signal, timed out, non-finite loss, kill switch, job end near, the background save's state) on
        any rank, one small MAX all-reduce. ``it``: the iteration just done (the deadline budgets the evaluations and
        interval saves due around it; None: none).

        ``loss`` may be a step's outcome whose values are still on the device: its finiteness is tested there and
        its loss and grad norm come back in the same read-back as the flags, the iteration's one host sync."""
        timed_out = self.exit_duration_s is not None and time.monotonic() - self.start > self.exit_duration_s
        res = None if isinstance(loss, (int, float, torch.Tensor)) else loss
        value = res.loss_value if res is not None else loss
        if isinstance(value, torch.Tensor):
            bad = (~torch.isfinite(value)).reshape(1)  # tested where the loss is: no sync
        else:
            bad = float(not math.isfinite(value))
        killed = float(self.kill_switch_file is not None and os.path.exists(self.kill_switch_file))
        # A stop first finishes the save in flight (AsyncSaver.finish): the deadline adds the slowest rank's drain, as
        # agreed in the previous exchange (this one's values ride in the same all-reduce).
        ending = float(self.deadline is not None and self.deadline.should_stop(self._agreed_drain, it))
        saving = self.saver.status() if self.saver is not None else []
        drain = [self._drain()] if self.saver is not None else []
        n = 5 + len(saving)
        got = comm.reduce_host([float(self.signal_received is not None), float(timed_out), bad, killed, ending,
                                *saving, *drain], op=torch.distributed.ReduceOp.MAX,
                               also=res.pending() if res is not None else ())
        if drain:
            self._agreed_drain = None if got[n] >= UNKNOWN_DRAIN else float(got[n])
        if res is not None:
            res.resolve(got[n + len(drain):])
        return Flags(bool(got[0]), bool(got[1]), bool(got[2]), bool(got[3]), bool(got[4]), tuple(got[5:n]))

    @property
    def agreed_drain(self) -> float | None:
        """The slowest rank's remaining background write as last agreed (s; None: unknown)."""
        return self._agreed_drain

    def _drain(self) -> float:
        """This rank's in-flight save's remaining write time; UNKNOWN_DRAIN before its first file (the rate is not
        known yet: the deadline then counts a whole save)."""
        left = self.saver.drain_estimate_s()
        return UNKNOWN_DRAIN if left is None else left

    def decide(self, it: int, flags: tuple[bool, ...]) -> Decision:
        """What every rank does after iteration ``it``, given ``exchange``'s agreed flags. Raises TrainingError
        after ``max_nonfinite`` consecutive iterations whose loss is NaN/Inf on any rank; never asks to save
        while the latest loss is non-finite."""
        got_signal, timed_out, nonfinite, *rest = flags
        killed = bool(rest and rest[0])
        ending = len(rest) > 1 and bool(rest[1])
        if self.saver is not None and isinstance(flags, Flags):
            self.saver.on_agreed(flags.save_state)  # commit a save every rank has on disk, or raise its failure
        if nonfinite:
            self.nonfinite_run += 1
            if self.nonfinite_run >= self.max_nonfinite:
                if self.saver is not None:  # the save in flight holds a finite state: keep it
                    self.saver.finish("before stopping on non-finite losses")
                raise TrainingError(
                    f"lm loss is NaN/Inf at iteration {it} ({self.nonfinite_run} consecutive non-finite iterations, "
                    f"--max-nonfinite-loss-iters {self.max_nonfinite}); stopped without saving a checkpoint: "
                    "resume from the last one with a lower --lr or more warmup")
            return Decision()  # a poisoned state is never saved, and one bad step alone does not stop the run
        self.nonfinite_run = 0
        if got_signal:
            return Decision(self.saving, True, "signal (SIGTERM/SIGUSR1)")
        if ending:  # rank 0 knows the numbers; the others only that the job's end is near
            why = self.deadline.reason if self.deadline is not None else "the Slurm job's end is near"
            return Decision(self.saving, True, why)
        if timed_out:
            return Decision(self.saving, True, f"--exit-duration-in-mins {self.exit_duration_s / 60:g}")
        if killed:
            return Decision(self.saving, True, f"kill switch {self._kill_switch_name}")
        if self.exit_interval and it % self.exit_interval == 0:
            return Decision(self.saving, True, f"--exit-interval {self.exit_interval}")
        return Decision(self.saving and bool(self.save_interval) and it % self.save_interval == 0)
