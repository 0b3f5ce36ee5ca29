"""Run a function on N local processes (gloo), collect what each returns, never hang.

Each rank gets the torchrun-style environment, so the project's own rank discovery is exercised.
Results travel through files (torch.save), so a rank that aborts at exit after writing its result
is still judged by what it computed (see FRONTIER.md on rare gloo teardown aborts).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import socket
import tempfile
import traceback

import torch


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


def _entry(fn, rank: int, world: int, port: int, out_dir: str, kwargs: dict) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        result = fn(**kwargs)
        torch.save({"ok": True, "result": result}, path)
    except BaseException:  # report every failure to the parent, which raises it
        torch.save({"ok": False, "error": traceback.format_exc()}, path)
    finally:
        from megatron.initialize import shutdown

        try:
            shutdown()
        except Exception:
            pass


def run_distributed(fn, world_size: int, timeout: float = 300.0, **kwargs) -> list:
    """Run ``fn(**kwargs)`` on ``world_size`` spawned ranks; return the list of per-rank results."""
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, out_dir, kwargs)) for r in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        hung = [i for i, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
        results = []
        for r in range(world_size):
            path = os.path.join(out_dir, f"rank{r}.pt")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {r} wrote no result (exit code {procs[r].exitcode}, hung ranks {hung})")
            rec = torch.load(path, weights_only=False)
            if not rec["ok"]:
                raise RuntimeError(f"rank {r} failed:\n{rec['error']}")
            results.append(rec["result"])
        return results
