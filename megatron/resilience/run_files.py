"""Small files a run keeps in its ``--save`` folder for the jobs after this one (stdlib only: the batch shell and
tools/check_job.py read them without torch).

- ``finished``: written by rank 0 once the run reached its end (``--train-iters``, ``--train-samples`` or
  ``--train-tokens``), after the last checkpoint. examples/frontier/campaign.sh reads it: the job that finishes
  the run cancels its pending successor, a job that starts on a finished run exits 0 at once. To train further,
  raise the target and delete the marker.
- ``save_time.json``: the last checkpoint save measured in this run, and the step time then
  (megatron/resilience/deadline.py predicts the next job's saves from it).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping

FINISHED = "finished"
SAVE_TIME = "save_time.json"


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


def write_save_time(folder: str, save_secs: float, job: str | None, iteration: int,
                    step_secs: float | None) -> None:
    """Keep the last save's duration (and the step time) for the next job. Advice only: a failed write is
    ignored (a full disk is reported by the next save, not here)."""
    try:
        _write_json(os.path.join(folder, SAVE_TIME), {
            "save_secs": round(save_secs, 3), "job": job, "iteration": iteration, "time": round(time.time(), 3),
            "step_secs": round(step_secs, 4) if step_secs else None})
    except OSError:
        pass


def read_save_time(folder: str | None) -> dict | None:
    """{"save_secs", "step_secs", "job", "iteration", "time"} of the run's last measured save; None: none yet."""
    got = _read_json(os.path.join(folder, SAVE_TIME)) if folder else None
    try:
        return got if got is not None and float(got["save_secs"]) >= 0 else None
    except (KeyError, TypeError, ValueError):
        return None
