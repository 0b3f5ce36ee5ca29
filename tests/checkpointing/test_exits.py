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

from tests.launch import PRETRAIN, run_pretrain, start_ranks
from tests.models import TINY_GPT, replaced

_ITER = re.compile(r"^ iteration\s+(\d+)/", re.M)
LONG = replaced(TINY_GPT, {"--train-iters": "100000"})  # only a stop request ends the run

FP16_ON_CPU = """
import sys
from deepspeed.accelerator import get_accelerator
type(get_accelerator()).is_fp16_supported = lambda self: True
import pretrain_gpt
from megatron.errors import run_cli
sys.exit(run_cli(pretrain_gpt.main, sys.argv[1:]))
"""


def _run(args: list[str], **kw) -> subprocess.CompletedProcess:
    return run_pretrain(1, args, **kw)


def _iters(stdout: str) -> list[int]:
    return [int(i) for i in _ITER.findall(stdout)]


def _latest(save: str) -> str | None:
    path = os.path.join(save, "latest")
    return open(path).read().strip() if os.path.exists(path) else None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_signal_saves_exits_zero_and_resumes(tmp_path, sig):
    save = str(tmp_path / "ckpt")
    args = LONG + ["--save", save]
    with start_ranks(1, [sys.executable, PRETRAIN, *args], str(tmp_path)) as run:
        run.wait_for_line(0, r"^ iteration        2/")  # signal once training is under way
        run[0].send_signal(sig)
        code, = run.wait(90)
    out = run.output(0)
    assert code == 0, run.output(0, "err")[-2000:]
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
    args = TINY_GPT + ["--lr", "1e30", "--clip-grad", "0", "--lr-warmup-iters", "0", "--save", save,
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
    args = TINY_GPT + ["--train-iters", "4", "--fp16", "--initial-loss-scale", str(2**40), "--zero-stage", "1"]
    proc = _run(args, code=FP16_ON_CPU, timeout=80, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = re.findall(r"iteration\s+(\d+)/.*?lm loss: ([0-9.E+-]+) \| loss scale: ([0-9.]+) .*?"
                      r"number of skipped iterations:\s+(\d+)", proc.stdout)
    assert [int(r[0]) for r in rows] == [1, 2, 3, 4]  # training went on to the end
    scales = [float(r[2]) for r in rows]
    assert sum(int(r[3]) for r in rows) > 0
    assert scales[-1] < scales[0] <= 2.0**40, scales
    assert all(float(r[1]) > 0 for r in rows)
