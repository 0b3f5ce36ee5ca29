"""The "finished" marker: written into ``--save`` by rank 0 once the run reached its end (``--train-iters``,
``--train-samples`` or ``--train-tokens``), after the last checkpoint. The batch scripts read it
(examples/frontier/campaign.sh): a job that finishes the run cancels its pending successor, and a job that starts
on a finished run exits 0 at once. To train further, raise the target and delete the marker."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping

FILE = "finished"


def write_finished(folder: str, iteration: int, consumed_samples: int,
                   environ: Mapping[str, str] = os.environ) -> str:
    """Write the marker (through a temporary name: a reader sees all of it or nothing); returns its path."""
    path = os.path.join(folder, FILE)
    body = {"iteration": iteration, "consumed_samples": consumed_samples, "job": environ.get("SLURM_JOB_ID", "-"),
            "time": round(time.time(), 3)}
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(json.dumps(body, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def read_finished(folder: str) -> dict | None:
    """The marker's content; None when the run is not finished (or the marker is unreadable)."""
    try:
        with open(os.path.join(folder, FILE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
