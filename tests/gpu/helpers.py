"""What the GPU tests share: the CPU tests' argument lists made device-neutral, and loss comparisons.

The GPU tests start pretrain_gpt.py through the CPU tests' own launcher (tests/launch/: ``run_pretrain`` for
subprocesses, tests/checkpointing/common.py's helpers for function ranks), so the code path is the one the CPU suite
checks; only the process-group backend (the accelerator's own: NCCL/RCCL) and the kernel choice differ. The pure
logic here is checked on CPU by tests/unit/test_gpu_suite_helpers.py.
"""

from __future__ import annotations

import functools
import os

from tests.launch import free_port, losses, run_pretrain
from tests.models import TINY_GPT

# Measuring kernels picks the fastest backend per run from timings: two runs could pick different kernels and
# differ in the last bits. Comparisons pin the fixed preference; the default-backend test measures on purpose.
STATIC_KERNELS = {"MEGATRON_KERNEL_SELECT": "static"}
BF16_REL = 3e-2
"""Relative loss tolerance between a bf16/fp16 run and an fp32 reference after ITERS steps (8-bit mantissa); runs of
one dtype are compared over the whole trajectory instead (assert_same_trajectory)."""
ITERS = 30
# TINY_GPT at lr 1e-3 moves the loss by 1% in 10 steps; at 5e-3 over 30 steps it falls 6.26 -> 5.47 (fp32, CPU),
# smoothly (2e-2 overshoots first), so "it learned" and "it agrees" are both meaningful.
SCHEDULE = ["--lr", "5e-3", "--train-iters", str(ITERS)]


def device_args(args: list[str]) -> list[str]:
    """``args`` without ``--distributed-backend gloo``: on a GPU the backend is the accelerator's (NCCL/RCCL)."""
    out, skip = [], False
    for i, a in enumerate(args):
        if skip:
            skip = False
            continue
        if a == "--distributed-backend" and i + 1 < len(args) and args[i + 1] == "gloo":
            skip = True
            continue
        if a == "--distributed-backend=gloo":
            continue
        out.append(a)
    return out


@functools.lru_cache(maxsize=None)
def _run(nproc: int, args: tuple[str, ...], env: tuple[tuple[str, str], ...]) -> dict[int, float]:
    env = dict(env)
    if nproc == 1:  # torchrun picks its own port; a plain process takes MASTER_PORT (never a fixed default)
        env["MASTER_PORT"] = str(free_port())
    proc = run_pretrain(nproc, list(args), timeout=600, env=env)
    return losses(proc.stdout)


def train(extra: list[str], nproc: int = 1, env: dict | None = None) -> dict[int, float]:
    """iteration -> logged lm loss of pretrain_gpt.py on the TINY_GPT model for ITERS steps (cached per flag set).
    On CPU this gives the same numbers as on a GPU up to rounding (used to choose SCHEDULE and tolerances)."""
    env = dict(STATIC_KERNELS, **(env or {}))
    return _run(nproc, tuple(device_args(TINY_GPT) + SCHEDULE + extra), tuple(sorted(env.items())))


def _logged_and_learned(losses_: dict[int, float], who: str, at: int) -> None:
    assert sorted(losses_) == list(range(1, at + 1)), f"{who}: logged iterations {sorted(losses_)}"
    assert losses_[at] < 0.95 * losses_[1], f"{who} did not learn: {losses_}"


def assert_trains_like(got: dict[int, float], ref: dict[int, float], rel: float, name: str, at: int = ITERS) -> None:
    """``got`` logged every iteration up to ``at``, learned (its loss fell by 5%), and is within ``rel`` of ``ref``
    at iteration ``at``; the reference must have learned too, or agreement would prove little."""
    for losses_, who in ((got, name), (ref, "reference")):
        _logged_and_learned(losses_, who, at)
    assert abs(got[at] - ref[at]) <= rel * abs(ref[at]), f"{name}: loss {got[at]} vs reference {ref[at]} at {at}"


TRAJECTORY_FRACTION = 0.5
"""Two runs of one model in the same dtype (bf16 layouts) agree at every iteration within this fraction of the
reference's mean loss drop per iteration: 0.014 for SCHEDULE (6.26 -> 5.45 over 30 steps). Measured on CPU (bf16,
TINY_GPT, SCHEDULE, gloo): TP=2, TP=2 SP, PP=2, DP=2 ZeRO-1 and ZeRO-3 differ from one process by at most 0.0022 at any
iteration; a run one update behind differs by 0.07 on average, a constant 0.02 off fails too."""


def assert_same_trajectory(got: dict[int, float], ref: dict[int, float], name: str,
                           fraction: float = TRAJECTORY_FRACTION, at: int = ITERS) -> None:
    """Both logged every iteration up to ``at`` and learned; at every iteration ``got`` is within ``fraction`` of
    the reference's mean per-iteration loss drop of it (a tolerance from the run itself, not a fixed percentage)."""
    for losses_, who in ((got, name), (ref, "reference")):
        _logged_and_learned(losses_, who, at)
    tol = fraction * (ref[1] - ref[at]) / (at - 1)
    worst = max(range(1, at + 1), key=lambda i: abs(got[i] - ref[i]))
    assert abs(got[worst] - ref[worst]) <= tol, (
        f"{name}: loss {got[worst]} vs reference {ref[worst]} at iteration {worst}, more than {tol:.4f} apart "
        f"({fraction} of the reference's mean drop per iteration)")


def gpu_env() -> dict:
    return dict(os.environ, **STATIC_KERNELS)
