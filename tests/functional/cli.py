"""Run pretrain_gpt.py as users do (python or torchrun subprocesses) and parse its log."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.launcher import free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ .*?\| lm loss: ([0-9.E+-]+)")

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "10", "--lr", "1e-3",
        "--mock-data", "--vocab-size", "500", "--log-interval", "1", "--eval-iters", "0",
        "--use-cpu-initialization", "--hidden-dropout", "0", "--attention-dropout", "0"]


def run_pretrain(nproc: int, args: list[str], timeout: float = 300.0, env: dict | None = None,
                 check: bool = True) -> subprocess.CompletedProcess:
    """``nproc`` == 1 runs plain python; more uses torchrun on a free port."""
    script = os.path.join(REPO, "pretrain_gpt.py")
    if nproc == 1:
        cmd = [sys.executable, script, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-port", str(free_port()), script, *args]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        if nproc > 1 or k not in (env or {}):
            full_env.pop(k, None)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=full_env)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd[-len(args) - 1:])} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc


def losses(stdout: str) -> dict[int, float]:
    """iteration -> logged lm loss."""
    return {int(m.group(1)): float(m.group(2)) for m in _LOSS.finditer(stdout)}
