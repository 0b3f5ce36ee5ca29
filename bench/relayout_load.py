"""Cost of resuming at another layout in place (issue 43): read time and memory per rank of ``--load`` through
megatron/checkpointing/relayout/ against the same checkpoint loaded at its own layout (DeepSpeed's path).

    python bench/relayout_load.py [--reps 2] [--hidden 512] [--layers 8] [--vocab 8192] [--dir /tmp/relayout_bench]

One checkpoint is written once by 2 gloo ranks at DP 2, ZeRO-1, fp32 (Adam). Then, each in fresh processes and
interleaved ``--reps`` times:

* same: 2 ranks at DP 2 (the layout it was written at: engine.load_checkpoint);
* dp1: 1 rank at DP 1 (in place: the one rank reads every slice);
* tp2: 2 ranks at TP 2 x DP 1 (in place: each rank reads half of every weight and of its moments).

Per rank: wall time of Checkpointer.load_into_model + Checkpointer.resume (the reading; deepspeed.initialize between
them is not counted), the peak rise during those two calls of the process's own memory (RssAnon) and of the file
pages mapped into it (RssFile: the mmapped checkpoint files, reclaimable page cache), sampled from /proc/self/status
every 2 ms, and for the in-place loads the bytes the reader copied. Files are in
the page cache (warm): the read time is the copy and the unpickling, not the disk.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _model(hidden: int, layers: int, vocab: int) -> list[str]:
    return ["--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", "8",
            "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1",
            "--global-batch-size", "2", "--lr", "1e-4", "--lr-decay-iters", "10", "--mock-data",
            "--vocab-size", str(vocab), "--log-interval", "1000000", "--eval-iters", "0", "--use-cpu-initialization",
            "--seed", "7", "--distributed-backend", "gloo", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--zero-stage", "1", "--deepspeed"]


def _rss(kind: str) -> int:
    """``kind``: RssAnon (the process's own memory) or RssFile (file pages mapped in: mmapped checkpoint files)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(kind + ":"):
                return int(line.split()[1]) * 1024
    return 0


class _Peak:
    """The highest RssAnon and RssFile seen while running, sampled by a thread."""

    def __init__(self) -> None:
        self.anon = self.file = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self.stop.is_set():
            self.anon, self.file = max(self.anon, _rss("RssAnon")), max(self.file, _rss("RssFile"))
            time.sleep(0.002)

    def __enter__(self):
        self.anon, self.file = _rss("RssAnon"), _rss("RssFile")
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def _timed_load(argv: list[str]) -> dict:
    """One pretrain run that loads and trains one step; returns this rank's load time, memory and bytes read."""
    from megatron.checkpointing import checkpointer
    from tests.checkpointing.common import _pretrain

    got = {"secs": 0.0, "anon": 0, "file": 0, "bytes": 0}
    load, resume = checkpointer.Checkpointer.load_into_model, checkpointer.Checkpointer.resume

    def timed(fn):
        def call(self, arg):
            anon, file = _rss("RssAnon"), _rss("RssFile")
            started = time.monotonic()
            with _Peak() as peak:
                out = fn(self, arg)
            got["secs"] += time.monotonic() - started
            got["anon"] = max(got["anon"], peak.anon - anon)
            got["file"] = max(got["file"], peak.file - file)
            reader = getattr(self.source, "reader", None)
            got["bytes"] = reader.bytes if reader is not None else 0
            got["format"] = type(self.source).__name__
            return out
        return call

    checkpointer.Checkpointer.load_into_model, checkpointer.Checkpointer.resume = timed(load), timed(resume)
    _pretrain(argv)
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--dir", default="/tmp/relayout_bench")
    args = ap.parse_args()
    from tests.launch import run_distributed
    from tests.checkpointing.common import pretrain_on

    model = _model(args.hidden, args.layers, args.vocab)
    shutil.rmtree(args.dir, ignore_errors=True)
    pretrain_on(2, model + ["--train-iters", "1", "--save", args.dir, "--save-interval", "1"], timeout=900)
    step = os.path.join(args.dir, "global_step1")
    size = sum(os.path.getsize(os.path.join(step, f)) for f in os.listdir(step))
    print(f"checkpoint: {size / 2**20:.1f} MiB in {step} (DP 2, ZeRO-1, fp32; h {args.hidden}, {args.layers} "
          f"layers, vocab {args.vocab}); load average {os.getloadavg()[0]:.1f}", flush=True)
    variants = {"same": (2, []), "dp1": (1, []), "tp2": (2, ["--tensor-model-parallel-size", "2"])}
    results: dict[str, list[list[dict]]] = {k: [] for k in variants}
    for _ in range(args.reps):
        for name, (world, extra) in variants.items():
            argv = model + extra + ["--train-iters", "2", "--load", args.dir]
            results[name].append(run_distributed(_timed_load, world, timeout=900, argv=argv))
    same = statistics.median(max(r["secs"] for r in rep) for rep in results["same"])
    print(f"{'variant':8} {'format':16} {'ranks':>5} {'read s (max rank)':>17} {'x same':>6} "
          f"{'anon peak rise MiB':>18} {'file pages MiB':>14} {'copied MiB':>10}   (per rank, max over ranks)")
    for name, reps in results.items():
        secs = statistics.median(max(r["secs"] for r in rep) for rep in reps)
        anon, file, copied = (statistics.median(max(r[k] for r in rep) for rep in reps) / 2**20
                              for k in ("anon", "file", "bytes"))
        print(f"{name:8} {reps[0][0]['format']:16} {len(reps[0]):>5} {secs:>17.2f} {secs / same:>6.2f} "
              f"{anon:>18.1f} {file:>14.1f} {copied if copied else float('nan'):>10.1f}")
    print("reps (read s per rank):", {k: [[round(r["secs"], 2) for r in rep] for rep in v] for k, v in results.items()})
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
