"""tests/gpu/quick.sh on CPU: its step selection, budget and timeouts, the summary file's format (every step has an
outcome: passed / failed with the first error line / skipped with why), the early stop without .whl/, and one real
CPU twin (train: three tiny pretrain_gpt.py runs, save and exact resume) through the script itself."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.gpu.quick import plan, summary
from tests.gpu.quick import __main__ as orchestrator

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NAMES = [s.name for s in plan.STEPS]


def test_plan_picks_named_steps_in_run_order_and_the_build_on_a_gpu():
    every = plan.plan([], gpu=True)
    assert [s.name for s in every.chosen] == NAMES and not every.notes
    two = plan.plan(["speed", "train"], gpu=False)
    assert [s.name for s in two.chosen] == ["train", "speed"]
    assert {n for n, why in two.notes.items() if why == "not named"} == set(NAMES) - {"train", "speed"}
    on_gpu = plan.plan(["kernels"], gpu=True)
    assert [s.name for s in on_gpu.chosen] == ["build", "kernels"] and "kernels" in on_gpu.notes["build"]
    assert [s.name for s in plan.plan(["train"], gpu=True).chosen] == ["train"]  # train needs no build
    with pytest.raises(plan.PlanError, match="unknown step trian: choose from build train kernels"):
        plan.plan(["trian"], gpu=False)


def test_step_timeout_is_its_own_limit_lowered_to_the_budget_left():
    train = plan.BY_NAME["train"]
    assert plan.step_timeout(train, 1000, gpu=True) == (train.gpu_s, None)
    assert plan.step_timeout(train, train.min_s + 5.4, gpu=True) == (train.min_s + 5, None)
    assert plan.step_timeout(train, 1000, gpu=False) == (plan.CPU_STEP_S, None)
    seconds, why = plan.step_timeout(train, train.min_s - 1, gpu=True)
    assert seconds == 0 and why == f"budget: {train.min_s - 1} s left, it needs at least {train.min_s} s"
    assert plan.step_timeout(train, 5, gpu=False) == (5, None)  # min_s is a GPU figure
    assert plan.step_timeout(train, 0.5, gpu=False) == (0, "budget: 0 s left, it needs at least 1 s")


def test_first_error_line_prefers_pytest_failures_then_exceptions():
    pytest_log = "collected 3\nE   assert 2 <= 1\nFAILED tests/x.py::test_a - AssertionError: o: 0.2 > 0.01\n"
    assert summary.first_error_line(pytest_log) == "FAILED tests/x.py::test_a - AssertionError: o: 0.2 > 0.01"
    assert summary.first_error_line("x\nE   assert 2 <= 1\nE   more\n") == "E   assert 2 <= 1"
    trace = "> start\nTraceback (most recent call last):\n  File \"a.py\"\ntorch.OutOfMemoryError: CUDA out of memory\n"
    assert summary.first_error_line(trace) == "torch.OutOfMemoryError: CUDA out of memory"
    assert summary.first_error_line("ok\nerror: --bf16 and --fp16: pick one\n") == "error: --bf16 and --fp16: pick one"
    assert summary.first_error_line("just stopped\n\n") == "just stopped"


def _step(out, step: str, rc: int, log: str = "", result: tuple | None = None) -> summary.Outcome:
    with open(summary.log_path(str(out), step), "w") as f:
        f.write(log)
    if result is not None:
        summary.write_result(str(out), step, *result)
    return summary.judge(str(out), step, rc, 12.3, 90)


def test_judge_turns_exit_status_result_and_log_into_one_outcome(tmp_path):
    assert _step(tmp_path, "a", 0, result=("passed", "tokens/s 1,000")) == summary.Outcome("a", "passed", 12.3,
                                                                                           "tokens/s 1,000")
    assert _step(tmp_path, "b", 124, result=("passed", "triton 4 passed")) == summary.Outcome(
        "b", "failed", 12.3, "timed out after 90 s; before that: triton 4 passed")
    assert _step(tmp_path, "c", 137).detail == "timed out after 90 s"
    assert _step(tmp_path, "d", 1, "Traceback\nRuntimeError: boom\n").detail == "exit 1: RuntimeError: boom"
    assert _step(tmp_path, "e", 0).detail == "exited 0 but wrote no result"
    assert _step(tmp_path, "f", 0, result=("skipped", "needs a GPU")) == summary.Outcome("f", "skipped", None,
                                                                                        "needs a GPU")
    late = _step(tmp_path, "g", 1, "ValueError: at exit\n", result=("passed", "x"))
    assert late.status == "failed" and late.detail == "exit 1 after reporting passed: ValueError: at exit"
    with pytest.raises(ValueError, match="status 'fine'"):
        summary.write_result(str(tmp_path), "h", "fine", "x")


def test_summary_renders_one_line_per_step_and_parses_back():
    outcomes = [summary.Outcome("train", "passed", 80.4, "tokens/s 9\nMFU 1%"),
                summary.Outcome("kernels", "failed", 3.0, "x" * 1000), summary.Outcome("speed", "skipped", None, "")]
    text = summary.render({"date": "today", "device": "H100\n80GB"}, outcomes)
    assert text.splitlines()[1:4] == ["date: today", "device: H100 80GB", ""]
    assert text.splitlines()[4] == "train: passed (80 s) | tokens/s 9 MFU 1%"
    header, back = summary.parse(text)
    assert header == {"date": "today", "device": "H100 80GB"}
    assert [(o.step, o.status, o.seconds) for o in back] == [("train", "passed", 80.0), ("kernels", "failed", 3.0),
                                                             ("speed", "skipped", None)]
    assert back[1].detail.endswith("...") and len(back[1].line()) < 450
    with pytest.raises(ValueError, match="not a step line"):
        summary.parse(text + "train: fine\n")


def test_resume_comparison_says_bit_exact_within_tolerance_or_beyond():
    from tests.gpu.quick.train import RESUME_REL, compare_resume

    straight = {i: 10.0 - 0.1 * i for i in range(1, 7)}
    assert compare_resume(straight, {i: straight[i] for i in (4, 5, 6)}, 3, 6) == (
        True, "resume 4-6 bit-exact (float32 losses; deterministic mode off)")
    assert compare_resume(straight, {i: straight[i] for i in (4, 5, 6)}, 3, 6, exact=False)[1].startswith(
        "resume 4-6 equal to the 7 printed digits")
    last_bit = {4: straight[4], 5: straight[5] + 1e-6, 6: straight[6]}  # any difference is "not bit-exact"
    assert compare_resume(straight, last_bit, 3, 6)[1].startswith("resume 4-6 NOT bit-exact: max rel diff 1.05e-07")
    near = {i: straight[i] * (1 + RESUME_REL / 2) for i in (4, 5, 6)}
    ok, what = compare_resume(straight, near, 3, 6)
    assert ok and "NOT bit-exact: max rel diff 5.00e-03, within bf16 tol" in what
    far = {**near, 6: straight[6] * (1 + 2 * RESUME_REL)}
    assert compare_resume(straight, far, 3, 6)[0] is False
    ok, what = compare_resume(straight, {4: straight[4], 6: straight[6]}, 3, 6)
    assert not ok and what == "resumed run logged iterations [4, 6], expected 4-6"


def test_kernel_and_speed_lines_carry_counts_errors_ratios_and_goals():
    from tests.gpu.quick.common import Case
    from tests.gpu.quick.kernels import describe as kernels_line
    from tests.gpu.quick.speed import describe as speed_line

    cases = [Case("m::test_a[bf16]", "passed", "", {"err_over_tol": "0.25"}),
             Case("m::test_b[bf16]", "failed", "AssertionError: dq: relative error 2e-02 > tolerance 1e-02",
                  {"err_over_tol": "2"}), Case("m::test_c", "skipped", "not built", {})]
    assert kernels_line("triton", cases) == ("triton 1 passed, 1 failed, 1 skipped (worst 2 of tolerance); first "
                                             "failure test_b[bf16]: AssertionError: dq: relative error 2e-02 > "
                                             "tolerance 1e-02")
    assert kernels_line("csrc", cases[2:]) == "csrc 1 skipped (not built)"
    results = {"ours auto": {"tokens_per_s": 110.0, "peak_mem_gb": 30.0},
               "ours torch kernels": {"tokens_per_s": 120.0, "peak_mem_gb": 31.0},
               "HF + torch.compile": {"tokens_per_s": 100.0, "peak_mem_gb": 40.0}, "HF eager": {"error": "exit 1"}}
    mfu = {"ours auto": 41.0, "ours torch kernels": 44.7, "HF + torch.compile": 37.3}
    line = speed_line(results, mfu, gpu=True)
    assert "ours auto 110 tok/s, MFU 41.0%, 30.0 GB" in line and "HF eager FAILED: exit 1" in line
    assert "ours auto / HF + torch.compile 1.10x (goal >= 1.10: met)" in line
    assert "ours auto / ours torch kernels 0.92x (goal >= 1.00: NOT met)" in line
    assert "(goal >= 1.10: not judged on CPU)" in speed_line(results, mfu, gpu=False)


def test_orchestrator_times_out_a_step_skips_what_the_budget_cannot_hold_and_records_all(tmp_path, monkeypatch,
                                                                                        capsys):
    """The real orchestrator with stand-in step processes: train overruns its (budget-lowered) timeout and is
    killed, kernels then has no budget left, the rest were not named; exit status 1."""
    monkeypatch.setattr(orchestrator, "probe", lambda out: {"gpu": False, "device": "none", "device_short": "cpu",
                                                            "versions": {"python": "3"}})
    started = []

    def fake_start(step, seconds, gpu, out):
        started.append((step.name, seconds))
        with open(summary.log_path(out, step.name), "w") as log:
            return subprocess.Popen(["timeout", "-k", "1", str(seconds), sys.executable, "-c",
                                     "import time; time.sleep(60)"], stdout=log, stderr=subprocess.STDOUT)

    monkeypatch.setattr(orchestrator, "start", fake_start)
    t0 = time.time()
    # train gets what is left of 4 s (3, or 2 on a loaded machine), overruns it; kernels is left less than 1 s.
    rc = orchestrator.main(["--out", str(tmp_path), "--budget", "4", "--t0", str(t0), "train", "kernels"])
    assert rc == 1 and [n for n, _ in started] == ["train"] and started[0][1] in (2, 3) and time.time() - t0 < 30
    with open(tmp_path / summary.SUMMARY) as f:
        header, outcomes = summary.parse(f.read())
    assert {"date", "device", "mode", "versions", "budget", "used", "record as"} <= set(header)
    by = {o.step: o for o in outcomes}
    assert [o.step for o in outcomes] == NAMES  # every step has an outcome, in run order
    assert by["train"].status == "failed" and by["train"].detail == f"timed out after {started[0][1]} s"
    assert by["kernels"].status == "skipped" and by["kernels"].detail.startswith("budget: ")
    assert all(by[n].detail == "not named" for n in NAMES if n not in ("train", "kernels"))
    assert "summary" in capsys.readouterr().out


def test_orchestrator_refuses_an_unknown_step_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(orchestrator, "probe", lambda out: {"gpu": False, "device": "none", "device_short": "cpu",
                                                            "versions": {}})
    assert orchestrator.main(["--out", str(tmp_path), "speeed"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: unknown step speeed: choose from {' '.join(NAMES)}"]


def test_quick_sh_stops_at_once_without_wheels_on_a_gpu_python(tmp_path):
    """A python3 whose torch is a GPU build but which has no deepspeed, and no .whl/: one line, status 2, and the
    line in summary.txt. (quick.sh and its helper copied into an empty tree: no .venv, no .whl there.)"""
    root = tmp_path / "tree"
    (root / "tests" / "gpu").mkdir(parents=True)
    for name in ("quick.sh", "gpu_python.sh"):
        (root / "tests" / "gpu" / name).write_text(open(os.path.join(REPO, "tests", "gpu", name)).read())
    fake = tmp_path / "bin"
    fake.mkdir()
    # Answers the GPU-torch check yes and everything else (import deepspeed) no.
    (fake / "python3").write_text("#!/bin/sh\ncase \"$2\" in *torch.version*) exit 0;; esac\nexit 1\n")
    (fake / "python3").chmod(0o755)
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(root / "tests" / "gpu" / "quick.sh")], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}", OUT=str(out)))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: python3 has a GPU torch but no deepspeed, and .whl/ holds")
    assert (out / summary.SUMMARY).read_text().strip() == lines[0]


def test_quick_sh_on_cpu_runs_the_train_twin_and_reports_every_step(tmp_path):
    """The script itself, no GPU: `quick.sh train` runs the CPU twin (straight, save at the half, exact resume) and
    the summary names device, date and versions, and gives every step an outcome; exit 0."""
    out = tmp_path / "out"
    proc = subprocess.run(["bash", os.path.join(REPO, "tests", "gpu", "quick.sh"), "train"], capture_output=True,
                          text=True, timeout=600, cwd=tmp_path,
                          env=dict(os.environ, OUT=str(out), QUICK_WORK=str(tmp_path / "work")))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    header, outcomes = summary.parse((out / summary.SUMMARY).read_text())
    assert header["mode"].startswith("cpu: no GPU visible") and "torch" in header["versions"] and header["date"]
    by = {o.step: o for o in outcomes}
    assert [o.step for o in outcomes] == NAMES
    assert by["train"].status == "passed", by["train"]
    assert "resume 5-8 bit-exact" in by["train"].detail and "tokens/s" in by["train"].detail
    assert all(by[n].status == "skipped" and by[n].detail == "not named" for n in NAMES if n != "train")
    assert {"train-straight.log", "train-first.log", "train-resumed.log", "train.json"} <= set(os.listdir(out))
    assert not (tmp_path / "work" / "train" / "ckpt").exists()  # on a GPU 1.7 GB: not left on the machine
