"""Function ranks: ``fn`` on N local processes (gloo) forked from a forkserver, each with torchrun's environment (so
the project's own rank discovery runs); what each returns, or how each ended; never a hang.

Results travel through files (torch.save), so a rank that aborts at exit after writing its result is still judged
by what it computed (see FRONTIER.md on rare gloo teardown aborts).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass

from tests.launch.env import free_port, rank_env

# The ranks are forked from a forkserver that imported these once (per pytest process), instead of each spawned rank
# importing torch, DeepSpeed and the trainer again (~2 s of CPU per rank, hundreds of ranks per suite run). The
# server imports only: it runs no torch op, so no OpenMP pool exists to be forked. torch._dynamo: torch's optimizers
# import it at construction (~1 s of CPU per rank otherwise); it starts no thread.
_PRELOAD = ["torch", "torch._dynamo", "deepspeed", "deepspeed.comm", "megatron.engine", "megatron.training.pretrain",
            "megatron.model.gpt_model_pipe", "megatron.checkpointing.checkpointer"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # takes effect when the server starts (the first launch)
    return ctx


def _entry(fn, rank: int, world: int, port: int, out_dir: str, kwargs: dict, env: dict) -> None:
    import torch

    os.environ.clear()  # the launching process's environment now, as a spawned rank would inherit it (the
    os.environ.update(env)  # forkserver's is that of its start)
    os.environ.update(rank_env(rank, world, port), OMP_NUM_THREADS="1")
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


def _load(path: str) -> dict:
    import torch

    return torch.load(path, weights_only=False) if os.path.exists(path) else {}


def _start(entry, fn, world_size: int, out_dir: str, kwargs: dict, env: dict[str, str] | None) -> list:
    """``world_size`` ranks running ``entry(fn, rank, ...)`` from the forkserver, on one fresh rendezvous port, with the
    launching process's environment plus ``env``."""
    ctx, port, environ = _context(), free_port(), {**os.environ, **(env or {})}
    procs = [ctx.Process(target=entry, args=(fn, r, world_size, port, out_dir, kwargs, environ))
             for r in range(world_size)]
    for p in procs:
        p.start()
    return procs


def run_distributed(fn, world_size: int, timeout: float = 300.0, env: dict[str, str] | None = None, **kwargs) -> list:
    """Run ``fn(**kwargs)`` on ``world_size`` fresh ranks; return the per-rank results (a rank's failure raises).
    ``env``: variables added to the ranks' environment (e.g. MEGATRON_FAULT)."""
    with tempfile.TemporaryDirectory() as out_dir:
        procs = _start(_entry, fn, world_size, out_dir, kwargs, env)
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [i for i, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        results = []
        for r in range(world_size):
            rec = _load(os.path.join(out_dir, f"rank{r}.pt"))
            if not rec:
                raise RuntimeError(f"rank {r} wrote no result (exit code {procs[r].exitcode}, hung ranks {hung})")
            if not rec["ok"]:
                raise RuntimeError(f"rank {r} failed:\n{rec['error']}")
            results.append(rec["result"])
        return results


@dataclass
class Outcome:
    """How one rank of ``run_to_exit`` ended."""

    exitcode: int | None
    """None: still running at the timeout (then killed)."""
    output: str
    """Its stdout and stderr, in one file."""
    result: object
    """What ``fn`` returned (None when it did not return)."""
    error: str | None
    """The traceback of what ``fn`` raised."""
    ended: float
    """time.time() when the parent saw it gone."""


def _logged_entry(fn, rank: int, world: int, port: int, out_dir: str, kwargs: dict, env: dict) -> None:
    log = open(os.path.join(out_dir, f"rank{rank}.log"), "w", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout.reconfigure(line_buffering=True)
    _entry(fn, rank, world, port, out_dir, dict(kwargs, out_dir=out_dir), env)


def run_to_exit(fn, world_size: int, timeout: float = 300.0, env: dict[str, str] | None = None,
                **kwargs) -> list[Outcome]:
    """Run ``fn(out_dir=..., **kwargs)`` on ``world_size`` fresh ranks that may end by exiting (the watchdog's
    os._exit): each rank's exit code, output and result, never raising for a rank's failure. ``env``: as for
    ``run_distributed``."""
    with tempfile.TemporaryDirectory() as out_dir:
        procs = _start(_logged_entry, fn, world_size, out_dir, kwargs, env)
        ended: dict[int, float] = {}
        deadline = time.monotonic() + timeout
        while len(ended) < world_size and time.monotonic() < deadline:
            for r, p in enumerate(procs):
                if r not in ended and not p.is_alive():
                    ended[r] = time.time()
            time.sleep(0.1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        out = []
        for r, p in enumerate(procs):
            with open(os.path.join(out_dir, f"rank{r}.log")) as f:
                text = f.read()
            rec = _load(os.path.join(out_dir, f"rank{r}.pt"))
            out.append(Outcome(p.exitcode if r in ended else None, text, rec.get("result"), rec.get("error"),
                               ended.get(r, time.time())))
        return out
