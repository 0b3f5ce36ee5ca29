"""Confirm the planner's best layouts with short real runs: launch the top-k, parse the log's TFLOPs, rank them.

    python tools/tune_layout.py --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 \\
        --vocab-size 512 --gcds 2 --global-batch-size 8 --top-k 6 --train-iters 6 --log-interval 2

Each candidate runs ``pretrain_gpt.py --mock-data`` through the launcher (``torchrun --nproc-per-node N`` here; on
Frontier use ``--launcher "srun -n {n}"``). The measured figure is the training log's ``TFLOPs:`` (first log line
skipped as warm-up). That figure is printed with two decimals, which is 0.00 for tiny CPU models, so the table
also shows the same formula (megatron/perf/flops.py, as megatron/training/log.py uses) applied to the logged
iteration time, and ranks by that. ``--bayesian-trials N`` adds an optuna (optional dependency) search over the
whole layout space, each trial a real run, as the ORNL work did with DeepHyper.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.config import ModelConfig
from megatron.errors import ConfigError, run_cli
from megatron.perf.flops import iteration_flops
from megatron.perf.layout import Layout
from megatron.perf.planner import SearchSpace, enumerate_layouts, evaluate, plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOG_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+) \|.*?"
                      r"TFLOPs: ([\d.]+) \|")


@dataclass
class Trial:
    layout: str
    predicted_tflops: float
    """Planner's TFLOP/s per GCD on Frontier, recompute counted as the log counts it."""
    predicted_rank: int
    log_tflops: float | None = None
    """Mean of the log's ``TFLOPs:`` figures after the first log line."""
    measured_tflops: float | None = None
    """The log's formula on the mean logged iteration time (full precision)."""
    iteration_ms: float | None = None
    error: str | None = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_log(text: str) -> list[tuple[int, float, float]]:
    """(iteration, elapsed ms per iteration, TFLOPs) of every training log line."""
    return [(int(m[1]), float(m[2]), float(m[3])) for m in LOG_LINE.finditer(text)]


def measured_tflops(model: ModelConfig, layout: Layout, iteration_ms: float) -> float:
    """The training log's TFLOPs formula (hardware FLOPs, recompute counted) at full precision."""
    flops = iteration_flops(model, layout.global_batch_size, model.padded_vocab_size(layout.tp),
                            layout.recompute_granularity)
    return flops.total / (iteration_ms / 1000) / layout.world_size / 1e12


def command(model: ModelConfig, layout: Layout, args: argparse.Namespace) -> list[str]:
    launcher = shlex.split(args.launcher.format(n=layout.world_size, port=free_port()))
    cmd = launcher + [os.path.join(ROOT, "pretrain_gpt.py"),
                      "--num-layers", str(model.num_layers), "--hidden-size", str(model.hidden_size),
                      "--num-attention-heads", str(model.num_attention_heads), "--seq-length", str(model.seq_length),
                      "--vocab-size", str(model.vocab_size), "--mock-data",
                      "--tensor-model-parallel-size", str(layout.tp), "--pipeline-model-parallel-size", str(layout.pp),
                      "--micro-batch-size", str(layout.micro_batch_size),
                      "--global-batch-size", str(layout.global_batch_size), "--zero-stage", str(layout.zero_stage),
                      "--train-iters", str(args.train_iters), "--log-interval", str(args.log_interval),
                      "--eval-iters", "0", "--lr", "1e-4", "--seed", "1234"]
    if layout.sequence_parallel:
        cmd.append("--sequence-parallel")
    if layout.ulysses > 1:
        cmd += ["--ds-sequence-parallel-size", str(layout.ulysses)]
    if layout.recompute_granularity:
        cmd += ["--recompute-granularity", layout.recompute_granularity]
    if layout.dtype == "bf16":
        cmd.append("--bf16")
    return cmd


def run_trial(model: ModelConfig, layout: Layout, trial: Trial, args: argparse.Namespace) -> Trial:
    cmd = command(model, layout, args)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads_per_rank))
    try:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=args.timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        trial.error = f"timed out after {args.timeout:.0f} s"
        return trial
    points = parse_log(proc.stdout)[1:]  # the first interval includes warm-up
    if not points:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        trial.error = f"exit {proc.returncode}, no TFLOPs line after warm-up: {tail[0][:200]}"
        return trial
    trial.iteration_ms = sum(p[1] for p in points) / len(points)
    trial.log_tflops = sum(p[2] for p in points) / len(points)
    trial.measured_tflops = measured_tflops(model, layout, trial.iteration_ms)
    return trial


def ranked(trials: list[Trial]) -> list[Trial]:
    """Measured best first; failed runs last."""
    return sorted(trials, key=lambda t: (t.measured_tflops is None, -(t.measured_tflops or 0.0)))


def format_table(trials: list[Trial]) -> str:
    head = (f"{'rank':>4}  {'layout':<44} {'pred TFLOPs/GCD':>15} {'pred rank':>9} {'log TFLOPs':>10} "
            f"{'ms/iter':>9} {'measured TFLOPs':>15}")
    rows = [head, "-" * len(head)]
    for i, t in enumerate(ranked(trials), 1):
        if t.measured_tflops is None:
            rows.append(f"{i:>4}  {t.layout:<44} {t.predicted_tflops:>15.2f} {t.predicted_rank:>9}  failed: {t.error}")
            continue
        rows.append(f"{i:>4}  {t.layout:<44} {t.predicted_tflops:>15.2f} {t.predicted_rank:>9} "
                    f"{t.log_tflops:>10.2f} {t.iteration_ms:>9.1f} {t.measured_tflops:>15.6f}")
    return "\n".join(rows)


def rank_agreement(trials: list[Trial]) -> float:
    """Kendall's tau between the planner's and the measured order (1 = same order, -1 = reversed)."""
    ok = [t for t in trials if t.measured_tflops is not None]
    pairs = [(a, b) for i, a in enumerate(ok) for b in ok[i + 1:]]
    if not pairs:
        return float("nan")
    score = sum(1 if (a.predicted_tflops - b.predicted_tflops) * (a.measured_tflops - b.measured_tflops) > 0 else -1
                for a, b in pairs)
    return score / len(pairs)


def bayesian_search(model: ModelConfig, layouts: list[Layout], args: argparse.Namespace, done: dict) -> list[Trial]:
    """Optuna TPE over the valid layouts, each trial a real run; ``done`` caches runs by layout."""
    try:
        import optuna
    except ImportError:
        raise ConfigError("--bayesian-trials needs optuna: pip install optuna") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    by_name = {lay.describe(): lay for lay in layouts}
    names = sorted(by_name)

    def objective(t) -> float:
        name = t.suggest_categorical("layout", names)
        if name not in done:
            lay = by_name[name]
            st = evaluate(model, lay).time
            done[name] = run_trial(model, lay, Trial(name, st.tflops_per_gcd, -1), args)
        return done[name].measured_tflops or 0.0

    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=args.seed))
    study.optimize(objective, n_trials=args.bayesian_trials)
    return list(done.values())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-layers", type=int, required=True)
    p.add_argument("--hidden-size", type=int, required=True)
    p.add_argument("--num-attention-heads", type=int, required=True)
    p.add_argument("--seq-length", type=int, required=True)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--gcds", type=int, required=True, help="processes per run (one per GCD)")
    p.add_argument("--global-batch-size", type=int, required=True)
    p.add_argument("--top-k", type=int, default=6)
    p.add_argument("--micro-batch-sizes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--zero-stages", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--tp-sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--recompute", choices=["none", "full", "both"], default="both")
    p.add_argument("--pp-sizes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--ulysses-sizes", "--sp-sizes", type=int, nargs="+", default=[1],
                   help="DeepSpeed-Ulysses sizes to search (--ds-sequence-parallel-size), e.g. 1 2 4")
    p.add_argument("--bf16", action="store_true", help="run and predict in bf16 (default fp32, as on CPU)")
    p.add_argument("--train-iters", type=int, default=6)
    p.add_argument("--log-interval", type=int, default=2)
    torchrun = f"{shlex.quote(sys.executable)} -m torch.distributed.run --nproc-per-node {{n}} --master-port {{port}}"
    p.add_argument("--launcher", default=torchrun,
                   help="command prefix; {n} is the number of processes, {port} a free local port")
    p.add_argument("--threads-per-rank", type=int, default=1)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    p.add_argument("--bayesian-trials", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None, help="write the trials as JSON here")
    args = p.parse_args(argv)
    if args.log_interval * 2 > args.train_iters:
        raise ConfigError(f"--train-iters {args.train_iters} gives fewer than two log lines at --log-interval "
                          f"{args.log_interval}: the first is warm-up, so use at least {2 * args.log_interval}")
    return args


def main(argv: list[str] | None = None) -> list[Trial]:
    args = parse_args(argv)
    model = ModelConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                        num_attention_heads=args.num_attention_heads, seq_length=args.seq_length,
                        vocab_size=args.vocab_size)
    rc = {"none": (None,), "full": ("full",), "both": (None, "full")}[args.recompute]
    space = SearchSpace(tp=tuple(args.tp_sizes), micro_batch_size=tuple(args.micro_batch_sizes),
                        zero_stage=tuple(args.zero_stages), recompute_granularity=rc,
                        dtype="bf16" if args.bf16 else "fp32", pp=tuple(args.pp_sizes),
                        ds_sequence_parallel_size=tuple(args.ulysses_sizes))
    fitting, _ = plan(model, args.gcds, args.global_batch_size, space)
    top = fitting[:args.top_k]
    print(f"> {len(fitting)} layouts fit; running the planner's top {len(top)} "
          f"({args.train_iters} iterations each)", flush=True)
    done: dict[str, Trial] = {}
    for i, cand in enumerate(top, 1):
        name = cand.layout.describe()
        print(f"> [{i}/{len(top)}] {name}", flush=True)
        done[name] = run_trial(model, cand.layout, Trial(name, cand.time.tflops_per_gcd, i), args)
    trials = list(done.values())
    if args.bayesian_trials:
        trials = bayesian_search(model, enumerate_layouts(model, args.gcds, args.global_batch_size, space), args,
                                 done)
    print(format_table(trials))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump([asdict(t) for t in ranked(trials)], f, indent=1)
    best = ranked(trials)[0]
    print(f"rank agreement (Kendall tau, planner vs measured): {rank_agreement(trials):+.2f}")
    print(f"best measured: {best.layout} | TFLOPs per GCD: {best.measured_tflops}")
    return trials


def _cli(argv: list[str] | None = None) -> None:
    main(argv)


if __name__ == "__main__":
    sys.exit(run_cli(_cli))
