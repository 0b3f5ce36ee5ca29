"""Where this rank's main thread is: iteration, phase, the collective it waits in (with its sequence number in that
group) and since when. The loop and the collective layer write it, the watchdog thread reads it (megatron/training/
watchdog.py); a move costs one clock read and one tuple assignment: no collective, no host-device sync. Each move is
also where a test's injected fault fires (``faults``: megatron/faults.py, armed from MEGATRON_FAULT).

A leaf module (stdlib only, the bottom layer): errors.run_cli reads it to name the phase an out-of-memory error hit.
"""

from __future__ import annotations

import os
import socket
import time
from collections import deque
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from megatron.faults import Faults

COMM = "comm"
"""The ``times`` key of the time spent inside collectives (waiting for peers included)."""
LONG_PHASES = ("save",)
"""Phases that get the save allowance (--hang-timeout-save)."""
STARTUP_PHASES = ("setup", "load")
"""Phases before the first iteration: they get the start-up allowance (--hang-timeout-startup)."""
WORK_PHASES = ("data", "forward", "backward", "optimizer")
"""What a rank computes itself in a step (collective waits and logging excluded): the straggler measure."""


class Position(NamedTuple):
    """One immutable snapshot: the watchdog reads it without a lock (a tuple assignment is atomic under the GIL)."""

    iteration: int
    phase: str
    since: float
    """time.monotonic() of the last move: entering a phase, a collective, or leaving a collective."""
    collective: tuple[str, str, int] | None = None
    """(op, group id, sequence number of this collective in that group) while inside one."""
    failed: str | None = None
    """The first line of the error the collective raised (a timeout, a lost peer); the position stays there."""


class Identity(NamedTuple):
    rank: int
    host: str
    gcd: str
    """The device this rank drives ("-" on CPU)."""

    def __str__(self) -> str:
        return f"rank {self.rank} (host {self.host}, GCD {self.gcd})"


def this_host(environ=os.environ) -> str:
    """The node as Slurm names it (``SLURMD_NODENAME``: what ``--exclude`` takes), else the short hostname."""
    return environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def this_gcd(local_rank: int, device_count: int, environ=os.environ) -> str:
    """The GCD (GPU) index this rank drives: the one visible device's id under ``--gpus-per-task=1`` (ROCR/HIP/CUDA
    _VISIBLE_DEVICES), else the local rank's device; "-" without devices."""
    if device_count < 1:
        return "-"
    for name in ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
        ids = [v for v in environ.get(name, "").split(",") if v.strip()]
        if len(ids) == device_count:
            return ids[local_rank % device_count].strip()
    return str(local_rank % device_count)


class Progress:
    """This process's record. One instance (``PROGRESS``); tests may build their own."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {"0": 0}
        """Group id -> collectives this rank entered in it, for every group it belongs to ("0": the world; "p2p:a-b":
        sends and receives between ranks a < b). A peer with a lower count has not reached the collective."""
        self.identity = Identity(0, this_host(), "-")
        self.restart()

    def restart(self, faults: Faults | None = None) -> None:
        """A new training run in this process: phase "setup", no iteration yet (group counts stay: they follow the
        process groups). ``faults``: what a test injects as the run moves (MEGATRON_FAULT), or None."""
        self.position = Position(0, "setup", time.monotonic())
        self.faults = faults
        """Checked at each move: one attribute test when None (every run but a fault test's)."""
        self.times: dict[str, float] = {}
        """Phase -> seconds spent in it since the start; time inside collectives goes to ``COMM``."""
        self.first_iteration: int | None = None
        self.step_seconds: deque[float] = deque(maxlen=8)
        """Durations of the last training steps (saves, evaluations and logging left out): what the automatic hang
        timeout scales."""
        self._iteration_start: float | None = None

    def _charge(self, now: float) -> Position:
        p = self.position
        key = p.phase if p.collective is None else COMM
        self.times[key] = self.times.get(key, 0.0) + (now - p.since)
        return p

    def enter(self, phase: str) -> None:
        """The main thread starts ``phase``."""
        now = time.monotonic()
        p = self._charge(now)
        self.position = Position(p.iteration, phase, now)
        if self.faults is not None:
            self.faults.at(phase, self)

    def start_iteration(self, iteration: int) -> None:
        now = time.monotonic()
        if self.first_iteration is None:
            self.first_iteration = iteration
        self._iteration_start = now
        self._charge(now)
        self.position = Position(iteration, "step", now)
        if self.faults is not None:
            self.faults.at("step", self)

    def end_step(self) -> None:
        """The step (and its flags exchange) is done; what follows is logging (phase "log")."""
        if self._iteration_start is not None:
            self.step_seconds.append(time.monotonic() - self._iteration_start)
        self.enter("log")

    def enter_collective(self, op: str, group: str) -> Position:
        """Entering collective ``op`` of ``group``; returns the position to hand to ``leave_collective``."""
        now = time.monotonic()
        p = self._charge(now)
        n = self.counts.get(group, 0) + 1
        self.counts[group] = n
        self.position = Position(p.iteration, p.phase, now, (op, group, n))
        if self.faults is not None:  # inside the collective: entered, and never left if the fault blocks
            self.faults.at(op, self)
        return p

    def leave_collective(self, before: Position) -> None:
        now = time.monotonic()
        self._charge(now)
        self.position = Position(before.iteration, before.phase, now)

    def collective_failed(self, error: BaseException) -> None:
        """The collective raised: stay inside it (the verdict reads where the rank waited) and note why."""
        p = self.position
        if p.collective is not None:
            self.position = p._replace(failed=_first_line(error))

    def join_group(self, group: str) -> None:
        """This rank is a member of ``group`` (called when the group is created)."""
        self.counts.setdefault(group, 0)

    def where(self) -> str:
        """The phase as a verdict names it: ``data``, or ``all_reduce #12 of group 3 during backward``."""
        return describe(self.position.phase, self.position.collective)


def describe(phase: str, collective) -> str:
    if not collective:
        return phase
    op, group, n = collective
    return f"{op} #{n} of {group_name(group)} during {phase}"


def group_name(group: str) -> str:
    if group.startswith("p2p:"):
        return "p2p " + group[4:]
    return "the world group" if group == "0" else f"group {group}"


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return (text.splitlines()[0] if text else type(error).__name__)[:300]


PROGRESS = Progress()


def is_out_of_memory(error: BaseException) -> bool:
    """A host MemoryError, torch's device OutOfMemoryError, or the CPU allocator's failure (a plain RuntimeError)."""
    if isinstance(error, MemoryError) or type(error).__name__ == "OutOfMemoryError":
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text.lower())


def describe_out_of_memory(error: BaseException, progress: Progress = PROGRESS) -> str:
    """The one line an out-of-memory error becomes (every rank that hits it prints it; no traceback)."""
    p = progress.position
    kind = "host" if isinstance(error, MemoryError) or "CPUAllocator" in str(error) else "device"
    at = f" at iteration {p.iteration}" if p.iteration else ""
    return (f"{progress.identity} ran out of {kind} memory in {progress.where()}{at}: {_first_line(error)}; "
            "lower --micro-batch-size, raise --zero-stage, add --recompute-granularity full or more TP/PP (the "
            "layout report's est. memory is the model's estimate per GCD)")
