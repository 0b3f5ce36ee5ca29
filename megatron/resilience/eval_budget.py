"""Evaluations against the job's end: which iterations evaluate and how many samples each draws
(megatron/training/evaluate.py runs them as upstream does), how long a sample takes (the last evaluation measured in
this job, else in an earlier one, kept in ``--save``/save_time.json and scaled to this job's ranks), and the verdict
an evaluation under way gets after its first batches, measured: go on, go on and then stop, or move to the next job.

Before any evaluation was measured none is budgeted: a guess from the step time is wrong both ways (a step with an
offloaded optimizer, or slowed by a test, is no forward), and the first evaluation is judged on its own batches.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.config import RunConfig


@dataclass(frozen=True)
class EvalPlan:
    """The run's evaluations: every ``interval`` iterations ``iters`` global batches of the validation split, and at
    the end of training ``iters`` of the validation and of the test split (those the run has)."""

    interval: int = 0
    iters: int = 0
    global_batch: int = 0
    valid: bool = False
    test: bool = False

    @classmethod
    def from_run(cls, run: RunConfig, valid: bool, test: bool) -> EvalPlan:
        """``valid``/``test``: the run has that split."""
        t = run.training
        return cls(t.eval_interval, t.eval_iters, t.global_batch_size, valid, test)

    def periodic(self, it: int | None) -> int:
        """Samples the evaluation after step ``it`` draws (0: none is due; ``it`` None: not known)."""
        if it is None or not self.valid or self.iters <= 0 or self.interval <= 0 or it % self.interval:
            return 0
        return self.iters * self.global_batch

    def at_end(self) -> int:
        """Samples the end-of-training evaluation draws (0: none)."""
        return max(0, self.iters) * self.global_batch * (int(self.valid) + int(self.test))

    def end_splits(self) -> str:
        """"valid and test", "valid", "test"."""
        return " and ".join(name for name, on in (("valid", self.valid), ("test", self.test)) if on)


class EvalEstimate:
    """Seconds per evaluated sample on this job's ``world_size`` ranks. ``kept``: the run's measured times
    (run_files.read_run_times): an earlier job's figure at W ranks counts W / world_size times (the same global
    batches, spread over more or fewer ranks)."""

    def __init__(self, world_size: int, kept: dict, job_id: str | None) -> None:
        self.world_size, self.job_id = max(1, world_size), job_id
        self.per_sample: float | None = None
        self.source = "not measured yet: judged after its first batches"
        try:
            secs, then = float(kept["eval_sample_secs"]), int(kept.get("eval_world") or world_size)
        except (KeyError, TypeError, ValueError):
            return
        self.per_sample = secs * then / self.world_size
        self.source = f"measured by job {kept.get('eval_job', '?')}" + (
            f" at {then} ranks, scaled to {self.world_size}" if then != self.world_size else "")

    def secs(self, samples: int) -> float:
        """The predicted seconds of an evaluation of ``samples`` samples (0 before any was measured)."""
        return samples * self.per_sample if samples > 0 and self.per_sample is not None else 0.0

    def measured(self, secs: float, samples: int) -> dict:
        """An evaluation of ``samples`` samples took ``secs``: the figure from now on; returns the fields the run
        files keep for the next job."""
        self.per_sample = secs / max(1, samples)
        self.source = f"measured by job {self.job_id}"
        return {"eval_sample_secs": round(self.per_sample, 6), "eval_world": self.world_size,
                "eval_job": self.job_id}


GO, STOP_AFTER, MOVE = 0, 1, 2
"""What an evaluation under way does after its first batches (agreed over the ranks): go on, go on and then stop
the job (no time for the next step and a save after it), or stop now and move to the next job."""


def verdict(left: float, rest: float, to_stop: float, to_go: float) -> int:
    """``left`` seconds to the job's end; the evaluation needs ``rest`` more; then ``to_stop`` (a save, the margin)
    ends the job in time and ``to_go`` (the next step, saves and evaluations due, a save, the margin) lets it
    train on."""
    if rest + to_stop > left:
        return MOVE
    return STOP_AFTER if rest + to_go > left else GO
