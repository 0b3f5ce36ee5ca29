"""Failure records: one JSON line per lost, stuck or failing rank, appended to ``failures.jsonl`` in the run's
``--save`` folder, so the next job of a campaign can keep away from the node (examples/frontier/campaign.sh).

One line, keys sorted: ``{"cause": "lost_rank", "detail": "...", "host": "frontier01234", "job": "1234567",
"rank": 17, "time": 1764150000.0}``. ``cause`` is one of ``CAUSES``; the hardware ones exclude a host after a
single record, the others (but the run's own: out of memory, a collective hang) after ``REPEATS`` records. Stdlib
only: the batch shell reads it with any Python.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass


FILE = "failures.jsonl"
LOST_RANK, STUCK_RANK, DEVICE_ERROR, NODE_FAILURE = "lost_rank", "stuck_rank", "device_error", "node_failure"
COLLECTIVE_HANG, OUT_OF_MEMORY, STRAGGLER = "collective_hang", "out_of_memory", "straggler"
CAUSES = (LOST_RANK, STUCK_RANK, DEVICE_ERROR, NODE_FAILURE, COLLECTIVE_HANG, OUT_OF_MEMORY, STRAGGLER)
HARDWARE = frozenset({DEVICE_ERROR, NODE_FAILURE})
"""Causes that mark the node itself: one record is enough to keep the next job away from it."""
THE_RUN = frozenset({OUT_OF_MEMORY, COLLECTIVE_HANG})
"""Causes that say nothing about the host (the layout does not fit; every rank waits in one collective)."""
REPEATS = 2
"""Records of another cause on one host before the host is excluded (one may be the job's own bug)."""

# Messages of the HIP/CUDA runtimes and the kernel driver that mean the device or its node is failing, not our code.
_DEVICE_SIGNS = ("uncorrectable ecc", "ecc error", "hipErrorECC", "illegal memory access was encountered by the "
                 "hardware", "hardware exception", "gpu is lost", "device is lost", "hsa_status_error_hardware",
                 "memory access fault by gpu")


@dataclass(frozen=True)
class FailureRecord:
    job: str
    """The Slurm job id (``SLURM_JOB_ID``; "-" outside Slurm)."""
    time: float
    """Seconds since the epoch when the failure was noticed."""
    rank: int
    """The global rank that was lost, stuck or failed."""
    host: str
    """The node that rank ran on (``SLURMD_NODENAME``, else its hostname)."""
    cause: str
    """One of ``CAUSES``."""
    detail: str = ""
    """The one line the job's log has for it."""


@dataclass(frozen=True)
class FailureLog:
    """Where one job writes its failure records."""

    path: str
    job: str

    @classmethod
    def in_folder(cls, folder: str | None, environ: Mapping[str, str] = os.environ) -> FailureLog | None:
        """The log of ``folder`` (the run's ``--save``); None without one (nothing to write records into)."""
        if not folder:
            return None
        return cls(os.path.join(folder, FILE), environ.get("SLURM_JOB_ID", "-"))

    def write(self, rank: int, host: str, cause: str, detail: str = "") -> FailureRecord:
        """Append one record. One ``write`` of one line on an O_APPEND file: records of several ranks never
        interleave. Never raises: a failing job must still exit with its own message."""
        if cause not in CAUSES:
            raise ValueError(f"unknown failure cause {cause!r}: one of {CAUSES}")
        record = FailureRecord(self.job, round(time.time(), 3), int(rank), host, cause, detail.splitlines()[0]
                               if detail else "")
        line = json.dumps(asdict(record), sort_keys=True) + "\n"
        try:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
        except OSError:
            pass
        return record


def read_records(path: str) -> list[FailureRecord]:
    """Every well-formed record of ``path`` (none when it does not exist); a torn or foreign line is skipped."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    names = set(FailureRecord.__dataclass_fields__)
    for line in lines:
        try:
            d = json.loads(line)
            out.append(FailureRecord(**{k: v for k, v in d.items() if k in names}))
        except (ValueError, TypeError):
            continue
    return out


def hosts_to_exclude(records: list[FailureRecord]) -> dict[str, str]:
    """host -> why, for every host with a hardware-cause record or ``REPEATS`` records of any cause."""
    out: dict[str, str] = {}
    by_host: dict[str, list[FailureRecord]] = {}
    for r in records:
        if r.host and r.host != "?" and r.cause not in THE_RUN:
            by_host.setdefault(r.host, []).append(r)
    for host, recs in by_host.items():
        hardware = [r for r in recs if r.cause in HARDWARE]
        if hardware:
            out[host] = f"{hardware[-1].cause} in job {hardware[-1].job}"
        elif len(recs) >= REPEATS:
            jobs = ", ".join(dict.fromkeys(r.job for r in recs))
            out[host] = f"{len(recs)} failures ({', '.join(sorted({r.cause for r in recs}))}) in jobs {jobs}"
    return out


def device_error(err: BaseException) -> bool:
    """Does ``err`` (an exception a rank died of) say the device or the node failed?"""
    text = str(err).lower()
    return any(sign.lower() in text for sign in _DEVICE_SIGNS)
