"""python -m tests.gpu.quick [--out DIR] [--budget S] [STEP ...]: run quick.sh's steps, each under its own coreutils
``timeout`` (and the budget's remainder), and write $OUT/summary.txt after every step.

tests/gpu/quick.sh sets up the python (offline wheels) and calls this. It never imports torch itself: a probe
process says whether a GPU is visible; without one every step runs its CPU twin or says why it skips.
Exit status: 0 when no step failed, 1 when one did, 2 on a bad step name.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import time

from tests.gpu.quick import build, plan, summary
from tests.gpu.quick.common import REPO

KILL_AFTER_S = 10  # a step that ignores SIGTERM (pretrain_gpt.py saves a checkpoint on it) is killed this much later


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tests/gpu/quick.sh", description=__doc__.splitlines()[0])
    p.add_argument("steps", nargs="*", metavar="STEP", help=f"steps to run, from: {' '.join(plan.BY_NAME)} "
                   "(default: all; the extra ones only while the budget lasts)")
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(REPO, "build", "quick", "out"))
    p.add_argument("--budget", type=float, default=float(os.environ.get("QUICK_BUDGET_S", 0)) or None,
                   help=f"seconds for the whole run (default on a GPU {plan.BUDGET_S}; none on CPU)")
    p.add_argument("--t0", type=float, default=float(os.environ.get("QUICK_T0", 0)) or time.time(),
                   help="epoch seconds the run started (quick.sh passes its own start, install included)")
    return p.parse_args(argv)


def probe(out: str) -> dict:
    """The probe's answer; a probe that fails counts as "no GPU" and says why in the device field."""
    log = summary.log_path(out, "probe")
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, "-m", "tests.gpu.quick.probe"], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=f, text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1])
    with open(log, errors="replace") as f:
        why = summary.first_error_line(f.read())
    return {"gpu": False, "device": f"unknown: the probe failed ({why})", "device_short": "unknown", "versions": {}}


def start(step: plan.Step, seconds: int, gpu: bool, out: str) -> subprocess.Popen:
    """The step's process under coreutils timeout, output into $OUT/<step>.log. timeout leads its own process group
    and signals all of it, so a step's children (pretrain runs, pytest) go with it."""
    cmd = ["timeout", "-k", str(KILL_AFTER_S), str(seconds), sys.executable, "-m", f"tests.gpu.quick.{step.module}",
           "--step", step.name, "--mode", "gpu" if gpu else "cpu", "--out", out, "--seconds", str(seconds)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    with open(summary.log_path(out, step.name), "w") as log:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen, step: plan.Step, seconds: int, started: float, out: str) -> summary.Outcome:
    rc = proc.wait()
    try:  # what a step left behind in its process group (a child it gave up on) must not hold the GPU
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    return summary.judge(out, step.name, rc, time.monotonic() - started, seconds)


def header(info: dict, names: list[str], budget: float | None, t0: float) -> dict[str, str]:
    day = datetime.datetime.fromtimestamp(t0, datetime.timezone.utc)
    slug = "".join(c if c.isalnum() else "-" for c in info["device_short"]).strip("-")
    mode = ("gpu: steps ran on the device" if info["gpu"] else
            "cpu: no GPU visible; each step ran its CPU twin at tiny sizes or says why it skipped; nothing here is "
            "a GPU result")
    return {"date": day.strftime("%Y-%m-%d %H:%M:%S UTC"), "device": info["device"], "mode": mode,
            "versions": "; ".join(f"{k} {v}" for k, v in info["versions"].items()),
            "command": "bash tests/gpu/quick.sh " + " ".join(names),
            "budget": f"{budget:.0f} s" if budget else "none (CPU)",
            "record as": f"bench/gpu/quick_{day:%Y-%m-%d}_{slug}.txt"}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    info = probe(args.out)
    gpu = info["gpu"]
    try:
        chosen = plan.plan(args.steps, gpu)
    except plan.PlanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    budget = args.budget or (plan.BUDGET_S if gpu else None)
    head = header(info, args.steps, budget, args.t0)
    outcomes = {name: summary.Outcome(name, "skipped", None, why) for name, why in chosen.notes.items()
                if name not in {s.name for s in chosen.chosen}}
    background: tuple[subprocess.Popen, plan.Step, int, float] | None = None

    def write() -> None:
        used = {"used": f"{time.time() - args.t0:.0f} s"}
        text = summary.render({**head, **used}, [outcomes[s.name] for s in plan.STEPS if s.name in outcomes])
        with open(os.path.join(args.out, summary.SUMMARY), "w") as f:
            f.write(text)

    def join() -> None:
        nonlocal background
        if background is None:
            return
        proc, step, seconds, started = background
        background = None
        done = finish(proc, step, seconds, started, args.out)
        notes = [chosen.notes[step.name]] if step.name in chosen.notes else []  # e.g. "added: kernels use ..."
        if gpu and done.status == "failed":  # no kernels of an earlier build may stand in for the ones that failed
            notes.append(f"removed {len(build.uninstall())} earlier csrc extension(s) from the package")
        installed = build.install(csrc=done.status != "failed") if gpu else []  # data helpers whatever happened
        if installed:
            notes.append(f"installed in place: {', '.join(os.path.basename(p).split('.')[0] for p in installed)}")
        note = "; ".join(notes)
        outcomes[step.name] = summary.Outcome(done.step, done.status, done.seconds,
                                              "; ".join(p for p in (done.detail, note) if p))
        write()

    for step in chosen.chosen:
        if not step.background and step.name in plan.USES_BUILD:
            join()
        remaining = budget - (time.time() - args.t0) if budget else float("inf")
        seconds, why = plan.step_timeout(step, remaining, gpu)
        if why:
            outcomes[step.name] = summary.Outcome(step.name, "skipped", None, why)
            write()
            continue
        what = step.what if gpu else "its CPU twin, or why it skips"
        print(f"> {step.name} (at most {seconds} s): {what}", flush=True)
        proc, started = start(step, seconds, gpu, args.out), time.monotonic()
        if step.background:
            background = (proc, step, seconds, started)
            continue
        outcomes[step.name] = finish(proc, step, seconds, started, args.out)
        print("  " + outcomes[step.name].line(), flush=True)
        write()
    join()
    write()
    with open(os.path.join(args.out, summary.SUMMARY)) as f:
        print(f.read(), end="")
    return 1 if any(o.status == "failed" for o in outcomes.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
