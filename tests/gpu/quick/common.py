"""What quick.sh's step modules share: their command line, sub-commands with logs and deadlines, pytest with a
JUnit report, and the training log's figures."""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass

from tests.gpu.quick import summary
from tests.launch import TIMED_OUT, run_command

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BENCH = os.path.join(REPO, "bench")
_ITER = re.compile(r"iteration\s+(\d+)/\s*\d+ .*?\| lm loss: ([0-9.E+-]+) .*?\| tokens per second: ([0-9.]+) .*?"
                   r"\| MFU: ([0-9.]+)% .*?\| mem \(GB\): ([0-9.]+)")


@dataclass
class StepArgs:
    step: str
    gpu: bool
    out: str
    deadline: float
    """time.monotonic() by which the step must have written its result (its timeout, less a margin)."""

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def result(self, status: str, detail: str, **metrics) -> None:
        summary.write_result(self.out, self.step, status, detail, **metrics)

    def log(self, name: str) -> str:
        """Path of a sub-command's log in the output folder: <step>-<name>.log."""
        return os.path.join(self.out, f"{self.step}-{name}.log")


def step_args(argv: list[str] | None = None) -> StepArgs:
    p = argparse.ArgumentParser(description="one step of tests/gpu/quick.sh (run by its orchestrator)")
    p.add_argument("--step", required=True)
    p.add_argument("--mode", choices=["gpu", "cpu"], required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seconds", type=float, required=True, help="the step's timeout")
    a = p.parse_args(argv)
    margin = min(15.0, 0.1 * a.seconds)  # to write the result of what finished before the timeout strikes
    return StepArgs(a.step, a.mode == "gpu", a.out, time.monotonic() + a.seconds - margin)


def run_logged(cmd: list[str], log: str, timeout: float, env: dict | None = None) -> tuple[int, str]:
    """(exit status, output) of ``cmd`` run from the repository root, stdout and stderr into ``log``; 124 when it
    ran past ``timeout`` and was killed (tests/launch/). It stays in the step's process group, so the step's own
    ``timeout`` reaches it, and the orchestrator's sweep of that group after the step takes whatever it left
    running."""
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
    rc = run_command(cmd, timeout, env=env, cwd=REPO, log=log, own_group=False).returncode
    if rc == TIMED_OUT:
        with open(log, "a") as f:
            f.write(f"\nquick: killed after {timeout:.0f} s\n")
    with open(log, errors="replace") as f:
        return rc, f.read()


def env_with(**extra: str) -> dict:
    """This process's environment, the repository first on PYTHONPATH, plus ``extra``."""
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p)
    return env


@dataclass(frozen=True)
class Case:
    name: str
    outcome: str
    """passed | failed | skipped"""
    message: str
    props: dict[str, str]


def pytest_cases(args: list[str], junit: str, log: str, timeout: float, env: dict | None = None) -> list[Case]:
    """Run pytest on ``args`` with a JUnit report; each case's outcome, first message line and recorded properties
    (``record_property``). A run that collected nothing, or was killed, raises RuntimeError with its error line."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", f"--junitxml={junit}", *args]
    rc, text = run_logged(cmd, log, timeout, env)
    if rc == 124:
        raise RuntimeError(f"pytest killed after {timeout:.0f} s (see {os.path.basename(log)})")
    if rc == 5 or not os.path.exists(junit):
        raise RuntimeError(f"pytest exit {rc}, no tests run: {summary.first_error_line(text)}")
    cases = []
    for tc in ET.parse(junit).getroot().iter("testcase"):
        props = {p.get("name"): p.get("value") for p in tc.iter("property")}
        outcome, message = "passed", ""
        for tag, what in (("failure", "failed"), ("error", "failed"), ("skipped", "skipped")):
            el = tc.find(tag)
            if el is not None:
                outcome = what
                text = (el.get("message") or el.text or "").strip()
                message = text.splitlines()[0] if text else tag
                break
        cases.append(Case(f"{tc.get('classname', '')}::{tc.get('name', '')}", outcome, message, props))
    return cases


def count(cases: list[Case]) -> str:
    """e.g. "12 passed, 1 failed, 3 skipped" (zero counts left out)."""
    parts = [f"{sum(c.outcome == o for c in cases)} {o}" for o in summary.STATUSES]
    return ", ".join(p for p in parts if not p.startswith("0 ")) or "no cases"


@dataclass(frozen=True)
class TrainLog:
    losses: dict[int, float]
    tokens_per_s: dict[int, float]
    mfu: dict[int, float]
    mem_gb: dict[int, float]

    def steady(self, series: dict[int, float], skip: int) -> float:
        """Median of ``series`` after the first ``skip`` iterations (compilation, kernel measurement, warm-up)."""
        vals = [v for it, v in sorted(series.items()) if it > skip] or list(series.values())
        return statistics.median(vals) if vals else float("nan")


def train_log(text: str) -> TrainLog:
    """The per-iteration figures of a pretrain_gpt.py log (the log line of megatron/training/log.py)."""
    rows = [(int(m[1]), float(m[2]), float(m[3]), float(m[4]), float(m[5])) for m in _ITER.finditer(text)]
    return TrainLog(*({r[0]: r[i] for r in rows} for i in range(1, 5)))
