"""What the job-end deadline (megatron/resilience/deadline.py) costs a training step: 2 gloo ranks run a tiny
data-parallel step (forward, backward, gradient all-reduce, SGD) followed by RunControl's flags exchange, in
alternating blocks without and with rank 0's Deadline. Reports every collective issued per step in each mode
(they must be equal: the verdict rides the existing flags all-reduce), the step-time ratio with its spread, and
the cost of rank 0's check alone.

    python bench/deadline_overhead.py [--iters 400 --block 50 --width 256]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time

import deepspeed
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.resilience import deadline as dl  # noqa: E402
from megatron.resilience.control import RunControl  # noqa: E402


def _counting() -> dict[str, int]:
    """Count every torch.distributed collective this process issues (wrapping the module's functions)."""
    counts: dict[str, int] = {}
    for name in ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
                 "barrier", "all_to_all_single", "send", "recv"):
        real = getattr(dist, name)

        def wrapped(*a, _real=real, _name=name, **k):
            counts[_name] = counts.get(_name, 0) + 1
            return _real(*a, **k)

        setattr(dist, name, wrapped)
    return counts


def _rank(rank: int, world: int, port: int, args, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    deepspeed.init_distributed("gloo")  # RunControl's reduce goes through deepspeed.comm, as in training
    counts = _counting()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(args.width, args.width), torch.nn.Tanh(),
                                torch.nn.Linear(args.width, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(32, args.width)
    save_dir = tempfile.mkdtemp()
    settings = dl.DeadlineSettings(job_id="bench", end_time=time.time() + 86400, save_dir=save_dir, reread_secs=0)
    deadline = (dl.Deadline(settings, dl.EndTime(settings), dl.SavePrediction(5.0, "bench"), say=lambda m: None)
                if rank == 0 else None)
    controls = {False: RunControl(None, None, None, 3, saving=False),
                True: RunControl(None, None, None, 3, saving=False, deadline=deadline)}

    def step(control: RunControl) -> None:
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        control.decide(1, control.exchange(loss.detach()))

    for _ in range(20):  # warm-up, both modes
        step(controls[False])
        step(controls[True])
    times: dict[bool, list[float]] = {False: [], True: []}
    per_step: dict[bool, dict[str, int]] = {}
    for block in range(2 * args.iters // args.block):
        mode = bool(block % 2)
        dist.barrier()
        before = dict(counts)
        t0 = time.perf_counter()
        for _ in range(args.block):
            step(controls[mode])
        times[mode].append((time.perf_counter() - t0) / args.block)
        per_step[mode] = {k: (v - before.get(k, 0)) // args.block for k, v in counts.items() if v != before.get(k, 0)}
    for c in controls.values():
        c.close()
    if rank == 0:  # the check alone, without the step around it
        n = 100_000
        t0 = time.perf_counter()
        for _ in range(n):
            deadline.should_stop()
        check_us = (time.perf_counter() - t0) / n * 1e6
        torch.save({"times": times, "per_step": per_step, "check_us": check_us}, out)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=400, help="steps per mode")
    p.add_argument("--block", type=int, default=10, help="steps per block; blocks alternate the modes")
    p.add_argument("--width", type=int, default=256)
    args = p.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pt")
        mp.start_processes(_rank, args=(2, port, args, out), nprocs=2, start_method="spawn")
        got = torch.load(out)
    times, per_step = got["times"], got["per_step"]
    ratios = [w / wo for wo, w in zip(times[False], times[True], strict=True)]
    load = os.getloadavg()[0]
    print(f"collectives per step without the deadline: {per_step[False]}")
    print(f"collectives per step with the deadline:    {per_step[True]}")
    print(f"step time without: median {statistics.median(times[False]) * 1e3:.3f} ms, with: median "
          f"{statistics.median(times[True]) * 1e3:.3f} ms ({args.iters} steps each, blocks of {args.block})")
    q = statistics.quantiles(ratios, n=4)
    print(f"ratio with/without per block pair ({len(ratios)} pairs): median {statistics.median(ratios):.3f}, "
          f"quartiles {q[0]:.3f}-{q[2]:.3f}, min {min(ratios):.3f}, max {max(ratios):.3f}; load average {load:.1f}")
    print(f"rank 0's check alone: {got['check_us']:.2f} us per call "
          f"({got['check_us'] / 1e6 / statistics.median(times[False]) * 100:.3f}% of the median step)")
    return 0 if per_step[False] == per_step[True] else 1


if __name__ == "__main__":
    sys.exit(main())
