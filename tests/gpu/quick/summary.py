"""quick.sh's record: each step's result file, its outcome (passed / failed with the first error line / skipped),
and the one summary file (a header of ``key: value`` lines, then one line per step).

Step lines read ``<step>: <passed|failed|skipped> [(<seconds> s)] [| <detail>]``; ``parse`` reads them back.
Pure logic (no torch): tests/unit/test_gpu_quick.py checks it on CPU.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

STATUSES = ("passed", "failed", "skipped")
SUMMARY = "summary.txt"
TIMED_OUT = (124, 137)  # coreutils timeout: TERM sent (124), or KILL after --kill-after (137)
_MAX = 400  # characters of one detail: the summary stays one line per step

_LINE = re.compile(r"^(?P<step>[a-z0-9]+): (?P<status>passed|failed|skipped)(?: \((?P<seconds>\d+) s\))?"
                   r"(?: \| (?P<detail>.*))?$")
_PYTEST_FAILED = re.compile(r"^(FAILED|ERROR) \S")
_PYTEST_E = re.compile(r"^E\s+\S")
_EXCEPTION = re.compile(r"^\s*(error:|[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b:?)")


@dataclass(frozen=True)
class Outcome:
    step: str
    status: str
    seconds: float | None
    detail: str

    def line(self) -> str:
        took = "" if self.seconds is None else f" ({self.seconds:.0f} s)"
        detail = " ".join(self.detail.split())  # one line, whatever the step wrote
        if len(detail) > _MAX:
            detail = detail[:_MAX - 3] + "..."
        return f"{self.step}: {self.status}{took}" + (f" | {detail}" if detail else "")


def result_path(out: str, step: str) -> str:
    return os.path.join(out, f"{step}.json")


def log_path(out: str, step: str) -> str:
    return os.path.join(out, f"{step}.log")


def write_result(out: str, step: str, status: str, detail: str, **metrics) -> None:
    """A step's own verdict: status, one line of detail, and its figures (tokens/s, errors, ...) for the record.
    Written again as a step progresses, so a step cut off by its timeout still leaves what it had measured."""
    if status not in STATUSES:
        raise ValueError(f"status {status!r}: one of {STATUSES}")
    tmp = result_path(out, step) + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"status": status, "detail": detail, "metrics": metrics}, f, indent=1, default=str)
    os.replace(tmp, result_path(out, step))


def read_result(out: str, step: str) -> dict | None:
    try:
        with open(result_path(out, step)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def first_error_line(text: str) -> str:
    """The line that says what went wrong: pytest's first FAILED/ERROR summary line, else its first ``E`` line,
    else the first exception (or ``error:``) line, else the last line of output."""
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    for pattern in (_PYTEST_FAILED, _PYTEST_E, _EXCEPTION):
        for ln in lines:
            if pattern.match(ln):
                return ln.strip()
    return lines[-1].strip() if lines else "no output"


def judge(out: str, step: str, rc: int, seconds: float, timeout_s: int) -> Outcome:
    """A finished step's outcome from its exit status, its result file and its log."""
    res = read_result(out, step)
    try:
        with open(log_path(out, step), errors="replace") as f:
            log = f.read()
    except OSError:
        log = ""
    if rc in TIMED_OUT:
        had = f"; before that: {res['detail']}" if res and res.get("detail") else ""
        return Outcome(step, "failed", seconds, f"timed out after {timeout_s} s{had}")
    if res is None:
        why = "exited 0 but wrote no result" if rc == 0 else f"exit {rc}: {first_error_line(log)}"
        return Outcome(step, "failed", seconds, why)
    if rc != 0 and res["status"] != "failed":
        return Outcome(step, "failed", seconds, f"exit {rc} after reporting {res['status']}: {first_error_line(log)}")
    return Outcome(step, res["status"], seconds if res["status"] != "skipped" else None, res["detail"])


def render(header: dict[str, str], outcomes: list[Outcome]) -> str:
    head = [f"{k}: {' '.join(str(v).split())}" for k, v in header.items()]
    return "\n".join(["# tests/gpu/quick.sh summary", *head, "", *(o.line() for o in outcomes)]) + "\n"


def parse(text: str) -> tuple[dict[str, str], list[Outcome]]:
    """(header, step outcomes) of a summary file; raises ValueError on a line that is neither."""
    header, outcomes, in_steps = {}, [], False
    for ln in text.splitlines():
        if ln.startswith("#"):
            continue
        if not ln.strip():
            in_steps = True
            continue
        if in_steps:
            m = _LINE.match(ln)
            if m is None:
                raise ValueError(f"not a step line: {ln!r}")
            secs = m.group("seconds")
            outcomes.append(Outcome(m.group("step"), m.group("status"), float(secs) if secs else None,
                                    m.group("detail") or ""))
        else:
            key, sep, value = ln.partition(": ")
            if not sep:
                raise ValueError(f"not a header line: {ln!r}")
            header[key] = value
    return header, outcomes
