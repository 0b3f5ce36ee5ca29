"""quick.sh step ``train``: pretrain_gpt.py as a user runs it, straight for N iterations, then N/2 with a save and a
resume to N; the resumed losses against the straight run's, read exactly from TensorBoard (float32 scalars).

GPU: GPT-2 small (~124M), seq 1024, bf16, ZeRO-1, 30 iterations, kernels chosen by measurement (``auto``) once
and reused by the other two runs (MEGATRON_KERNEL_CACHE_DIR), cuBLAS' reduction order pinned
(CUBLAS_WORKSPACE_CONFIG); torch's deterministic-algorithms mode is not forced, so a resume that is not bit-exact
is reported with its largest difference and passes only within bf16 tolerance. CPU twin: the tests' TINY_GPT model,
8 iterations, the same three runs and checks (its tokens/s and MFU mean nothing).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys

from tests.models import TINY_GPT
from tests.gpu.quick.common import BENCH, REPO, StepArgs, TrainLog, env_with, run_logged, step_args, train_log
from tests.gpu.quick.summary import first_error_line
from tests.launch import free_port

GPU_MODEL = ["--model-size", "gpt2-small", "--seq-length", "1024", "--max-position-embeddings", "1024",
             "--micro-batch-size", "8", "--global-batch-size", "16", "--lr", "6e-4", "--lr-warmup-iters", "5"]
GPU_ITERS = 30
# TINY_GPT with 128 tokens at lr 1e-2 falls 4.89 -> 4.24 in 8 iterations (CPU, bf16): "it learned" checks there too.
CPU_MODEL = TINY_GPT + ["--vocab-size", "128", "--lr", "1e-2", "--lr-warmup-iters", "1"]
CPU_ITERS = 8
COMMON = ["--bf16", "--zero-stage", "1", "--mock-data", "--log-interval", "1", "--eval-iters", "0", "--seed", "1234",
          "--hidden-dropout", "0", "--attention-dropout", "0"]
LEARNED = 0.95
"""The last loss must be below this fraction of the first."""
RESUME_REL = 1e-2
"""Largest relative loss difference a resume that is not bit-exact may show (bf16; same flags, same kernels)."""
LOSS_TAG = "lm-loss-training/lm loss"
HAVE_TB = importlib.util.find_spec("tensorboard") is not None
"""Exact (float32) losses come from TensorBoard; without it the log's 7 printed digits are compared."""
CONDITIONS = ("torch deterministic mode off; CUBLAS_WORKSPACE_CONFIG=:4096:8; kernels measured by the straight run "
              "and reused (MEGATRON_KERNEL_CACHE_DIR); dropout 0")


def tb_losses(path: str) -> dict[int, float]:
    """iteration -> the float32 lm loss a run wrote to TensorBoard (exact, unlike the 7 printed digits)."""
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(path, size_guidance={ea.SCALARS: 0})
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(LOSS_TAG)} if LOSS_TAG in acc.Tags()["scalars"] else {}


def compare_resume(straight: dict[int, float], resumed: dict[int, float], half: int, iters: int,
                   exact: bool = True) -> tuple[bool, str]:
    """(passed, what) for the resumed run's losses against the straight run's at half+1..iters; ``exact``: they
    are TensorBoard's float32 values, else the log's 7 printed digits."""
    want = list(range(half + 1, iters + 1))
    if sorted(resumed) != want or not set(want) <= set(straight):
        return False, f"resumed run logged iterations {sorted(resumed)}, expected {want[0]}-{want[-1]}"
    if all(resumed[i] == straight[i] for i in want):
        what = "bit-exact (float32 losses" if exact else "equal to the 7 printed digits (no tensorboard here"
        return True, f"resume {want[0]}-{want[-1]} {what}; deterministic mode off)"
    worst = max(abs(resumed[i] - straight[i]) / abs(straight[i]) for i in want)
    ok = worst <= RESUME_REL
    verdict = "within" if ok else "beyond"
    return ok, f"resume {want[0]}-{want[-1]} NOT bit-exact: max rel diff {worst:.2e}, {verdict} bf16 tol {RESUME_REL}"


def kernel_choices(cache_dir: str) -> str:
    """e.g. "attention triton, norm torch" from the measurement cache the straight run wrote."""
    try:
        with open(os.path.join(cache_dir, "kernel_choices.json")) as f:
            sections = json.load(f)
    except (OSError, ValueError):
        return "none measured"
    chosen: dict[str, set[str]] = {}
    for section in sections.values():
        for key, hit in section.items():
            chosen.setdefault(key.split("|")[0], set()).add(hit.get("backend", "?"))
    return ", ".join(f"{op} {'/'.join(sorted(b))}" for op, b in sorted(chosen.items())) or "none measured"


def pretrain_runs(a: StepArgs, base: list[str], work: str, half: int) -> dict[str, tuple[TrainLog, dict]] | str:
    """name -> (log figures, TensorBoard losses) of the straight, first-half and resumed runs; or the first failure.
    The checkpoint between them is removed whatever happens (~1.7 GB at 124M with its optimizer states)."""
    ckpt, cache = os.path.join(work, "ckpt"), os.path.join(work, "kernel-cache")
    runs = {"straight": [], "first": ["--exit-interval", str(half), "--save", ckpt], "resumed": ["--load", ckpt]}
    done = {}
    try:
        for name, extra in runs.items():
            env = env_with(MEGATRON_KERNEL_CACHE_DIR=cache, CUBLAS_WORKSPACE_CONFIG=":4096:8",
                           MASTER_PORT=str(free_port()), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "4"))
            tb_dir = os.path.join(work, "tb", name)
            tb = ["--tensorboard-dir", tb_dir] if HAVE_TB else []
            cmd = [sys.executable, os.path.join(REPO, "pretrain_gpt.py"), *base, *extra, *tb]
            rc, text = run_logged(cmd, a.log(name), a.left(), env)
            if rc != 0:
                return f"{name} run exit {rc}: {first_error_line(text)}"
            figures = train_log(text)
            done[name] = (figures, tb_losses(tb_dir) if HAVE_TB else figures.losses)
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
    return done


def main(a: StepArgs) -> None:
    iters = GPU_ITERS if a.gpu else CPU_ITERS
    half = iters // 2
    # Checkpoints stay out of $OUT (whose files travel back from the device); QUICK_WORK lets a test use its tmp.
    work = os.path.join(os.environ.get("QUICK_WORK") or os.path.join(REPO, "build", "quick", "work"), "train")
    shutil.rmtree(work, ignore_errors=True)  # a stale checkpoint would be resumed by the first run
    base = (GPU_MODEL if a.gpu else CPU_MODEL) + COMMON + ["--train-iters", str(iters)]
    peak = "measured on this CPU (meaningless for a twin)"
    if a.gpu:
        sys.path.insert(0, BENCH)
        import gpu_env  # bench/ is no package; the device name needs the accelerator, so only on a GPU

        tflops, source = gpu_env.peak_tflops()
        base += ["--peak-tflops", str(tflops)]
        peak = f"{tflops} TFLOP/s ({source})"
    runs = pretrain_runs(a, base, work, half)
    if isinstance(runs, str):
        a.result("failed", runs)
        return

    s, straight, resumed = runs["straight"][0], runs["straight"][1], runs["resumed"][1]
    skip = iters // 3  # kernel measurement, Triton autotuning and the allocator's warm-up
    figures = dict(tokens_per_s=s.steady(s.tokens_per_s, skip), mfu_pct=s.steady(s.mfu, skip),
                   mem_gb=max(s.mem_gb.values(), default=float("nan")), mfu_peak=peak,
                   kernels=kernel_choices(os.path.join(work, "kernel-cache")), losses=straight, resumed=resumed,
                   resume_conditions=CONDITIONS)
    problems = []
    if sorted(s.losses) != list(range(1, iters + 1)):
        problems.append(f"straight run logged iterations {sorted(s.losses)}")
    elif not s.losses[iters] < LEARNED * s.losses[1]:
        problems.append(f"loss did not fall by 5%: {s.losses[1]:.4f} -> {s.losses[iters]:.4f}")
    first = runs["first"][0]
    if sorted(first.losses) != list(range(1, half + 1)):
        problems.append(f"first run (--exit-interval {half}) logged iterations {sorted(first.losses)}")
    ok, resume = compare_resume(straight, resumed, half, iters, HAVE_TB)
    if not ok:
        problems.append(resume)
    detail = (f"tokens/s {figures['tokens_per_s']:,.0f} (median of iterations {skip + 1}-{iters}); "
              f"MFU {figures['mfu_pct']:.1f}%; mem {figures['mem_gb']:.2f} GB; "
              f"loss {s.losses.get(1, float('nan')):.3f} -> {s.losses.get(iters, float('nan')):.3f}; "
              + (f"{resume}; " if ok else "") + f"kernels: {figures['kernels']}")
    if problems:  # what went wrong first: the summary's line for a failed step leads with it
        detail = "; ".join(problems) + " | " + detail
    a.result("failed" if problems else "passed", detail, **figures)

if __name__ == "__main__":
    main(step_args())
