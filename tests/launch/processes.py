"""Process ranks and commands: a command run to its end or its timeout (then killed with its process group), and N
rank processes started in the background, each with its own pid and exit code (for signals and kill -9), never
outliving the test."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable

from tests.launch.env import REPO, clean_env, free_port, rank_env

TIMED_OUT = 124
"""The return code of a command killed at its timeout (coreutils timeout's)."""


def _kill(proc: subprocess.Popen, group: bool) -> None:
    """``proc`` (and with ``group`` whatever is left of its process group: torchrun's workers, mpirun's ranks)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if group:
            os.killpg(proc.pid, signal.SIGKILL)
        elif proc.poll() is None:
            proc.kill()


def run_command(cmd: list[str], timeout: float, env: dict[str, str] | None = None, cwd: str = REPO,
                log: str | None = None, own_group: bool = True) -> subprocess.CompletedProcess:
    """``cmd`` run to its end, for at most ``timeout`` seconds: then it is killed and its return code reads
    ``TIMED_OUT``. Output: stdout and stderr captured apart (text), or with ``log`` both appended to that file (the
    result's stdout is then the file's text). ``own_group``: the command leads its own process group, killed whole
    at the end (nothing it started outlives it); False keeps it in the caller's group (tests/gpu/quick: the step's
    own ``timeout`` reaches it) and kills only it."""
    f = open(log, "a") if log else None
    out = f if f else subprocess.PIPE
    try:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT if f else subprocess.PIPE,
                                text=True, errors="replace", start_new_session=own_group)
        try:
            stdout, stderr = proc.communicate(timeout=max(timeout, 1))
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            _kill(proc, own_group)
            try:
                stdout, stderr = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:  # a grandchild outside its group still holds the pipes
                _kill(proc, False)
                stdout, stderr = "", ""
            rc = TIMED_OUT
        finally:
            _kill(proc, own_group)
    finally:
        if f:
            f.close()
    if log:
        with open(log, errors="replace") as g:
            stdout, stderr = g.read(), ""
    return subprocess.CompletedProcess(cmd, rc, stdout, stderr)


def _one_process(rank: int, world: int, port: int) -> dict[str, str]:
    return {"MASTER_PORT": str(port)}


class Ranks:
    """The processes ``start_ranks`` started: ``ranks[r]`` is rank r's Popen. A ``with`` block kills any still
    running at its end."""

    def __init__(self, procs: list[subprocess.Popen], out_dir: str | None) -> None:
        self.procs, self.out_dir = procs, out_dir

    def __getitem__(self, rank: int) -> subprocess.Popen:
        return self.procs[rank]

    def __len__(self) -> int:
        return len(self.procs)

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def wait(self, timeout: float) -> list[int | None]:
        """Every rank's exit code, waiting at most ``timeout`` seconds in all; a rank still running then is
        killed and reads None."""
        deadline = time.monotonic() + timeout
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        self.kill()
        return codes

    def kill(self) -> None:
        for p in self.procs:
            _kill(p, False)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)

    def output(self, rank: int, stream: str = "out") -> str:
        """What rank ``rank`` wrote to stdout (``stream`` "out") or stderr ("err") so far (``out_dir`` only)."""
        with open(os.path.join(self.out_dir, f"rank{rank}.{stream}"), errors="replace") as f:
            return f.read()

    def wait_for_line(self, rank: int, pattern: str, stream: str = "out", timeout: float = 300.0) -> str:
        """The first line of rank ``rank``'s output matching the regex ``pattern``, polled while the ranks run."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for line in self.output(rank, stream).splitlines():
                if re.search(pattern, line):
                    return line
            if not self.running():
                break
            time.sleep(0.1)
        raise AssertionError(f"no line matching {pattern!r} in rank {rank}'s std{stream}:\n"
                             f"{self.output(rank, stream)[-3000:]}")


def start_ranks(world: int, cmd: list[str], out_dir: str | None = None, env: dict[str, str] | None = None,
                environ: dict[str, str] | None = None,
                rank_vars: Callable[[int, int, int], dict[str, str]] | None = None, cwd: str = REPO) -> Ranks:
    """``world`` processes of ``cmd``. Rank r's environment: ``environ`` (default ``clean_env()``), then
    ``rank_vars(r, world, port)`` (default: torchrun's, rendezvous on a free port; one process gets only the port,
    as a user's ``python pretrain_gpt.py``), then ``env``. Its stdout and stderr go to ``out_dir/rank{r}.out`` /
    ``.err``, or without ``out_dir`` to this process's."""
    base = clean_env() if environ is None else environ
    rank_vars = rank_vars or (rank_env if world > 1 else _one_process)
    port = free_port()
    procs = []
    try:
        for r in range(world):
            full = {**base, **rank_vars(r, world, port), **(env or {})}
            if out_dir is None:
                procs.append(subprocess.Popen(cmd, cwd=cwd, env=full))
                continue
            with open(os.path.join(out_dir, f"rank{r}.out"), "w") as out, \
                    open(os.path.join(out_dir, f"rank{r}.err"), "w") as err:
                procs.append(subprocess.Popen(cmd, cwd=cwd, env=full, stdout=out, stderr=err))
    except BaseException:
        Ranks(procs, out_dir).kill()
        raise
    return Ranks(procs, out_dir)
