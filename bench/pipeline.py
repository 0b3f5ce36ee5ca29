"""Pipeline benchmark on 2 processes: tokens/s of PP=2 vs PP=1 (DP=2) at the same global batch, and the
measured 1F1B bubble against the analytic (p - 1) / (m + p - 1).

    python bench/pipeline.py [--steps 4] [--microbatches 2 4 8 16] [--out bench/RESULTS_pipeline.md]

Bubble, measured per stage on the fastest step: 1 - (time in forward + backward passes) / (time of the
pipelined part of train_batch, i.e. minus the gradient reductions and the optimizer step). Everything that
is not compute counts as bubble, including the gloo send/recv between stages and waiting on a slower stage.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

SHAPE = dict(num_layers=8, hidden_size=256, num_attention_heads=8, seq_length=128, vocab_size=1000,
             make_vocab_size_divisible_by=128, use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
             attention_backend="torch")
MBS = 2


def _run_config(world: int, pp: int, gbs: int, steps: int):
    from megatron.config import ModelConfig, OptimizerConfig, ParallelConfig, RunConfig, TrainingConfig

    return RunConfig(model=ModelConfig(**SHAPE),
                     parallel=ParallelConfig(world_size=world, pipeline_model_parallel_size=pp, zero_stage=1),
                     optimizer=OptimizerConfig(lr=1e-4, clip_grad=1.0),
                     training=TrainingConfig(micro_batch_size=MBS, global_batch_size=gbs, train_iters=steps))


def _timed(fn, acc: dict, key: str):
    def wrapper(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = fn(self, *args, **kwargs)
        acc[key] += time.perf_counter() - t0
        return out

    return wrapper


class _Layout:
    """One engine on this rank (PP=1 x DP=2 or PP=2), instrumented to time its pipeline instructions."""

    def __init__(self, pp: int, gbs: int, steps: int) -> None:
        import deepspeed.comm as dist
        from deepspeed.runtime.pipe import schedule

        from megatron import ds_seams
        from megatron.core.parallel_state import ParallelState
        from megatron.data.mock_dataset import MockGPTDataset
        from megatron.engine import build_ds_config, initialize_engine
        from megatron.model.gpt_model import GPTModel
        from megatron.model.gpt_model_pipe import GPTModelPipe
        from megatron.training.batches import microbatches
        from megatron.training.pipe_step import pipe_microbatches

        run = _run_config(dist.get_world_size(), pp, gbs, steps)
        self.pp, self.state = pp, ParallelState.build(1, pp)
        model = GPTModelPipe(run.model, self.state) if pp > 1 else GPTModel(run.model, tp=self.state.tp)
        self.engine = initialize_engine(model, run, self.state, build_ds_config(run))
        self.data = microbatches(MockGPTDataset(10**6, SHAPE["seq_length"], SHAPE["vocab_size"]), 0, MBS,
                                 self.state.dp.rank, self.state.dp.size, "cpu")
        self.gas = run.training.grad_accumulation_steps(self.state.dp.size)
        self.acc = dict.fromkeys(("compute", "reduce_step"), 0.0)
        self.records: list[tuple[float, float, float]] = []
        if pp > 1:
            self.data = pipe_microbatches(self.data)
            timed = {schedule.ForwardPass: "compute", schedule.BackwardPass: "compute",
                     schedule.ReduceGrads: "reduce_step", schedule.ReduceTiedGrads: "reduce_step",
                     schedule.OptimizerStep: "reduce_step"}
            ds_seams.wrap_pipeline_instructions(  # only this engine is instrumented
                self.engine, lambda kind, fn: _timed(fn, self.acc, timed[kind]) if kind in timed else fn)

    def step(self, record: bool) -> None:
        import deepspeed.comm as dist

        from megatron.training.pipe_step import pipe_train_step
        from megatron.training.step import train_step

        self.acc.update(compute=0.0, reduce_step=0.0)
        dist.barrier()
        t0 = time.perf_counter()
        _ = pipe_train_step(self.engine, self.data) if self.pp > 1 else train_step(self.engine, self.data, self.gas)
        if record:
            self.records.append((time.perf_counter() - t0, self.acc["compute"], self.acc["reduce_step"]))

    def result(self) -> dict:
        # The fastest step is the one least disturbed by other jobs on the shared cores.
        step, compute, reduce_step = min(self.records)
        out = {"step_s": step, "stage": self.state.pp.rank, "m": self.gas}
        if self.pp > 1:
            out["bubble"] = 1.0 - compute / (step - reduce_step)
            out["compute_ms"] = 1e3 * compute
        return out


def _worker(steps: int, microbatches: list[int], warmup: int = 2) -> list[dict]:
    from megatron.initialize import initialize_distributed

    initialize_distributed("gloo")
    results = []
    for m in microbatches:
        gbs = m * MBS  # PP=2: m micro-batches per pipeline; PP=1 x DP=2: m/2 per rank, same global batch
        layouts = [_Layout(pp, gbs, warmup + steps) for pp in (1, 2)]
        for i in range(warmup + steps):  # alternate, so load from other jobs hits both layouts alike
            for layout in layouts:
                layout.step(record=i >= warmup)
        results += [{"pp": lay.pp, "gbs": gbs, **lay.result()} for lay in layouts]
    return results


def _recompute_rows() -> list[tuple[str, int]]:
    """Saved activation bytes of one micro-batch through the bench model, per recompute granularity."""
    import torch

    from megatron.config import ModelConfig
    from megatron.core.parallel_state import single_process_state
    from megatron.model.gpt_model import GPTModel
    from megatron.perf.saved_tensors import saved_activation_bytes

    rows = []
    for granularity in (None, "selective", "full"):
        torch.manual_seed(0)
        model = GPTModel(ModelConfig(**SHAPE, recompute_granularity=granularity), tp=single_process_state().tp)
        x, y = torch.randint(0, SHAPE["vocab_size"], (2, MBS, SHAPE["seq_length"]))
        rows.append((granularity or "none", saved_activation_bytes(model, lambda m=model, x=x, y=y: m(x, y).mean())))
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "RESULTS_pipeline.md"))
    args = ap.parse_args(argv)
    from tests.launch import run_distributed

    load = os.getloadavg()[0]
    ranks = run_distributed(_worker, world_size=2, timeout=1800, steps=args.steps, microbatches=args.microbatches)
    tokens = SHAPE["seq_length"]
    rows = []
    for i, r0 in enumerate(ranks[0]):
        r1 = ranks[1][i]
        step = max(r0["step_s"], r1["step_s"])
        row = {"pp": r0["pp"], "gbs": r0["gbs"], "m": r0["m"], "tok_s": r0["gbs"] * tokens / step,
               "step_ms": 1e3 * step}
        if r0["pp"] > 1:
            row["bubble"] = (r0["bubble"], r1["bubble"])
            row["compute_ms"] = (r0["compute_ms"], r1["compute_ms"])
            row["analytic"] = (2 - 1) / (r0["m"] + 2 - 1)
        rows.append(row)
    lines = _report(rows, args, load) + _recompute_report(_recompute_rows())
    print("\n".join(lines))
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")


def _report(rows: list[dict], args, load: float) -> list[str]:
    shape = ", ".join(f"{k}={v}" for k, v in SHAPE.items() if k in ("num_layers", "hidden_size", "num_attention_heads",
                                                                     "seq_length", "vocab_size"))
    lines = ["# Pipeline parallelism (bench/pipeline.py)", "",
             f"2 processes (gloo, 1 thread each) on the shared 2-core development VM, CPU only, fp32, ZeRO-1. Load "
             f"average {load:.1f} at the start (other engineers' jobs share the cores, so absolute figures are noisy)."
             f" Model: {shape}; micro-batch {MBS}; the fastest of {args.steps} timed steps (after 2 warm-up "
             "steps) on each rank, the slower rank's time counting.",
             f"Command: `nice -n 5 python bench/pipeline.py --steps {args.steps} --microbatches "
             f"{' '.join(map(str, args.microbatches))}`.", "",
             "## Throughput at the same global batch: PP=2 vs PP=1 (DP=2)", "",
             "| global batch | PP=1 x DP=2 tokens/s | PP=2 tokens/s | PP=2 / PP=1 |", "|---:|---:|---:|---:|"]
    by = {(r["gbs"], r["pp"]): r for r in rows}
    for gbs in sorted({r["gbs"] for r in rows}):
        a, b = by[(gbs, 1)], by[(gbs, 2)]
        lines.append(f"| {gbs} | {a['tok_s']:,.0f} | {b['tok_s']:,.0f} | {b['tok_s'] / a['tok_s']:.2f} |")
    lines += ["", "## 1F1B bubble, PP=2: measured vs analytic (p - 1) / (m + p - 1)", "",
              "| micro-batches m | analytic | measured stage 0 | measured stage 1 | step (ms) "
              "| compute ms stage 0 / 1 |",
              "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["pp"] > 1:
            lines.append(f"| {r['m']} | {r['analytic']:.3f} | {r['bubble'][0]:.3f} | {r['bubble'][1]:.3f} | "
                         f"{r['step_ms']:.0f} | {r['compute_ms'][0]:.0f} / {r['compute_ms'][1]:.0f} |")
    return lines


def _recompute_report(rows: list[tuple[str, int]]) -> list[str]:
    base = rows[0][1]
    lines = ["", "## Activation recompute: bytes autograd keeps for the backward (one micro-batch, 8 layers)", "",
             "| --recompute-granularity | saved MiB | vs none |", "|---|---:|---:|"]
    lines += [f"| {name} | {b / 2**20:.2f} | {b / base:.3f} |" for name, b in rows]
    return lines


if __name__ == "__main__":
    main()
