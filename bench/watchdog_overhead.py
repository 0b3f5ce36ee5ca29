"""Step time with and without the watchdog and progress tracking (issue 32), and what one TCPStore serves.

    python bench/watchdog_overhead.py [--ranks 2] [--iters 300] [--pairs 5] [--store-clients 4] [--force]

* Step time: pretrain_gpt.py on ``--ranks`` gloo processes (torchrun), alternating the defaults (watchdog thread,
  hang detection, tracked collectives, straggler reports) with ``--watchdog-timeout-secs 0 --straggler-interval 0``
  (no watchdog, collectives not tracked). Per run, the median "elapsed time per iteration" after 20 warm-up
  iterations; per pair the ratio on / off; then the mean ratio and its spread (standard deviation over pairs).
* In-process: nanoseconds per progress move and per tracked collective call (a no-op collective).
* Store: add() operations per second one TCPStore serves to ``--store-clients`` processes (the watchdog's beat is
  three add()s per rank; docs/faults.md derives the load at 75,000 ranks).

The machine must be quiet: with a 1-minute load average of 2 or more it measures nothing (``--force`` overrides).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import re
import statistics
import subprocess
import sys
import time
from datetime import timedelta

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3", "--mock-data", "--vocab-size", "512",
         "--log-interval", "1", "--eval-iters", "0", "--use-cpu-initialization", "--distributed-backend", "gloo"]
OFF = ["--watchdog-timeout-secs", "0", "--straggler-interval", "0"]
WARMUP = 20
_STEP = re.compile(r"elapsed time per iteration \(ms\): ([\d.]+)")


def step_ms(ranks: int, iters: int, extra: list[str]) -> float:
    sys.path.insert(0, REPO)
    from tests.launch import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port",
           str(free_port()), os.path.join(REPO, "pretrain_gpt.py"), *MODEL, "--train-iters", str(iters), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, check=True).stdout
    times = [float(x) for x in _STEP.findall(out)][WARMUP:]
    return statistics.median(times)


def in_process_ns(n: int = 200_000) -> tuple[float, float]:
    from megatron.progress import Progress

    p = Progress()
    began = time.perf_counter()
    for _ in range(n):
        p.enter("forward")
    move = (time.perf_counter() - began) / n * 1e9
    began = time.perf_counter()
    for _ in range(n):
        before = p.enter_collective("all_reduce", "3")
        p.leave_collective(before)
    return move, (time.perf_counter() - began) / n * 1e9


def _client(port: int, seconds: float, counts) -> None:
    import torch.distributed as tdist

    store = tdist.TCPStore("127.0.0.1", port, 1, False, timeout=timedelta(seconds=30), wait_for_workers=False)
    n, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        store.add(f"hb{os.getpid()}", 1)
        n += 1
    counts.put(n)


def store_ops_per_s(clients: int, seconds: float = 5.0) -> float:
    import torch.distributed as tdist

    sys.path.insert(0, REPO)
    from tests.launch import free_port

    port = free_port()
    master = tdist.TCPStore("127.0.0.1", port, 1, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    ctx = mp.get_context("spawn")
    counts = ctx.Queue()
    procs = [ctx.Process(target=_client, args=(port, seconds, counts)) for _ in range(clients)]
    for p in procs:
        p.start()
    total = sum(counts.get(timeout=120) for _ in procs)
    for p in procs:
        p.join()
    del master
    return total / seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--store-clients", type=int, default=4)
    ap.add_argument("--force", action="store_true", help="measure even on a loaded machine")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    if load >= 2 and not args.force:
        print(f"load average {load:.1f} >= 2: not measured (a shared machine's noise would swamp the difference)")
        return 0
    move, call = in_process_ns()
    print(f"progress move {move:.0f} ns, tracked collective enter+leave {call:.0f} ns (in-process)")
    ratios = []
    for i in range(args.pairs):
        on, off = (step_ms(args.ranks, args.iters, []), step_ms(args.ranks, args.iters, OFF))
        ratios.append(on / off)
        print(f"pair {i + 1}: {on:.2f} ms with, {off:.2f} ms without the watchdog and tracking: ratio {on / off:.4f}")
    spread = statistics.stdev(ratios) if len(ratios) > 1 else float("nan")
    print(f"step time ratio with / without: {statistics.mean(ratios):.4f} +- {spread:.4f} (mean +- std of "
          f"{len(ratios)} pairs, {args.ranks} ranks, load average {load:.1f} at the start)")
    ops = store_ops_per_s(args.store_clients)
    print(f"one TCPStore served {ops:,.0f} add()/s to {args.store_clients} client processes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
