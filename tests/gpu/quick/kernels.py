"""quick.sh step ``kernels``: the kernels against float64, forward and backward, through the test suites' own cases.

GPU: tests/gpu/test_triton_kernels.py at bf16 (attention at seq 2048, head dim 64 and 128, causal or not; every
norm shape; the kernel seam), zero-bubble H1's deferred weight gradient against F.linear bit for bit
(tests/gpu/test_weight_grad_store_gpu.py: what exact ZB-H1's bit-identity needs), then tests/gpu/test_hip_kernels.py
(the csrc kernels built by step ``build``: on NVIDIA through csrc/common/wave64.h). CPU twin: tests/unit/kernels'
Triton tests under TRITON_INTERPRET=1, the store's unit cases, and the csrc kernels on the CPU emulator in the nvcc
(two-warp) mode. Each case's worst error over its tolerance comes from
the tests' JUnit properties (``err_over_tol``).
"""

from __future__ import annotations

import os

from tests.gpu.quick.common import Case, StepArgs, count, env_with, pytest_cases, step_args

GPU_PARTS = {
    "triton": ["tests/gpu/test_triton_kernels.py", "-k", "(test_attention_matches_float64 and 2048 and bfloat16) or "
               "(test_norms_match_float64 and bfloat16) or test_seam"],
    "deferred": ["tests/gpu/test_weight_grad_store_gpu.py"],
    "csrc": ["tests/gpu/test_hip_kernels.py"],
}
CPU_PARTS = {
    "triton": ["tests/unit/kernels/test_triton_attention.py", "tests/unit/kernels/test_triton_norms.py"],
    "deferred": ["tests/unit/test_weight_grad_store.py", "-k", "bit_for_bit"],
    "csrc": ["tests/unit/kernels/test_hip_emulated.py", "-k", "two_warps"],
}
SHARE = {"triton": 0.5, "deferred": 0.2, "csrc": 1.0}
"""Fraction of the time left that each part may take (the last takes the rest)."""


def describe(name: str, cases: list[Case]) -> str:
    """e.g. "triton 14 passed (worst 0.31 of tolerance)", plus the first failure's test and message."""
    ratios = [float(c.props["err_over_tol"]) for c in cases if "err_over_tol" in c.props]
    text = f"{name} {count(cases)}" + (f" (worst {max(ratios):.2g} of tolerance)" if ratios else "")
    failed = [c for c in cases if c.outcome == "failed"]
    if failed:
        text += f"; first failure {failed[0].name.split('::')[-1]}: {failed[0].message}"
    elif cases and all(c.outcome == "skipped" for c in cases):
        text += f" ({cases[0].message})"
    return text


def main(a: StepArgs) -> None:
    parts = GPU_PARTS if a.gpu else CPU_PARTS
    details, figures, failed, ran = [], {}, False, False
    for name, args in parts.items():
        try:
            cases = pytest_cases(args, os.path.join(a.out, f"kernels-{name}.xml"), a.log(name),
                                 a.left() * SHARE[name], env_with())
        except RuntimeError as e:
            details.append(f"{name}: {e}")
            failed = True
            continue
        details.append(describe(name, cases))
        figures[name] = {c.name: {"outcome": c.outcome, **c.props} for c in cases}
        failed = failed or any(c.outcome == "failed" for c in cases)
        ran = ran or any(c.outcome == "passed" for c in cases)
        a.result("failed" if failed else "passed", "; ".join(details), **figures)  # kept if the next part is cut
    status = "failed" if failed or not ran else "passed"
    a.result(status, "; ".join(details) if ran or failed else "no case ran: " + "; ".join(details), **figures)


if __name__ == "__main__":
    main(step_args())
