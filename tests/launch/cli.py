"""CLI ranks: pretrain_gpt.py as users run it (plain python, or torchrun for several processes), and its log's
losses."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.launch.env import LAUNCHER_VARS, PRETRAIN, REPO, clean_env, free_port
from tests.launch.processes import run_command

_LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ .*?\| lm loss: ([0-9.E+-]+)")


def pretrain_command(nproc: int, args: list[str], code: str | None = None, torchrun: bool | None = None) -> list[str]:
    """``python pretrain_gpt.py args`` (``code``: ``python -c code args``, a test program standing for it) on one
    process; for more (or with ``torchrun`` True), the same under torchrun on a free port."""
    program = ["-c", code] if code else [PRETRAIN]
    if not (nproc > 1 if torchrun is None else torchrun):
        return [sys.executable, *program, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
            str(free_port()), *program, *args]


def run_pretrain(nproc: int, args: list[str], timeout: float = 300.0, env: dict[str, str] | None = None,
                 check: bool = True, code: str | None = None, cwd: str = REPO,
                 torchrun: bool | None = None) -> subprocess.CompletedProcess:
    """``pretrain_command(nproc, args, code, torchrun)`` run to its end (at most ``timeout`` s: then killed with
    its workers, return code 124). Environment: ``clean_env``, a free MASTER_PORT for a process that is the one
    rank (a user's run has the default port to itself; tests share the host), then ``env`` (a launcher variable in
    it stays there, for such a process). ``check``: a non-zero exit raises AssertionError with the end of stderr."""
    cmd = pretrain_command(nproc, args, code, torchrun)
    alone = cmd[1] != "-m"  # without torchrun the process is the one rank
    extra = {"MASTER_PORT": str(free_port())} if alone else {}
    extra.update({k: v for k, v in (env or {}).items() if alone or k not in LAUNCHER_VARS})
    proc = run_command(cmd, timeout, env=clean_env(extra), cwd=cwd)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd[-len(args) - 1:])} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc


def losses(stdout: str) -> dict[int, float]:
    """iteration -> logged lm loss."""
    return {int(m.group(1)): float(m.group(2)) for m in _LOSS.finditer(stdout)}
