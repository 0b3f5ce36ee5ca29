"""Cost of checkpoint integrity (issue 24): save and load time of a >= 1 GB checkpoint with and without the
manifest / verification, in one run, plus the checksum speed on one core.

    python bench/checkpoint_integrity.py [--gib 1.25] [--files 4] [--reps 3] [--dir /tmp/ckpt_bench]

The checkpoint is ``--files`` DeepSpeed-style files (a dict of fp32 tensors each, as ranks write them) written
through the real code paths:

* save, unverified: DeepSpeed's TorchCheckpointEngine.save (torch.save to the path) + fsync, what
  SafeCheckpointEngine did before the manifest;
* save, verified: SafeCheckpointEngine.save (torch.save into the hashing writer: size + XXH3-128 while the bytes
  stream to the file, + fsync) and the manifest;
* load, unverified: ``--verify-checkpoint off``: validate_files' mmap open of each file, then safe_load of each;
* load, verified: the manifest check of every file (size + XXH3-128, ``--verify-checkpoint full``) first.

Both variants run alternately ``--reps`` times (the machine is shared: medians are reported, with the load).
The files stay in the page cache between save and load, so reads are memory-speed: the worst case for the
relative cost of hashing (on Lustre the read itself dominates).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _state(n_bytes: int, seed: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    rows = max(1, n_bytes // (4 * 4096 * 16))
    # A model file's shape: many weight matrices plus a few small tensors and plain values.
    return {"module": {f"layers.{i}.weight": torch.randn(rows, 4096, generator=g) for i in range(16)},
            "optimizer": {"step": 10, "lr": 1e-4}, "iteration": 10}


def _save(states: list, d: str, verified: bool) -> float:
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    from megatron.checkpointing.live import atomic, integrity, safe_io

    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    engine = safe_io.SafeCheckpointEngine(None) if verified else TorchCheckpointEngine(None)
    engine.zipfile_serialization = True
    start = time.perf_counter()
    for i, st in enumerate(states):
        path = os.path.join(d, f"zero_pp_rank_{i}_mp_rank_00_optim_states.pt")
        engine.save(st, path)
        if not verified:
            atomic.fsync_file(path)
    if verified:
        assert engine.failure is None, engine.failure
        integrity.write_manifest(d, integrity.recorded(d))
    return time.perf_counter() - start


def _load(d: str, verified: bool) -> float:
    from megatron.checkpointing.live import integrity, safe_io

    names = sorted(n for n in os.listdir(d) if n.endswith(".pt"))
    start = time.perf_counter()
    if verified:
        files = integrity.read_manifest(d)
        bad = integrity.problems(d, files, sorted(files), "full")
        assert not bad, bad
    for n in names:  # validate_files: headers and pickles through mmap
        safe_io.safe_load(os.path.join(d, n), mmap=True)
    for n in names:  # the engine's load
        safe_io.safe_load(os.path.join(d, n))
    return time.perf_counter() - start


def main(argv=None) -> int:
    import torch
    import xxhash

    from megatron.checkpointing.live import integrity

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.25, help="checkpoint size (all files together)")
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--dir", default="/tmp/ckpt_integrity_bench")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    states = [_state(int(args.gib * 2**30 / args.files), i) for i in range(args.files)]
    times = {(k, v): [] for k in ("save", "load") for v in (False, True)}
    for rep in range(args.reps):
        for verified in ((False, True) if rep % 2 == 0 else (True, False)):
            times[("save", verified)].append(_save(states, args.dir, verified))
            times[("load", verified)].append(_load(args.dir, verified))
    files = sorted(n for n in os.listdir(args.dir) if n.endswith(".pt"))
    total = sum(os.path.getsize(os.path.join(args.dir, n)) for n in files)
    start = time.perf_counter()  # checksum speed from the page cache (one core: this process is single-threaded)
    for n in files:
        integrity.hash_file(os.path.join(args.dir, n))
    cached = total / (time.perf_counter() - start) / 1e9
    buf = os.urandom(256 << 20)
    start = time.perf_counter()
    xxhash.xxh3_128(buf).hexdigest()
    memory = len(buf) / (time.perf_counter() - start) / 1e9
    shutil.rmtree(args.dir, ignore_errors=True)
    load_after = os.getloadavg()

    med = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}
    print(f"checkpoint: {len(files)} files, {total / 1e9:.3f} GB ({total / 2**30:.3f} GiB) in {args.dir}; "
          f"{args.reps} alternating repetitions: best and median (all runs in brackets)")
    print(f"load average (1, 5, 15 min) before {load_before[0]:.1f} {load_before[1]:.1f} {load_before[2]:.1f}, "
          f"after {load_after[0]:.1f} {load_after[1]:.1f} {load_after[2]:.1f}; {os.cpu_count()} cores")
    print("| | unverified: best / median (s) | verified: best / median (s) | ratio of best / of medians | target |")
    print("|---|---|---|---|---|")
    for what, target in (("save", 1.05), ("load", 1.10)):
        u, v = (what, False), (what, True)
        print(f"| {what} | {best[u]:.2f} / {med[u]:.2f} {_all(times[u])} | {best[v]:.2f} / {med[v]:.2f} "
              f"{_all(times[v])} | {best[v] / best[u]:.3f} / {med[v] / med[u]:.3f} | <= {target} |")
    print(f"XXH3-128 on one core: {cached:.2f} GB/s hashing the files from the page cache (mmap), "
          f"{memory:.2f} GB/s on bytes in memory")
    return 0


def _all(xs: list[float]) -> str:
    return "[" + " ".join(f"{x:.2f}" for x in xs) + "]"


if __name__ == "__main__":
    sys.exit(main())
