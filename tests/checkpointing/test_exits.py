"""Clean exits and loss faults through pretrain_gpt.py subprocesses (1 process, tiny model, --mock-data):
SIGTERM/SIGUSR1 mid-run save and exit 0 and resume at the next iteration; --exit-duration-in-mins saves and
exits; a persistent NaN loss stops non-zero in one line without checkpointing the poisoned state; fp16
overflow is skipped by the dynamic loss scaler (DeepSpeed reports no fp16 on this CPU, so that test forces
the accelerator's fp16 flag on and uses ZeRO-1, whose optimizer applies the loss scale)."""

import os
import re
import signal
import subprocess
import sys

import pytest

from tests.functional.cli import REPO, TINY, run_pretrain
from tests.launcher import free_port

_ITER = re.compile(r"^ iteration\s+(\d+)/", re.M)
LONG = [a if a != "10" else "100000" for a in TINY]  # --train-iters 100000: only a stop request ends the run

FP16_ON_CPU = """
import sys
from deepspeed.accelerator import get_accelerator
type(get_accelerator()).is_fp16_supported = lambda self: True
import pretrain_gpt
from megatron.errors import run_cli
sys.exit(run_cli(pretrain_gpt.main, sys.argv[1:]))
"""


def _env() -> dict:
    # Prepended, not replaced: an offline GPU image finds deepspeed on PYTHONPATH (tests/gpu/run.sh).
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"):
        env.pop(k, None)
    env["MASTER_PORT"] = str(free_port())  # other runs on this host may hold the default 29500
    return env


def _run(args: list[str], **kw) -> subprocess.CompletedProcess:
    return run_pretrain(1, args, env={"MASTER_PORT": str(free_port())}, **kw)


def _iters(stdout: str) -> list[int]:
    return [int(i) for i in _ITER.findall(stdout)]


def _latest(save: str) -> str | None:
    path = os.path.join(save, "latest")
    return open(path).read().strip() if os.path.exists(path) else None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_signal_saves_exits_zero_and_resumes(tmp_path, sig):
    save = str(tmp_path)
    args = LONG + ["--save", save]
    with open(tmp_path / "stderr.txt", "w") as err:
        proc = subprocess.Popen([sys.executable, os.path.join(REPO, "pretrain_gpt.py"), *args], cwd=REPO,
                                env=_env(), text=True, stdout=subprocess.PIPE, stderr=err)
        lines = []
        for line in proc.stdout:  # signal once training is under way
            lines.append(line)
            if line.startswith(" iteration        2/"):
                proc.send_signal(sig)
                break
        rest, _ = proc.communicate(timeout=90)
    out = "".join(lines) + rest
    assert proc.returncode == 0, open(tmp_path / "stderr.txt").read()[-2000:]
    stopped = _iters(out)[-1]
    assert 2 <= stopped < 100000
    assert f"> exiting at iteration {stopped} after a checkpoint: signal" in out
    assert _latest(save) == f"global_step{stopped}"
    assert os.path.isdir(os.path.join(save, f"global_step{stopped}"))

    if sig != signal.SIGTERM:
        return  # one resume check is enough
    # Same flags plus --load; --exit-interval stops two iterations later.
    resumed = _run(args + ["--load", save, "--exit-interval", str(stopped + 2)], timeout=90).stdout
    assert _iters(resumed) == [stopped + 1, stopped + 2], resumed[-2000:]
    assert _latest(save) == f"global_step{stopped + 2}"


@pytest.mark.timeout(90)
def test_kill_switch_present_at_start_exits_before_training(tmp_path):
    kill = tmp_path / "STOP"
    kill.touch()
    out = _run(LONG + ["--save", str(tmp_path / "ckpt"), "--kill-switch-file", str(kill)], timeout=80).stdout
    assert f"> kill switch {kill} is present: exiting before training" in out and not _iters(out)
    assert not os.path.exists(tmp_path / "ckpt" / "latest")


@pytest.mark.timeout(90)
def test_exit_duration_saves_and_exits_cleanly(tmp_path):
    save = str(tmp_path)
    out = _run(LONG + ["--save", save, "--exit-duration-in-mins", "0.01"], timeout=80).stdout
    stopped = _iters(out)[-1]
    assert stopped < 100000
    assert f"> exiting at iteration {stopped} after a checkpoint: --exit-duration-in-mins 0.01" in out
    assert _latest(save) == f"global_step{stopped}"


@pytest.mark.timeout(90)
def test_persistent_nan_stops_nonzero_without_saving_it(tmp_path):
    save = str(tmp_path)
    # lr 1e30 without clipping or warmup: iteration 1's loss is finite, its update makes every later loss NaN.
    args = TINY + ["--lr", "1e30", "--clip-grad", "0", "--lr-warmup-iters", "0", "--save", save,
                   "--save-interval", "1"]
    proc = _run(args, timeout=80, check=False)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    logged = _iters(proc.stdout)
    assert re.fullmatch(rf"error: lm loss is NaN/Inf at iteration {logged[-1]} \(3 consecutive .*", last), last
    assert re.search(r"iteration\s+1/.*lm loss: \d", proc.stdout)  # the finite iteration 1
    assert len(re.findall(r"lm loss: (?:NAN|INF|-INF)", proc.stdout, re.I)) == 3
    assert _latest(save) == "global_step1"  # the last finite iteration; nothing later was written
    assert sorted(n for n in os.listdir(save) if n.startswith("global_step")) == ["global_step1"]


@pytest.mark.timeout(90)
def test_fp16_overflow_skips_steps_and_lowers_scale(tmp_path):
    # 2**40: every fp16 gradient overflows at first; the scaler halves the scale and skips the step.
    args = TINY + ["--train-iters", "4", "--fp16", "--initial-loss-scale", str(2**40), "--zero-stage", "1"]
    proc = subprocess.run([sys.executable, "-c", FP16_ON_CPU, *args], cwd=REPO, env=_env(), text=True,
                          capture_output=True, timeout=80)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = re.findall(r"iteration\s+(\d+)/.*?lm loss: ([0-9.E+-]+) \| loss scale: ([0-9.]+) .*?"
                      r"number of skipped iterations:\s+(\d+)", proc.stdout)
    assert [int(r[0]) for r in rows] == [1, 2, 3, 4]  # training went on to the end
    scales = [float(r[2]) for r in rows]
    assert sum(int(r[3]) for r in rows) > 0
    assert scales[-1] < scales[0] <= 2.0**40, scales
    assert all(float(r[1]) > 0 for r in rows)
