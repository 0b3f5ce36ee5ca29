"""Helpers for the checkpoint tests: run pretrain_gpt.py's providers through ``pretrain`` on fresh
spawned ranks and get the exact per-iteration losses back (the log prints only 7 digits)."""

from __future__ import annotations

import os

from tests.launcher import run_distributed

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "2e-3", "--lr-warmup-iters", "1",
        "--mock-data", "--vocab-size", "200", "--make-vocab-size-divisible-by", "32", "--log-interval", "1",
        "--eval-iters", "0", "--use-cpu-initialization", "--seed", "7", "--distributed-backend", "gloo"]
LLAMA = ["--normalization", "rmsnorm", "--swiglu", "--position-embedding-type", "rope",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--num-key-value-heads", "2"]


def _pretrain(argv: list[str]) -> dict:
    import pretrain_gpt
    from megatron.training.pretrain import Providers

    return pretrain_gpt.pretrain_from_flags(argv, Providers(pretrain_gpt.model_provider, pretrain_gpt.datasets_provider,
                                                            pretrain_gpt.forward_step, pretrain_gpt.tokenizer_provider))


def pretrain_on(world: int, argv: list[str], timeout: float = 240.0) -> dict:
    """Rank 0's summary of one pretrain run on ``world`` fresh processes."""
    return run_distributed(_pretrain, world, timeout=timeout, argv=argv)[0]


def check_resume_exact(world: int, args: list[str], save_dir: str, n: int = 2) -> dict[int, float]:
    """2n straight iterations == n, save and exit (--exit-interval), resume n, bit for bit, on ``world`` fresh
    ranks. Shared by the CPU suite and tests/gpu (same code path, the device's backend). Returns the straight
    run's losses."""
    args = args + ["--train-iters", str(2 * n)]
    straight = pretrain_on(world, args)["losses"]
    first = pretrain_on(world, args + ["--exit-interval", str(n), "--save", save_dir])
    assert first["exit_reason"] == f"--exit-interval {n}" and list(first["losses"]) == list(range(1, n + 1)), first
    resumed = pretrain_on(world, args + ["--save", save_dir, "--load", save_dir])["losses"]
    assert resumed == {i: straight[i] for i in range(n + 1, 2 * n + 1)}, (resumed, straight)
    assert len(set(straight.values())) == 2 * n, straight  # the loss moves: equality is not trivial
    return straight


# Slow down one file write of the step-4 save, so the test can kill the process in the middle of it.
SLOW_SAVE = """
import sys, time
from megatron.checkpointing.live import safe_io
orig = safe_io.SafeCheckpointEngine.save
def slow(self, state_dict, path):
    orig(self, state_dict, path)
    if "global_step4.tmp-" in path:
        print("SAVING", path, flush=True)
        time.sleep(60)
safe_io.SafeCheckpointEngine.save = slow
import pretrain_gpt
sys.exit(pretrain_gpt.run_cli(pretrain_gpt.main, sys.argv[1:]))
"""


# --async-save tests: one script for every launch, steered by the environment (rank R of the writer that is slowed
# or fills the disk; the save whose temporary directory name contains TAG). Every rank prints each logged loss
# exactly, so runs compare bit for bit; the writer prints WRITING before a slowed file.
ASYNC = """
import errno, os, sys, time
from megatron.checkpointing.live import integrity
from megatron.training import log
rank = os.environ["RANK"]
slow_tag, slow_s = os.environ.get("SLOW_TAG"), float(os.environ.get("SLOW_S", "0"))
slow_rank, full_tag, full_rank = os.environ.get("SLOW_RANK"), os.environ.get("FULL_TAG"), os.environ.get("FULL_RANK")
write = integrity.write_torch
def slowed(obj, path, zipfile=True):
    if slow_tag and slow_tag in path and slow_rank in (None, rank):
        print(f"WRITING {path}", flush=True)
        time.sleep(slow_s)
    return write(obj, path, zipfile=zipfile)
integrity.write_torch = slowed
class Full:
    def __init__(self, f):
        self.f = f
    def write(self, data):
        if self.f.tell() > 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.f.write(data)
    def flush(self):
        self.f.flush()
init = integrity.HashingWriter.__init__
def filling(self, f):
    init(self, Full(f) if full_tag and full_tag in f.name and rank == full_rank else f)
integrity.HashingWriter.__init__ = filling
logged = log.TrainingLogger.iteration
def exact(self, it, loss, res, consumed, *rest):
    if loss is not None:
        print(f"EXACT {it} {loss!r}", flush=True)
    return logged(self, it, loss, res, consumed, *rest)
log.TrainingLogger.iteration = exact
import pretrain_gpt
sys.exit(pretrain_gpt.run_cli(pretrain_gpt.main, sys.argv[1:]))
"""


def start_ranks(world: int, argv: list[str], out_dir: str, env: dict | None = None, script: str = ASYNC) -> list:
    """``world`` ranks of ``script`` as separate processes (each its own exit code and pid, for signals and kill -9);
    stdout and stderr of rank r go to ``out_dir/rank{r}.out`` / ``.err``."""
    import subprocess
    import sys

    from tests.functional.cli import REPO
    from tests.launcher import free_port

    port = free_port()
    procs = []
    for r in range(world):
        full = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, RANK=str(r), WORLD_SIZE=str(world),
                    LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                    **(env or {}))
        with open(os.path.join(out_dir, f"rank{r}.out"), "w") as out, open(os.path.join(out_dir, f"rank{r}.err"),
                                                                          "w") as err:
            procs.append(subprocess.Popen([sys.executable, "-c", script, *argv], cwd=REPO, env=full, stdout=out,
                                          stderr=err))
    return procs


def wait_for_line(path: str, pattern: str, procs: list, timeout: float = 300.0) -> str:
    """The first line of ``path`` matching the regex ``pattern`` (polled while the ranks run)."""
    import re
    import time

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with open(path) as f:
            for line in f:
                if re.search(pattern, line):
                    return line
        if all(p.poll() is not None for p in procs):
            break
        time.sleep(0.1)
    raise AssertionError(f"no line matching {pattern!r} in {path}:\n{open(path).read()[-3000:]}")


def exact_losses(path: str) -> dict[int, float]:
    with open(path) as f:
        return {int(w[1]): float(w[2]) for w in (line.split() for line in f) if w and w[0] == "EXACT"}


def finish(procs: list, timeout: float = 120.0) -> list[int]:
    """Every rank's exit code (a rank still running after ``timeout`` is killed and reads as None)."""
    import subprocess

    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(None)
    return codes


def slow_async_pretrain(argv: list[str], slow_tag: str, slow_s: float, sigterm_at: int | None = None) -> dict:
    """``_pretrain`` whose background writer sleeps ``slow_s`` before each file of the save named by ``slow_tag``, and
    whose rank 0 sends itself SIGTERM once iteration ``sigterm_at`` is logged. The summary gains ``events``:
    ("iteration", it) as each is logged, ("commit", tag) as rank 0 commits, ("say", line) for async_save's log."""
    import signal
    import time

    from megatron.checkpointing.live import async_save, integrity
    from megatron.training import log

    events = []
    write, commit, logged, say = integrity.write_torch, async_save.commit, log.TrainingLogger.iteration, async_save.say

    def slowed(obj, path, zipfile=True):
        if slow_tag in path:
            time.sleep(slow_s)
        return write(obj, path, zipfile=zipfile)

    def committing(save_dir, tmp_tag, tag, *rest):
        events.append(("commit", tag))
        return commit(save_dir, tmp_tag, tag, *rest)

    def iteration(self, it, *rest):
        events.append(("iteration", it))
        if it == sigterm_at and os.environ["RANK"] == "0":
            os.kill(os.getpid(), signal.SIGTERM)  # as Slurm does; RunControl's handler only sets a flag
        return logged(self, it, *rest)

    def saying(msg):
        events.append(("say", msg))
        say(msg)

    integrity.write_torch, async_save.commit, log.TrainingLogger.iteration = slowed, committing, iteration
    async_save.say = saying
    return {**_pretrain(argv), "events": events}
