"""Ports and environments for the ranks tests start: a free port, torchrun's variables for one rank, and a child's
environment without the launching process's own rank variables."""

from __future__ import annotations

import os
import random
import socket

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRETRAIN = os.path.join(REPO, "pretrain_gpt.py")
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
                 "NODE_RANK", "TORCHELASTIC_RUN_ID")
"""What torchrun sets; a child must not inherit the launching process's values."""
MPI_AND_SLURM = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "MPI_")
"""Prefixes of the other launchers' rank variables (megatron/topology.py discover_ranks reads them)."""


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A free port below the kernel's ephemeral range: a port the kernel hands out (bind to 0) can be taken by
    any outgoing connection (heartbeats, gloo) before a test that reserved it listens on it, which happened."""
    hi = _ephemeral_start()
    lo = max(1024, hi - 12000)
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(lo, hi)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # everything below is taken: fall back to the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    """torchrun's variables for rank ``rank`` of ``world`` on this host, rendezvous at 127.0.0.1:``port``."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def clean_env(extra: dict[str, str] | None = None, drop: tuple[str, ...] = ()) -> dict[str, str]:
    """This process's environment for a child: no launcher rank variable (nor any starting with a prefix in
    ``drop``), one thread per op, the repository first on PYTHONPATH (prepended: an offline GPU image finds
    deepspeed there, tests/gpu/run.sh); then ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and not (drop and k.startswith(drop))}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    env.update(extra or {})
    return env
