"""A Frontier-like place for the campaign tests: the stand-in Slurm on PATH, a fake interpreter that routes the
scripts' ``"$PYTHON" pretrain_gpt.py`` to tests/campaign/trainer.py, and a tiny GPT on 2 ranks in place of the
scripts' model (extra arguments of ``sbatch script ...`` go last on the trainer's command line)."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

from tests.campaign import fakeslurm
from tests.launch import free_port
from tests.models import CAMPAIGN_GPT

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "frontier" / "smoke_1node.sbatch"
FAKE_PYTHON = """#!/bin/bash
if [[ ${{1:-}} == pretrain_gpt.py ]]; then
    shift
    exec {python} {trainer} "$@"
fi
exec {python} "$@"
"""


NODE_CHANGE_ITERS = 12
NODE_CHANGE_ARGS = (*CAMPAIGN_GPT, "--hidden-dropout", "0", "--attention-dropout", "0")  # RNG restarts at another DP
NODE_CHANGE_ENV = {"FAKE_SRUN_RANKS": "", "FAKE_SRUN_RANKS_PER_NODE": "1", "ZERO_STAGE": "1", "PRECISION": "fp32"}
"""A campaign whose jobs change their node count: ranks follow nodes, and fp32 (in bf16 the end was 2e-5 off after
two DP changes: only the order of sums differs). tests/campaign/conftest.py's straight run is its reference."""


class Place:
    """One test's Slurm, machine and run folders under ``root``."""

    def __init__(self, root: Path, train_iters: int, **env: str) -> None:
        self.root = root
        self.state = root / "slurm"
        self.results = root / "results"
        self.runs = root / "runs"
        for d in (self.state, self.results, self.runs, root / "home", root / "bin"):
            d.mkdir(parents=True, exist_ok=True)
        fakeslurm.install(str(root / "bin"))
        python = root / "bin" / "python-for-jobs"
        python.write_text(FAKE_PYTHON.format(python=sys.executable, trainer=REPO / "tests" / "campaign" / "trainer.py"))
        python.chmod(0o755)
        self.env = {
            "PATH": f"{root / 'bin'}{os.pathsep}/usr/bin{os.pathsep}/bin", "HOME": str(root / "home"),
            "USER": "tester", "PYTHON": str(python), "FAKE_SLURM_DIR": str(self.state), "FAKE_SRUN_RANKS": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "MIOPEN_CACHE_ROOT": str(root / "miopen"), "SHOW_LAYOUT": "0", "TEST_RESULTS": str(self.results),
            "TP": "1", "PP": "1", "MBS": "1", "GBS": "4", "TRAIN_ITERS": str(train_iters),
        }
        for key in ("TORCH_EXTENSIONS_DIR", "PYTHONPATH", "LANG", "TMPDIR"):
            if os.environ.get(key):
                self.env[key] = os.environ[key]
        self.env.update(env)
        self.scheduler = fakeslurm.Scheduler(str(self.state))

    def sbatch(self, *opts: str, script: Path = SCRIPT, args: tuple[str, ...] = tuple(CAMPAIGN_GPT), **env: str) -> str:
        """Submit like a user at the repository root; returns the job id."""
        proc = subprocess.run([str(self.root / "bin" / "sbatch"), "--parsable", *opts, str(script), *args],
                              cwd=REPO, env={**self.env, **env}, capture_output=True, text=True, check=True)
        return proc.stdout.strip()

    def run(self, **kw) -> list[dict]:
        saved = os.environ.get("FAKE_SLURM_DIR")
        try:
            return self.scheduler.run(**kw)
        finally:
            if saved is None:
                os.environ.pop("FAKE_SLURM_DIR", None)
            else:
                os.environ["FAKE_SLURM_DIR"] = saved

    def jobs(self) -> list[dict]:
        os.environ["FAKE_SLURM_DIR"] = str(self.state)
        return fakeslurm.all_jobs()

    def calls(self, cmd: str) -> list[dict]:
        os.environ["FAKE_SLURM_DIR"] = str(self.state)
        return fakeslurm.calls(cmd)

    def result(self, job_id: str, rank: int = 0) -> dict | None:
        path = self.results / f"{job_id}.rank{rank}.json"
        if not path.exists():
            return None
        got = json.loads(path.read_text())
        got["losses"] = {int(k): v for k, v in got["losses"].items()}
        got["valid_losses"] = {int(k): v for k, v in got.get("valid_losses", {}).items()}
        return got


def non_loopback_ip() -> str | None:
    """An IPv4 address of this machine other than loopback: rank 0's address for a job of several fake nodes (the
    rendezvous rightly refuses loopback when the job spans nodes, and the fake node names resolve to nothing)."""
    try:
        words = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=10).stdout.split()
    except (OSError, subprocess.SubprocessError):
        words = []
    for word in words:
        try:
            addr = ipaddress.ip_address(word)
        except ValueError:
            continue
        if addr.version == 4 and not addr.is_loopback:
            return word
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
            addr = s.getsockname()[0]
        return None if ipaddress.ip_address(addr).is_loopback else addr
    except OSError:
        return None


def log_of(job: dict) -> str:
    return Path(job["log"]).read_text(errors="replace") if job.get("log") else ""


ITERATION = re.compile(r"^ iteration\s+(\d+)/", re.M)


def iterations_logged(text: str) -> list[int]:
    return [int(i) for i in ITERATION.findall(text)]
