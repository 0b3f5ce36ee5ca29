"""quick.sh's item-4 steps that reuse tests/gpu and bench/ as they are: ``variants`` (pretrain variants against their
references), ``kbench`` (bench/gpu_kernels.py --quick) and ``suite`` (the rest of tests/gpu on one GPU).

They need a GPU; on CPU each is skipped, naming the CPU tests that cover the same code.
"""

from __future__ import annotations

import os
import sys

from tests.gpu.quick.common import BENCH, StepArgs, count, env_with, pytest_cases, run_logged, step_args
from tests.gpu.quick.summary import first_error_line

VARIANTS = [f"tests/gpu/test_pretrain_gpu.py::{t}" for t in (
    "test_bf16_zero_stages_match_fp32_reference[3]", "test_fp16_zero1_matches_fp32_reference",
    "test_recompute_matches_no_recompute[full]", "test_llama_variant_matches_its_fp32_reference")]
CPU_SKIP = {
    "variants": "tests/gpu skips without a GPU; the same flag sets run on CPU in tests/functional and "
                "tests/checkpointing (ZeRO stages, fp16, recompute, Llama against single-process references)",
    "kbench": "bench/gpu_kernels.py needs a GPU; tests/unit/test_gpu_bench.py runs its loops on CPU with a "
              "stand-in timer",
    "suite": "tests/gpu skips without a GPU (tests/unit/test_gpu_suite_helpers.py checks that it does)",
}


def pytest_step(a: StepArgs, args: list[str]) -> None:
    try:
        cases = pytest_cases(args, os.path.join(a.out, f"{a.step}.xml"), a.log("pytest"), a.left(), env_with())
    except RuntimeError as e:
        a.result("failed", str(e))
        return
    failed = [c for c in cases if c.outcome == "failed"]
    detail = count(cases) + (f"; first failure {failed[0].name.split('::')[-1]}: {failed[0].message}" if failed
                             else "")
    status = "failed" if failed or not any(c.outcome == "passed" for c in cases) else "passed"
    a.result(status, detail, cases={c.name: c.outcome for c in cases})


def kbench(a: StepArgs) -> None:
    md = os.path.join(a.out, "kbench.md")
    cmd = [sys.executable, os.path.join(BENCH, "gpu_kernels.py"), "--quick", "--reps", "10", "--out", md]
    rc, text = run_logged(cmd, a.log("bench"), a.left(), env_with())
    if rc != 0:
        a.result("failed", f"bench/gpu_kernels.py exit {rc}: {first_error_line(text)}")
        return
    # | op | shape | backend | fwd ms | fwd+bwd ms | rate | vs torch | max diff | auto keeps |
    with open(md) as f:
        rows = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in f if ln.startswith("| ")]
    rows = [r for r in rows if len(r) == 9 and r[0] != "op"]
    keeps = {}
    for op, shape, backend, *_, vs_torch, _diff, auto in rows:
        if backend == auto:
            keeps[f"{op} {shape}"] = f"{auto} {vs_torch}"
    a.result("passed", "auto keeps (fwd+bwd vs torch): " + "; ".join(f"{k}: {v}" for k, v in keeps.items()),
             table=md)


def main(a: StepArgs) -> None:
    if not a.gpu:
        a.result("skipped", CPU_SKIP[a.step])
    elif a.step == "variants":
        pytest_step(a, VARIANTS)
    elif a.step == "kbench":
        kbench(a)
    else:
        pytest_step(a, ["tests/gpu"])


if __name__ == "__main__":
    main(step_args())
