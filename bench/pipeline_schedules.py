"""Pipeline schedules through the real engine: step time of 1F1B, zero-bubble H1 (both variants) and interleaved 1F1B
with stand-in layers whose forward, input-gradient and weight-gradient passes each sleep a fixed time, beside the
planner's prediction (megatron/perf/schedules.py) and the theoretical bubble.

    python bench/pipeline_schedules.py --check          # p=4, m=8: one line per schedule, under 2 minutes
    python bench/pipeline_schedules.py [--out bench/RESULTS_pipeline_schedules.md]   # p in {2,4,8} x m in {4..32}
    python bench/pipeline_schedules.py --gpt --steps 5   # the tiny GPT at PP=2, 1F1B and ZB-H1 in turn (appends)

Sleeps release the GIL and use no CPU, so 4-8 ranks on 2 cores behave like separate devices: what is measured is the
schedule (DeepSpeed's PipelineEngine for 1F1B, megatron/core/pipeline/engine.py for the others, ZeRO-0 fp32 SGD,
gloo), not this CPU. The weight-gradient sleep goes through the same store, queue and W instruction as the
transformer layers' linears. ZB-H1 runs upstream's order (the engine's memory cap off): a stand-in's W keeps its input
and output gradient, twice what its forward saves, which no transformer layer does (there the cap leaves equal
stages in upstream's order; megatron/core/pipeline/deferral_cap.py). Per configuration: 1 warm-up step, then ``--steps`` timed; the median step of the
slowest rank counts. ``--check`` prints ``schedule NAME step MS ratio X predicted MS`` (ratio to DeepSpeed's 1F1B).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

WIDTH, MBS = 64, 1
SCHEDULES = ("1f1b", "1f1b-nb", "zbh1", "zbh1-exact", "interleaved")
"""``1f1b``: DeepSpeed's engine and schedule, as users run it today (blocking sends). ``1f1b-nb``: the same 1F1B order
on our executor (non-blocking sends), the like-for-like baseline of the other three, which run on that executor."""
LAYERS_PER_RANK = 2
"""Two stand-in layers per rank: one per chunk under interleaved v=2, so each rank's time per micro-batch is the
same under every schedule."""


def _stand_in_layer_class():
    import torch

    from megatron.core.tensor_parallel.weight_grad_store import WEIGHT_GRAD_STORE, run_weight_pass

    class _Sleep(torch.autograd.Function):
        """y = x * w; forward sleeps tF, backward tB (input gradient), the weight gradient tW (in B, or in W when the
        store defers). The weight rides outside autograd's inputs, as in the deferring linear."""

        @staticmethod
        def forward(ctx, x, box, times):
            time.sleep(times[0])
            ctx.save_for_backward(x)
            ctx.box, ctx.times = box, times
            return x * box[0].detach()

        @staticmethod
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            w, (_, tb, tw) = ctx.box[0], ctx.times
            time.sleep(tb)

            def compute() -> torch.Tensor:
                time.sleep(tw)
                return (grad * x).sum().reshape(1)

            if WEIGHT_GRAD_STORE.deferring:
                WEIGHT_GRAD_STORE.put(w, compute, (x, grad))
            else:
                run_weight_pass([(w, compute)])
            return grad * w.detach(), None, None

    class SleepLayer(torch.nn.Module):
        def __init__(self, times: tuple[float, float, float]) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(1))
            self.times = times

        def forward(self, x):
            if not x.requires_grad and torch.is_grad_enabled():  # the first layer: give autograd a path back
                x = x.detach().requires_grad_()
            return _Sleep.apply(x, [self.weight], self.times)

    return SleepLayer


def _module(p: int, v: int, times: tuple[float, float, float]):
    """``p x LAYERS_PER_RANK`` stand-in layers over p ranks (v chunks each), each layer 1/LAYERS_PER_RANK of a
    stage's time."""
    from deepspeed.pipe import LayerSpec
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    from megatron.core.pipeline.module import ChunkedPipelineModule

    layer = _stand_in_layer_class()
    per = tuple(t / LAYERS_PER_RANK for t in times)
    n = p * LAYERS_PER_RANK
    return ChunkedPipelineModule([LayerSpec(layer, per) for _ in range(n)],
                                 topology=PipeDataParallelTopology(num_pp=p, num_dp=1),
                                 loss_fn=lambda out, y: ((out - y) ** 2).mean(), virtual_stages=v,
                                 parts=[i * n // (p * v) for i in range(p * v + 1)],
                                 activation_checkpoint_interval=0)


def _engine(schedule: str, p: int, m: int, times: tuple[float, float, float]):
    import deepspeed
    import torch

    from megatron import ds_seams
    from megatron.core.pipeline.engine import ScheduledPipelineEngine

    module = _module(p, 2 if schedule == "interleaved" else 1, times)
    config = {"train_batch_size": m * MBS, "train_micro_batch_size_per_gpu": MBS, "gradient_accumulation_steps": m,
              "zero_optimization": {"stage": 0}, "steps_per_print": 10**9,
              "pipeline": {"pipe_partitioned": False, "grad_partitioned": False}}
    optimizer = torch.optim.SGD(module.parameters(), lr=1e-3)
    ours = "1f1b" if schedule == "1f1b-nb" else schedule
    chosen = contextlib.nullcontext() if schedule == "1f1b" else \
        ds_seams.pipeline_engine_class(functools.partial(ScheduledPipelineEngine, schedule=ours, memory_cap=False))
    with chosen:
        engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=config)
    return engine


def _data():
    import torch

    g = torch.Generator().manual_seed(0)
    while True:
        yield torch.randn(MBS, WIDTH, generator=g), torch.randn(MBS, WIDTH, generator=g)


def _worker(configs: list[tuple], steps: int) -> list[dict]:
    import deepspeed.comm as dist

    from megatron.initialize import initialize_distributed

    initialize_distributed("gloo")
    out = []
    for schedule, p, m, times in configs:
        engine = _engine(schedule, p, m, times)
        data = _data()
        measured = []
        for i in range(1 + steps):
            dist.barrier()
            t0 = time.perf_counter()
            engine.train_batch(data)
            if i:
                measured.append(time.perf_counter() - t0)
        out.append({"schedule": schedule, "p": p, "m": m, "times": times, "step": statistics.median(measured)})
        del engine
    return out


def predicted(schedule: str, p: int, m: int, times: tuple[float, float, float]) -> float:
    """The planner's pipelined time of one step (no send time: these stand-ins send 64 floats)."""
    from megatron.perf.schedules import pipeline_time

    name = "1f1b" if schedule == "1f1b-nb" else schedule
    return pipeline_time(name, p, m, *times, v=2 if schedule == "interleaved" else 1).total


def _run(p: int, configs: list[tuple], steps: int) -> list[dict]:
    from tests.launch import run_distributed

    ranks = run_distributed(_worker, world_size=p, timeout=1800, configs=configs, steps=steps)
    rows = []
    for i, row in enumerate(ranks[0]):
        row = dict(row, step=max(r[i]["step"] for r in ranks))  # the slowest rank's median step
        row["predicted"] = predicted(row["schedule"], p, row["m"], row["times"])
        rows.append(row)
    return rows


def _configs(p: int, ms: list[int], times: tuple[float, float, float]) -> list[tuple]:
    return [(s, p, m, times) for m in ms for s in SCHEDULES if s != "interleaved" or m % p == 0]


def check(unit: float, steps: int) -> list[dict]:
    rows = _run(4, _configs(4, [8], (unit, unit, unit)), steps)
    base, nb = rows[0]["step"], rows[1]["step"]
    for r in rows:  # ratio: to DeepSpeed's 1F1B; in brackets to 1F1B on the same executor
        print(f"schedule {r['schedule']} step {1e3 * r['step']:.0f} ratio {r['step'] / base:.3f} "
              f"predicted {1e3 * r['predicted']:.0f} (vs 1f1b-nb {r['step'] / nb:.3f}, measured/predicted "
              f"{r['step'] / r['predicted']:.3f})")
    return rows


def full(unit: float, steps: int, out: str, ps: list[int]) -> None:
    """The grid, p by p; the table is rewritten after each p (a long run keeps what it measured)."""
    load = os.getloadavg()[0]
    rows: list[dict] = []
    for p in ps:
        rows += _run(p, _configs(p, [4, 8, 16, 32], (unit, unit, unit)), steps)
        if p == 4:
            rows += _run(4, _configs(4, [8], (unit, 2 * unit, unit)), steps)
        _write(rows, unit, steps, load, out)


def _write(rows: list[dict], unit: float, steps: int, load: float, out: str) -> None:
    from megatron.perf.schedules import bubble_fraction

    base = {(r["p"], r["m"], r["times"]): r["step"] for r in rows if r["schedule"] == "1f1b"}
    lines = ["# Pipeline schedules on stand-in layers (bench/pipeline_schedules.py)", "",
             f"This CPU: 2 cores, contended by other helpers' jobs (load average {load:.1f} at the start, 13-22 "
             f"during the run); p gloo ranks of 1 thread. Stand-in stages sleep F, B and W per micro-batch (unit "
             f"{1e3 * unit:.0f} ms), so the ranks behave like separate devices; the step is the median of {steps} "
             "(after one warm-up), slowest rank. Predicted: megatron/perf/schedules.py pipeline_time with the sleep "
             "times and no send time. Theory: the schedule's bubble share of the pipelined time. `1f1b` is "
             "DeepSpeed's engine (blocking sends), `1f1b-nb` the same order on our executor (non-blocking sends).",
             f"Command: `python bench/pipeline_schedules.py --unit {unit} --steps {steps}`.", "",
             "| p | m | F:B:W | schedule | step ms | vs 1F1B | predicted ms | measured / predicted | theory bubble |",
             "|---:|---:|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        t = r["times"]
        v = 2 if r["schedule"] == "interleaved" else 1
        name = "1f1b" if r["schedule"] == "1f1b-nb" else r["schedule"]
        theory = bubble_fraction(name, r["p"], r["m"], *t, v=v)
        lines.append(f"| {r['p']} | {r['m']} | {':'.join(f'{x / unit:g}' for x in t)} | {r['schedule']}"
                     f"{' v=2' if v > 1 else ''} | {1e3 * r['step']:.0f} | "
                     f"{r['step'] / base[(r['p'], r['m'], t)]:.3f} | {1e3 * r['predicted']:.0f} | "
                     f"{r['step'] / r['predicted']:.3f} | {theory:.3f} |")
    lines += ["", "Interleaved runs only where m is a multiple of p (the schedule's own requirement)."]
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


GPT = dict(num_layers=8, hidden_size=256, num_attention_heads=8, seq_length=128, vocab_size=1000,
           make_vocab_size_divisible_by=128, use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
           attention_backend="torch")


def _gpt_worker(steps: int, m: int) -> list[dict]:
    """The tiny GPT at PP=2 (bench/pipeline.py's shape), 1F1B and ZB-H1 engines built side by side, stepped in
    turn so that load from other jobs hits both alike."""
    import deepspeed.comm as dist

    from megatron.config import ModelConfig, OptimizerConfig, ParallelConfig, RunConfig, TrainingConfig
    from megatron.core.parallel_state import ParallelState
    from megatron.data.mock_dataset import MockGPTDataset
    from megatron.engine import build_ds_config, initialize_engine
    from megatron.initialize import initialize_distributed
    from megatron.model.gpt_model_pipe import GPTModelPipe
    from megatron.training.batches import microbatches
    from megatron.training.pipe_step import pipe_microbatches, pipe_train_step

    initialize_distributed("gloo")
    runs = {}
    for name, flags in (("1f1b", {}), ("zbh1", {"enable_zbh1_pipeline": True})):
        run = RunConfig(model=ModelConfig(**GPT),
                        parallel=ParallelConfig(world_size=2, pipeline_model_parallel_size=2, zero_stage=1, **flags),
                        optimizer=OptimizerConfig(lr=1e-4, clip_grad=1.0),
                        training=TrainingConfig(micro_batch_size=1, global_batch_size=m, train_iters=steps + 1))
        state = ParallelState.build(1, 2)
        model = GPTModelPipe(run.model, state, defer_weight_grads=name == "zbh1")
        engine = initialize_engine(model, run, state, build_ds_config(run))
        data = pipe_microbatches(microbatches(MockGPTDataset(10**6, GPT["seq_length"], GPT["vocab_size"]), 0, 1,
                                              state.dp.rank, state.dp.size, "cpu"))
        runs[name] = (engine, data, [])
    for i in range(steps + 1):
        for engine, data, times in runs.values():
            dist.barrier()
            t0 = time.perf_counter()
            pipe_train_step(engine, data)
            if i:
                times.append(time.perf_counter() - t0)
    return [{"schedule": k, "step": statistics.median(t), "steps": t} for k, (_, _, t) in runs.items()]


def gpt(steps: int, m: int) -> list[str]:
    from tests.launch import run_distributed

    ranks = run_distributed(_gpt_worker, world_size=2, timeout=1800, steps=steps, m=m)
    step = {r["schedule"]: max(rank[i]["step"] for rank in ranks) for i, r in enumerate(ranks[0])}
    lines = ["", f"## Tiny GPT at PP=2, 1F1B and ZB-H1 stepped in turn ({m} micro-batches, median of {steps})", "",
             f"Real layers on this CPU (2 cores, contended): the split of the backward into B and W costs "
             f"{step['zbh1'] / step['1f1b']:.3f}x 1F1B's step here (1F1B {1e3 * step['1f1b']:.0f} ms, ZB-H1 "
             f"{1e3 * step['zbh1']:.0f} ms). Both ranks share 2 cores, so the bubble ZB-H1 fills is no idle time "
             "here: this row measures the split's overhead, not a speed-up. Model: "
             + ", ".join(f"{k}={GPT[k]}" for k in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"))
             + "."]
    print("\n".join(lines))
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="p=4, m=8 only; one line per schedule")
    ap.add_argument("--gpt", action="store_true", help="only the tiny GPT at PP=2, 1F1B and ZB-H1 in turn (appended "
                    "to --out)")
    ap.add_argument("--unit", type=float, default=0.1, help="seconds of F, B and W per micro-batch per stage (large "
                    "against the engine's per-instruction overhead on a loaded CPU)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--p", type=int, nargs="+", default=[2, 4, 8], help="pipeline sizes of the full grid")
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "RESULTS_pipeline_schedules.md"))
    args = ap.parse_args(argv)
    if args.check:
        check(args.unit, args.steps)
    elif args.gpt:
        lines = gpt(args.steps, 8)
        with open(args.out, "a") as f:
            f.write("\n".join(lines) + "\n")
    else:
        full(args.unit, args.steps, args.out, args.p)


if __name__ == "__main__":
    main()
