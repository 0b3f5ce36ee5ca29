"""Small files a run keeps in its ``--save`` folder for the jobs after this one (stdlib only: the batch shell and
tools/check_job.py read them without torch).

- ``finished``: written by rank 0 once the run reached its end (``--train-iters``, ``--train-samples`` or
  ``--train-tokens``), after the last checkpoint. examples/frontier/campaign.sh reads it: the job that finishes
  the run cancels its pending successor, a job that starts on a finished run exits 0 at once. To train further,
  raise the target and delete the marker.
- ``save_time.json``: the last checkpoint save measured in this run, the step time then, and the last evaluation's
  time per sample with the ranks it ran on (megatron/resilience/deadline.py predicts the next job's saves and
  evaluations from them).
- ``moved_evaluation.json``: the periodic evaluation a job stopped before (it did not fit before the job's end), for
  the job that resumes from that iteration's checkpoint; removed once it ran.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping

FINISHED = "finished"
SAVE_TIME = "save_time.json"
MOVED_EVALUATION = "moved_evaluation.json"


def _write_json(path: str, body: dict) -> None:
    """Through a temporary name: a reader sees all of it or nothing."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(json.dumps(body, sort_keys=True) + "\n")
    os.replace(tmp, path)


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            got = json.load(f)
    except (OSError, ValueError):
        return None
    return got if isinstance(got, dict) else None


def write_finished(folder: str, iteration: int, consumed_samples: int,
                   environ: Mapping[str, str] = os.environ) -> str:
    """Mark the run in ``folder`` finished at ``iteration``; returns the marker's path."""
    path = os.path.join(folder, FINISHED)
    _write_json(path, {"iteration": iteration, "consumed_samples": consumed_samples,
                       "job": environ.get("SLURM_JOB_ID", "-"), "time": round(time.time(), 3)})
    return path


def read_finished(folder: str) -> dict | None:
    """The marker's content; None when the run is not finished (or the marker is unreadable)."""
    return _read_json(os.path.join(folder, FINISHED))


def update_run_times(folder: str, **fields) -> None:
    """Merge ``fields`` (``save_secs``, ``step_secs``, ``eval_sample_secs``, ...) into the run's measured times for the
    next job. Advice only: a failed write is ignored (a full disk is reported by the next save, not here)."""
    body = _read_json(os.path.join(folder, SAVE_TIME)) or {}
    body.update(fields, time=round(time.time(), 3))
    try:
        _write_json(os.path.join(folder, SAVE_TIME), body)
    except OSError:
        pass


def write_save_time(folder: str, save_secs: float, job: str | None, iteration: int,
                    step_secs: float | None) -> None:
    """Keep the last save's duration (and the step time) for the next job."""
    update_run_times(folder, save_secs=round(save_secs, 3), job=job, iteration=iteration,
                     step_secs=round(step_secs, 4) if step_secs else None)


def read_run_times(folder: str | None) -> dict:
    """Everything measured so far (empty when nothing is, or the file is unreadable)."""
    return (_read_json(os.path.join(folder, SAVE_TIME)) if folder else None) or {}


def read_save_time(folder: str | None) -> dict | None:
    """{"save_secs", "step_secs", "job", "iteration", "time"} of the run's last measured save; None: none yet."""
    got = read_run_times(folder)
    try:
        return got if float(got["save_secs"]) >= 0 else None
    except (KeyError, TypeError, ValueError):
        return None


def write_moved_evaluation(folder: str, iteration: int, job: str | None) -> None:
    """The periodic evaluation of ``iteration`` (whose checkpoint this job saves) is the next job's to run."""
    _write_json(os.path.join(folder, MOVED_EVALUATION), {"iteration": iteration, "job": job,
                                                           "time": round(time.time(), 3)})


def read_moved_evaluation(folder: str | None) -> dict | None:
    """{"iteration", "job", "time"} of the evaluation a job moved to the next; None when there is none."""
    got = _read_json(os.path.join(folder, MOVED_EVALUATION)) if folder else None
    return got if got is not None and isinstance(got.get("iteration"), int) else None


def clear_moved_evaluation(folder: str) -> None:
    """The moved evaluation ran (a later resume from the same checkpoint does not repeat it)."""
    try:
        os.remove(os.path.join(folder, MOVED_EVALUATION))
    except OSError:
        pass
