"""Cost of checkpointing to training (issue 33): step time with no save, with --async-save, and how long the loop
blocks per save, asynchronous vs synchronous, in one run; plus the writer-choice microbenchmark (thread vs process).

    python bench/async_save.py [--reps 2] [--iters 120] [--save-interval 30] [--mb-per-s 100] [--dir /tmp/async_bench]
    python bench/async_save.py --writer-choice [--mb 200]

Training: 2 gloo ranks as TP=2 (fp32, Adam), a model whose state is large next to its step (h 512, 4 layers, vocab
8192, seq 16: ~16.9M parameters, ~270 MB per checkpoint, ~135 MB per rank; TP, not DP, so that the step's
communication is activations, not the whole gradient), launched once per variant, the variants interleaved ``--reps``
times:

* none: no --save;
* async: --async-save, a save every ``--save-interval`` iterations;
* sync: the same saves, synchronous.

Every checkpoint file write is slowed to ``--mb-per-s`` per rank (a token bucket under the hashing writer, in both
saving variants), so one save spans many steps as on a busy Lustre. Rank 0 records, per iteration, the step's own time
(StepProfiler.begin to the log; the save call after it is not in it) and whether a background save was in flight
during the whole step, and the time each Checkpointer.save call blocked the loop. Reported: median step while a save is
in flight / median step with no save (target <= 1.15 on this 2-core VM, where the writer shares the cores), and median
blocking per async save / median synchronous save (target <= 0.10), each per repetition and as min-max over them.

``--writer-choice``: one process trains a small model (1 thread) while the state of ``--mb`` MB (many tensors, as a
rank's files) is written at ``--mb-per-s`` through the hashing writer by (a) a thread of the same process, (b) a
persistent writer process that gets the state in shared memory through a queue (DeepSpeed's decoupled engine's
design). Reported: median step time with each writer / with none.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODEL = ["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "16",
         "--micro-batch-size", "1", "--global-batch-size", "2", "--lr", "1e-4", "--lr-warmup-iters", "1",
         "--mock-data", "--vocab-size", "8192", "--log-interval", "1000000", "--eval-iters", "0",
         "--use-cpu-initialization", "--seed", "7", "--distributed-backend", "gloo",
         "--tensor-model-parallel-size", "2", "--hidden-dropout", "0", "--attention-dropout", "0"]
WARMUP = 5
"""Leading iterations left out of the step statistics (allocation, first collectives)."""


class Throttled:
    """A file object whose writes average at most ``rate`` bytes/s since it was opened (a slow file system)."""

    def __init__(self, f, rate: float) -> None:
        self.f, self.rate, self.start, self.n = f, rate, time.monotonic(), 0

    def write(self, data) -> int:
        n = self.f.write(data)
        self.n += memoryview(data).nbytes
        ahead = self.n / self.rate - (time.monotonic() - self.start)
        if ahead > 0:
            time.sleep(ahead)
        return n

    def flush(self) -> None:
        self.f.flush()

    def fileno(self) -> int:
        return self.f.fileno()


def _slow_files(rate: float) -> None:
    from megatron.checkpointing.live import integrity

    init = integrity.HashingWriter.__init__

    def throttled(self, f):
        init(self, Throttled(f, rate))

    integrity.HashingWriter.__init__ = throttled


def _measured_pretrain(argv: list[str], rate: float) -> dict:
    """On each rank: pretrain with the slowed writes; rank 0's per-step records and per-save blocking times."""
    from megatron.checkpointing import Checkpointer
    from megatron.checkpointing.live import async_save
    from megatron.training import log, profiler

    _slow_files(rate)
    savers, begun, steps, blocks = [], {}, [], []
    init, begin, logged, save = (async_save.AsyncSaver.__init__, profiler.StepProfiler.begin,
                                 log.TrainingLogger.iteration, Checkpointer.save)

    def saver_init(self, *a, **k):
        init(self, *a, **k)
        savers.append(self)

    def step_begin(self):
        begun["t"] = time.perf_counter()
        begun["in_flight"] = bool(savers and savers[0].in_flight)
        return begin(self)

    def step_logged(self, it, *rest):
        # in flight for the whole step: launched before it began and not yet committed at its all-reduce
        steps.append((it, time.perf_counter() - begun["t"], begun["in_flight"] and savers[0].in_flight))
        return logged(self, it, *rest)

    def timed_save(*a, **k):
        t = time.perf_counter()
        out = save(*a, **k)
        blocks.append(time.perf_counter() - t)
        return out

    async_save.AsyncSaver.__init__, profiler.StepProfiler.begin = saver_init, step_begin
    log.TrainingLogger.iteration, Checkpointer.save = step_logged, timed_save
    from tests.checkpointing.common import _pretrain

    _pretrain(argv)
    return {"steps": steps, "blocks": blocks}


def _variant(kind: str, args, save_dir: str) -> dict:
    from tests.launch import run_distributed

    argv = MODEL + ["--train-iters", str(args.iters)]
    if kind != "none":
        shutil.rmtree(save_dir, ignore_errors=True)
        argv += ["--save", save_dir, "--save-interval", str(args.save_interval)]
        if kind == "async":
            argv.append("--async-save")
    got = run_distributed(_measured_pretrain, 2, timeout=1800, argv=argv, rate=args.mb_per_s * 1e6)[0]
    steps = [(it, dt, fl) for it, dt, fl in got["steps"] if it > WARMUP]
    return {"all": [dt for _, dt, _ in steps], "in_flight": [dt for _, dt, fl in steps if fl],
            "quiet": [dt for _, dt, fl in steps if not fl], "blocks": got["blocks"]}


def _ckpt_bytes(save_dir: str) -> int:
    from megatron.checkpointing.live.markers import read_latest

    d = os.path.join(save_dir, read_latest(save_dir))
    return sum(os.path.getsize(os.path.join(d, n)) for n in os.listdir(d))


def _training(args) -> None:
    save_dir = args.dir or tempfile.mkdtemp(prefix="async_bench_")
    load_before = os.getloadavg()[0]
    rows = []
    for rep in range(args.reps):
        got = {k: _variant(k, args, save_dir) for k in ("none", "async", "sync")}
        size = _ckpt_bytes(save_dir)
        none = statistics.median(got["none"]["all"])
        flight = statistics.median(got["async"]["in_flight"]) if got["async"]["in_flight"] else float("nan")
        row = {"rep": rep, "step_none_s": none, "step_in_flight_s": flight,
               "steps_in_flight": len(got["async"]["in_flight"]), "saves": len(got["async"]["blocks"]),
               "step_ratio": flight / none,
               "block_async_s": statistics.median(got["async"]["blocks"]),
               "block_sync_s": statistics.median(got["sync"]["blocks"]),
               "checkpoint_bytes": size, "step_sync_all_s": statistics.median(got["sync"]["all"])}
        row["block_ratio"] = row["block_async_s"] / row["block_sync_s"]
        row["step_ratio_same_run"] = flight / statistics.median(got["async"]["quiet"])
        rows.append(row)
        print(json.dumps(row), flush=True)
    shutil.rmtree(save_dir, ignore_errors=True)
    for key in ("step_ratio", "step_ratio_same_run", "block_ratio"):
        vals = [r[key] for r in rows]
        print(f"{key}: median {statistics.median(vals):.3f}, min {min(vals):.3f}, max {max(vals):.3f} "
              f"over {len(vals)} repetitions", flush=True)
    print(f"load average before {load_before:.2f}, after {os.getloadavg()[0]:.2f}", flush=True)


# ---------------------------------------------------------------------------------------------- writer choice
def _small_model():
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(64, 256)

    def step() -> None:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    return step


def _write_state(state: dict, path: str, rate: float) -> None:
    from megatron.checkpointing.live import integrity

    _slow_files(rate)
    integrity.write_torch(state, path)


def _writer_process(jobs, done, rate: float) -> None:
    """A persistent writer process (as DeepSpeed's decoupled engine keeps one): writes each (state, path) it gets."""
    import torch

    torch.set_num_threads(1)
    while (job := jobs.get()) is not None:
        _write_state(*job, rate)
        done.set()


def _steps_while(step, writing, n_min: int = 20) -> list[float]:
    times = []
    while writing is None and len(times) < n_min or writing is not None and writing():
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return times


def _writer_choice(args) -> None:
    import threading

    import torch
    import torch.multiprocessing as tmp

    torch.set_num_threads(1)
    n = 256
    state = {f"w{i}": torch.randn(int(args.mb * 1e6) // (4 * n)) for i in range(n)}  # the host copy
    rate = args.mb_per_s * 1e6
    # A process writer needs the copy in shared memory (here made before timing: its cost is the same copy the
    # thread's host copy makes) and gets it through a queue (file descriptors, no copy).
    ctx = tmp.get_context("spawn")
    jobs, done = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=_writer_process, args=(jobs, done, rate), daemon=True)
    child.start()
    shared = {k: v.clone().share_memory_() for k, v in state.items()}
    step = _small_model()
    for _ in range(WARMUP):
        step()
    d = tempfile.mkdtemp(prefix="writer_choice_")
    out = {}
    for _ in range(args.reps):
        for kind in ("none", "thread", "process"):
            path = os.path.join(d, f"{kind}.pt")
            if kind == "none":
                writing = None
            elif kind == "thread":
                t = threading.Thread(target=_write_state, args=(state, path, rate), daemon=True)
                t.start()
                writing = t.is_alive
            else:
                done.clear()
                jobs.put((shared, path))
                writing = lambda: not done.is_set()  # noqa: E731
            out.setdefault(kind, []).append(statistics.median(_steps_while(step, writing)))
    jobs.put(None)
    child.join(30)
    shutil.rmtree(d, ignore_errors=True)
    base = out["none"]
    for kind in ("thread", "process"):
        ratios = [a / b for a, b in zip(out[kind], base, strict=True)]
        print(f"writer {kind}: median step / no writer = {statistics.median(ratios):.3f} (min {min(ratios):.3f}, "
              f"max {max(ratios):.3f}, {len(ratios)} repetitions; no-writer step {statistics.median(base) * 1e3:.1f} "
              "ms)", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f}", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--iters", type=int, default=120)
    p.add_argument("--save-interval", type=int, default=30)
    p.add_argument("--mb-per-s", type=float, default=100.0, help="write rate of each rank's checkpoint files")
    p.add_argument("--dir", default=None, help="checkpoint directory (default: a fresh one under $TMPDIR)")
    p.add_argument("--writer-choice", action="store_true", help="thread vs process writer microbenchmark")
    p.add_argument("--mb", type=float, default=200.0, help="--writer-choice: state size in MB")
    args = p.parse_args(argv)
    if args.writer_choice:
        _writer_choice(args)
    else:
        _training(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
