"""Stop before the Slurm job's end: save, exit 0, and let the next job of the campaign resume.

Rank 0 alone knows the end time (``SLURM_JOB_END_TIME``, else ``squeue -h -j $SLURM_JOB_ID -o %e``, re-read in a
background thread every few minutes since ``scontrol update TimeLimit=`` moves it), a running step time and a
predicted save time (the last save measured in this run, kept in ``--save``/save_time.json across jobs; before
any, the checkpoint's bytes over a measured write rate of the ``--save`` file system). After every iteration it
asks: would the next step, a save and the margin still fit? Its answer rides the flags all-reduce of
megatron/resilience/control.py, so every rank stops at the same iteration without a collective of its own.
"""

from __future__ import annotations

import datetime
import math
import os
import re
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from megatron.checkpointing.live.space import checkpoint_bytes
from megatron.config import RunConfig
from megatron.resilience import eval_budget
from megatron.resilience.eval_budget import EvalEstimate, EvalPlan
from megatron.resilience.run_files import read_run_times, read_save_time, update_run_times, write_save_time

MIN_MARGIN_S = 15.0
STEP_WINDOW = 8
"""Step intervals kept; the largest is the next step's estimate (an evaluation or a slow step is not missed)."""
PROBE_MAX_BYTES = 64 * 2**20


@dataclass(frozen=True)
class DeadlineSettings:
    """What the deadline needs, read once from the flags and the job's environment."""

    job_id: str | None
    """``SLURM_JOB_ID``; None outside Slurm: no end time, no deadline."""
    end_time: float | None = None
    """``SLURM_JOB_END_TIME`` (seconds since the epoch); None: ask ``squeue``."""
    unreadable_end_time: str | None = None
    """``SLURM_JOB_END_TIME`` when it is set but not a time (``tomorrow``): named in the log."""
    margin_secs: float | None = None
    """--job-end-margin-secs: kept free beyond the next step and a save. None: max(2 step times, 20% of the
    predicted save, 15 s)."""
    save_dir: str | None = None
    """--save: where the save-time measure lives and the write rate is probed."""
    save_optimizer: bool = True
    """False under --no-save-optim (a smaller checkpoint to estimate)."""
    signal_lead_secs: float | None = None
    """The lead of the job's ``#SBATCH --signal=[B:]USR1@<lead>`` (exported by examples/frontier/campaign.sh as
    ``MEGATRON_SIGNAL_LEAD_SECS``); None: unknown."""
    reread_secs: float = 300.0
    """How often rank 0 asks squeue again."""
    save_interval: int | None = None
    """--save-interval: an iteration that saves anyway costs a save more before the next step."""
    train_iters: int | None = None
    """--train-iters: after the last iteration comes no step (the end of training saves anyway)."""

    @classmethod
    def from_run(cls, run: RunConfig, environ: Mapping[str, str] = os.environ) -> DeadlineSettings:
        """From the run's settings and the job's environment (Slurm's variables, campaign.sh's signal lead)."""
        end = (environ.get("SLURM_JOB_END_TIME") or "").strip()
        lead = environ.get("MEGATRON_SIGNAL_LEAD_SECS")
        readable = bool(re.fullmatch(r"\d+(\.\d*)?", end))
        return cls(job_id=environ.get("SLURM_JOB_ID") or None,
                   end_time=float(end) if readable else None, unreadable_end_time=end if end and not readable else None,
                   margin_secs=run.runtime.job_end_margin_secs, save_dir=run.checkpoint.save,
                   save_optimizer=not run.checkpoint.no_save_optim,
                   signal_lead_secs=float(lead) if lead and lead.strip().isdigit() else None,
                   save_interval=run.checkpoint.save_interval, train_iters=run.training.train_iters)


def squeue_end_time(job_id: str, timeout: float = 30.0) -> float | None:
    """The job's end from ``squeue -h -j ID -o %e`` (local time, ``2026-11-26T14:00:05``); None when unknown."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%e"], capture_output=True, text=True,
                             timeout=timeout, check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    try:
        return datetime.datetime.strptime(out.splitlines()[0].strip(), "%Y-%m-%dT%H:%M:%S").timestamp()
    except (ValueError, IndexError):  # "N/A", "Unknown", nothing
        return None


def bytes_per_writer(run: RunConfig, world_size: int, with_optimizer: bool) -> int:
    """What the busiest rank writes in one save: the weights are split over TP x PP (DP replicas are saved once),
    the optimizer states over every rank under ZeRO >= 1 (else over TP x PP)."""
    p = run.parallel
    total = checkpoint_bytes(run, with_optimizer)
    if p.zero_hierarchy:
        return math.ceil(total / max(1, world_size))
    weights = checkpoint_bytes(run, False)
    mp = max(1, p.tp * p.pp)
    optim_writers = max(1, world_size) if p.zero_stage >= 1 else mp
    return math.ceil(weights / mp + (total - weights) / optim_writers)


def write_rate(folder: str, nbytes: int) -> float | None:
    """Bytes per second of one writer to ``folder``'s file system: ``nbytes`` written, fsynced and removed."""
    while folder and not os.path.isdir(folder):
        folder = os.path.dirname(folder.rstrip("/"))
    if not folder:
        return None
    path = os.path.join(folder, f".write-probe-{os.getpid()}")
    block = os.urandom(min(nbytes, 2**20))  # random: a compressing file system must not flatter the rate
    t0 = time.monotonic()
    try:
        with open(path, "wb") as f:
            left = nbytes
            while left > 0:
                left -= f.write(block[:left])
            f.flush()
            os.fsync(f.fileno())
        secs = time.monotonic() - t0
    except OSError:
        return None
    finally:
        try:
            os.remove(path)
        except OSError:
            pass
    return nbytes / max(secs, 1e-6)


@dataclass(frozen=True)
class SavePrediction:
    secs: float
    source: str
    """Where the figure comes from, for the log: "measured by job 1233", "estimated: 2.1 GB at 1.3 GB/s"."""


def predict_save(settings: DeadlineSettings, writer_bytes: int,
                 rate: Callable[[str, int], float | None] = write_rate) -> SavePrediction:
    """The run's last measured save, else the busiest rank's bytes over the probed write rate."""
    if not settings.save_dir:
        return SavePrediction(0.0, "nothing to save (no --save)")
    last = read_save_time(settings.save_dir)
    if last is not None:
        return SavePrediction(float(last["save_secs"]), f"measured by job {last.get('job', '?')}")
    probe = max(2**20, min(writer_bytes, PROBE_MAX_BYTES))
    got = rate(settings.save_dir, probe)
    if got is None:
        return SavePrediction(0.0, "unknown: --save's file system could not be probed")
    return SavePrediction(writer_bytes / got, f"estimated: {writer_bytes / 1e9:.3g} GB per rank at "
                                              f"{got / 1e9:.3g} GB/s")


class EndTime:
    """The job's end as rank 0 knows it: the environment's figure, refreshed by squeue in a daemon thread."""

    def __init__(self, settings: DeadlineSettings, query: Callable[[str], float | None] | None = None) -> None:
        self.job_id, self.every = settings.job_id, settings.reread_secs
        self.query = query or squeue_end_time
        self.value = settings.end_time
        self.source = "SLURM_JOB_END_TIME"
        if self.value is None and self.job_id:
            self.value, self.source = self.query(self.job_id), "squeue"
            if settings.unreadable_end_time is not None:
                self.source += f" (SLURM_JOB_END_TIME={settings.unreadable_end_time!r} is not a time)"
        self._stop = threading.Event()
        self._thread = None
        if self.value is not None and self.every > 0:
            self._thread = threading.Thread(target=self._refresh, name="job-end-time", daemon=True)
            self._thread.start()

    def _refresh(self) -> None:
        while not self._stop.wait(self.every):
            got = self.query(self.job_id)
            if got is not None and got != self.value:
                print(f"> job {self.job_id}'s end moved to {_clock(got)} (was {_clock(self.value)})", flush=True)
                self.value = got

    def close(self) -> None:
        self._stop.set()


def _clock(t: float) -> str:
    return datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


class Deadline:
    """Rank 0's judge of "stop now". ``should_stop()`` after each iteration, ``saved()`` after each save,
    ``evaluated()`` after each evaluation."""

    def __init__(self, settings: DeadlineSettings, end: EndTime, save: SavePrediction,
                 clock: Callable[[], float] = time.time, say: Callable[[str], None] | None = None,
                 evals: EvalPlan = EvalPlan(), world_size: int = 1) -> None:
        """``evals``: the run's evaluations; ``world_size``: this job's ranks (an earlier job's evaluation time is
        scaled to it)."""
        self.settings, self.end, self.clock = settings, end, clock
        self.say = say or (lambda msg: print(msg, flush=True))
        self.save_secs, self.save_source = save.secs, save.source
        last = read_save_time(settings.save_dir)
        self.previous_step = float(last["step_secs"]) if last and last.get("step_secs") else None
        self.evals = evals
        self.eval = EvalEstimate(world_size, read_run_times(settings.save_dir), settings.job_id)
        self.steps: deque[float] = deque(maxlen=STEP_WINDOW)
        self.step_mean: float | None = None
        self._last = clock()
        self._announced = False
        self.reason = ""
        self._warn_signal_lead()

    def begin(self) -> None:
        """Training starts now (the set-up before it is no step)."""
        self._last = self.clock()

    def step(self) -> float:
        """The next step's estimate: the largest recent interval (the last job's before this job's first)."""
        if self.steps:
            return max(self.steps)
        return self.previous_step or 0.0

    def margin(self) -> float:
        if self.settings.margin_secs is not None:
            return self.settings.margin_secs
        return max(2 * self.step(), 0.2 * self.save_secs, MIN_MARGIN_S)

    def eval_secs(self, samples: int) -> float:
        """The predicted seconds of an evaluation that draws ``samples`` samples."""
        return self.eval.secs(samples)

    def left(self) -> float:
        """Seconds to the job's end (inf when unknown)."""
        return math.inf if self.end.value is None else self.end.value - self.clock()

    def fits(self, secs: float) -> bool:
        """Would ``secs`` of work and the margin end before the job does?"""
        return secs + self.margin() <= self.left()

    def should_stop(self, drain: float | None = 0.0, it: int | None = None) -> bool:
        """``drain``: seconds the save in flight (--async-save) still needs before a stop can save (None: unknown,
        counted as a whole save); ``it``: the iteration just done (None: no evaluation or interval save is
        budgeted)."""
        drain = self.save_secs if drain is None else drain
        now = self.clock()
        interval, self._last = now - self._last, now
        self.steps.append(interval)
        self.step_mean = interval if self.step_mean is None else 0.9 * self.step_mean + 0.1 * interval
        end = self.end.value
        if end is None:
            return False
        if not self._announced:
            self._announce(now, end, interval, self.margin())
        if it is not None and self.settings.train_iters is not None and it >= self.settings.train_iters:
            return False  # no step follows: the end of training saves anyway, and judges its evaluation
        costs = [("this iteration's evaluation", self.eval_secs(self.evals.periodic(it))), *self.to_go(it, drain)]
        if now + sum(secs for _, secs in costs) <= end:
            return False
        named = [f"{name} ({secs:.1f} s)" for name, secs in costs
                 if secs or name in ("the next step", "a save", "the margin")]
        self.reason = (f"the job ends at {_clock(end)}: {', '.join(named[:-1])} and {named[-1]} would not fit in the "
                       f"{max(0.0, end - now):.0f} s left")
        return True

    def to_go(self, it: int | None, drain: float | None = 0.0, saved: bool = False) -> list[tuple[str, float]]:
        """What must still fit after iteration ``it`` (its evaluation aside) for training to go on: its interval
        save (none when ``saved``: its checkpoint exists), the next step and its evaluation, the save in flight, a
        save (where the job would stop) and the margin. (name, seconds) each."""
        drain = self.save_secs if drain is None else drain
        every = self.settings.save_interval
        return [("its interval save", self.save_secs if it and every and not it % every and not saved else 0.0),
                ("the next step", self.step()),
                ("the next evaluation", self.eval_secs(self.evals.periodic(None if it is None else it + 1))),
                ("the save in flight", drain), ("a save", self.save_secs), ("the margin", self.margin())]

    def judge_evaluation(self, kind: str, it: int, name: str, elapsed: float, rest: float, drain: float | None,
                         did_steps: bool) -> tuple[int, str, str]:
        """An evaluation under way (``kind``: "periodic" after step ``it``, "moved" before this job's first step,
        "end" after training; ``name`` for the log) ran ``elapsed`` s and needs ``rest`` more: (the verdict, the
        reason a stop gives, the line to say). A periodic one must leave time for a save (``drain``: the save in
        flight), and for the next step and what follows it to go on; a moved one for the next step; the end of
        training only for the margin."""
        margin, left, total = self.margin(), self.left(), elapsed + rest
        if kind == "end":
            go = stop = [("the margin", margin)]
        else:
            go = self.to_go(it, drain if kind == "periodic" else 0.0, saved=kind == "moved")
            stop = [c for c in go if c[0] in ("the save in flight", "a save", "the margin")] if kind == "periodic" \
                else [("the margin", margin)]
        verdict = eval_budget.verdict(left, rest, sum(s for _, s in stop), sum(s for _, s in go))
        if verdict == eval_budget.GO:
            return verdict, "", ""
        if verdict == eval_budget.STOP_AFTER:
            after = ", ".join(f"{n} ({s:.1f} s)" for n, s in go if s)
            return verdict, (f"the job ends at {_clock(self.end.value)}: after {name} (~{total:.0f} s), {after} would "
                             f"not fit in the {max(0.0, left - rest):.0f} s left"), ""
        why = f"{name} (~{total:.0f} s predicted, {elapsed:.0f} s of it done) does not fit before the job's end"
        if kind == "periodic":
            line = f"> {why} ({left:.0f} s left, with a save and the margin): moved to the next job, which runs it " \
                "first"
        elif did_steps:
            line = f"> {why} ({left:.0f} s left): moved to the next job; the run is marked finished after it"
        else:
            line = (f"> {why} ({left:.0f} s left), although this job did nothing else: it is longer than the job's "
                    "time limit allows; ask for more time (sbatch -t) or fewer --eval-iters")
        return verdict, why, line

    def _announce(self, now: float, end: float, interval: float, margin: float) -> None:
        self._announced = True
        per = self.previous_step or interval
        if self.evals.periodic(self.evals.interval):  # each iteration's share of the periodic evaluations
            per += self.eval_secs(self.evals.periodic(self.evals.interval)) / self.evals.interval
        left = end - now - self.save_secs - margin
        iters = max(0, int(left // per)) if per > 0 else 0
        evals = ""
        if self.evals.periodic(self.evals.interval) or self.evals.at_end():
            evals = f"; evaluation {self.eval.source}"  # not measured yet
            if self.eval.per_sample is not None:
                evals = (f"; predicted evaluation {self.eval_secs(self.evals.global_batch):.3g} s per global batch "
                         f"({self.eval.source})")
        self.say(f"> job {self.settings.job_id} ends at {_clock(end)} (in {end - now:.0f} s, {self.end.source}); "
                 f"predicted save {self.save_secs:.1f} s ({self.save_source}){evals}; margin {margin:.1f} s; this "
                 f"job will do about {iters} more iterations ({per:.3g} s each)")

    def saved(self, secs: float, iteration: int) -> None:
        """A save of ``secs`` seconds just ended: the prediction from now on, and the next job's."""
        predicted = self.save_secs
        self.save_secs, self.save_source = secs, f"measured by job {self.settings.job_id}"
        self._last = self.clock()  # the save is not part of the next step's interval
        self.say(f"> checkpoint save took {secs:.1f} s (predicted {predicted:.1f} s)")
        if self.settings.save_dir:
            write_save_time(self.settings.save_dir, secs, self.settings.job_id, iteration, self.step_mean)

    def evaluated(self, secs: float, samples: int) -> None:
        """An evaluation of ``samples`` samples took ``secs``: the prediction from now on, and the next job's."""
        predicted = self.eval_secs(samples)
        kept = self.eval.measured(secs, samples)
        self._last = self.clock()  # the evaluation is budgeted apart: not part of the next step's interval
        self.say(f"> evaluation took {secs:.1f} s (predicted {predicted:.1f} s)")
        if self.settings.save_dir:
            update_run_times(self.settings.save_dir, **kept)

    def _warn_signal_lead(self) -> None:
        lead = self.settings.signal_lead_secs
        if lead is None or self.save_secs <= lead:
            return
        ask = 30 * math.ceil((1.2 * self.save_secs + MIN_MARGIN_S) / 30)
        self.say(f"> warning: the predicted checkpoint save ({self.save_secs:.0f} s, {self.save_source}) is longer "
                 f"than the job's signal lead ({lead:.0f} s): a signal alone leaves no time to save; ask for "
                 f"#SBATCH --signal=B:USR1@{ask}")

    def close(self) -> None:
        self.end.close()


def start_deadline(settings: DeadlineSettings, run: RunConfig, world_size: int, rank: int,
                   evals: EvalPlan = EvalPlan()) -> Deadline | None:
    """Rank 0's Deadline under Slurm; None on other ranks, outside Slurm, or when the end time is unknown.
    ``evals``: the run's evaluations (budgeted with the steps)."""
    if rank != 0 or not settings.job_id:
        return None
    end = EndTime(settings)
    if end.value is None:
        bad = settings.unreadable_end_time
        why = (f"SLURM_JOB_END_TIME={bad!r} is not a time in seconds since the epoch" if bad is not None
               else "no SLURM_JOB_END_TIME")
        print(f"> job {settings.job_id}: end time unknown ({why}, squeue gave none): stopping only on signals, "
              "--exit-duration-in-mins or --exit-interval", flush=True)
        return None
    return Deadline(settings, end, predict_save(settings, bytes_per_writer(run, world_size, settings.save_optimizer)),
                    evals=evals, world_size=world_size)
