"""quick.sh steps ``speed`` and ``speed2``: bench/gpu_throughput.py's side-by-side run, its contenders one after the
other (each in its own process), results kept as each finishes.

GPU: GPT-2 1.3B, seq 2048, bf16, ZeRO-1, micro-batch 4, global batch 8, 16 steps: the first 8 are warm-up
(kernel measurement, autotuning, compilation), tokens/s is the median of the two 4-step windows after them; MFU
against the device's datasheet bf16 peak. ``speed``: ours auto, ours torch kernels, HF + torch.compile (the
issue's goals: auto >= 1.10x HF + compile, auto >= torch kernels); ``speed2``: ours --compile and HF eager,
beside ``speed``'s results when those exist.
CPU twin: the bench's tiny GPT-2, ours auto, ours torch kernels and HF eager (in this process: the bench's worker
refuses to start without a GPU); torch.compile and --compile are left to the GPU, and the goals to GPU timings.
"""

from __future__ import annotations

import os
import subprocess
import sys

from tests.gpu.quick.common import BENCH, StepArgs, step_args
from tests.gpu.quick.summary import read_result

sys.path.insert(0, BENCH)  # bench/ is no package: its modules import each other by name
import gpu_env  # noqa: E402
import gpu_throughput as gt  # noqa: E402

GPU = ("gpt2-1.3b", ["--steps", "16", "--log-interval", "4", "--skip-windows", "2"])
CPU = ("gpt2-tiny", ["--seq", "64", "--micro-batch", "2", "--global-batch", "4", "--steps", "6", "--log-interval", "2",
                     "--skip-windows", "1"])
CONTENDERS = {"speed": ["ours auto", "ours torch kernels", "HF + torch.compile"],
              "speed2": ["ours --compile", "HF eager"]}
CPU_CONTENDERS = {"speed": [*CONTENDERS["speed"], "HF eager"], "speed2": ["ours --compile"]}
CPU_SKIP = {"HF + torch.compile": "torch.compile on CPU spends minutes compiling C++; measured on a GPU only",
            "ours --compile": "pretrain_gpt.py ignores --compile on CPU (accelerators only)"}
GOALS = (("ours auto", "HF + torch.compile", 1.10), ("ours auto", "ours torch kernels", 1.0))


def run_one(model: str, who: str, args, gpu: bool) -> dict:
    try:
        if not gpu and who == "HF eager":
            return gt.hf_worker(model, False, args)
        return gt.CONTENDERS[who](model, args)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout:.0f} s"}


def describe(results: dict[str, dict], mfu: dict[str, float], gpu: bool) -> str:
    """One line: each contender's tokens/s, MFU and memory, then the goals' ratios (judged on a GPU only)."""
    parts = []
    for who, r in results.items():
        if "error" in r:
            parts.append(f"{who} FAILED: {r['error']}")
        elif "skipped" in r:
            parts.append(f"{who} skipped ({r['skipped']})")
        else:
            parts.append(f"{who} {r['tokens_per_s']:,.0f} tok/s, MFU {mfu[who]:.1f}%, {r['peak_mem_gb']:.1f} GB")
    for a, b, goal in GOALS:
        if "tokens_per_s" in results.get(a, {}) and "tokens_per_s" in results.get(b, {}):
            ratio = results[a]["tokens_per_s"] / results[b]["tokens_per_s"]
            verdict = ("met" if ratio >= goal else "NOT met") if gpu else "not judged on CPU"
            parts.append(f"{a} / {b} {ratio:.2f}x (goal >= {goal:.2f}: {verdict})")
    return "; ".join(parts)


def main(a: StepArgs) -> None:
    model, argv = GPU if a.gpu else CPU
    args = gt.build_parser().parse_args([*argv, "--models", model, "--log-dir", a.out])
    if a.gpu:
        args.peak, peak_src = gpu_env.peak_tflops(None)
    else:
        args.peak, peak_src = 1.0, "nominal 1 TFLOP/s: MFU means nothing on CPU"
    fpt = gt.flops_per_token(gt.model_config(model, args.seq))
    earlier = read_result(a.out, "speed") if a.step == "speed2" else None
    results = dict(earlier["metrics"]["results"]) if earlier else {}
    mine = (CONTENDERS if a.gpu else CPU_CONTENDERS)[a.step]

    def record() -> None:  # after each contender: a step cut off by its timeout keeps what it measured
        mfu = {w: 100 * r["tokens_per_s"] * fpt / (args.peak * 1e12) for w, r in results.items() if "tokens_per_s" in r}
        kinds = {"error" if "error" in results[w] else "skipped" if "skipped" in results[w] else "measured"
                 for w in mine if w in results}
        status = "failed" if "error" in kinds else "skipped" if kinds == {"skipped"} else "passed"
        detail = ("; ".join(f"{w}: {results[w]['skipped']}" for w in mine) if status == "skipped"
                  else describe(results, mfu, a.gpu))
        a.result(status, detail, model=model, peak_tflops=args.peak, peak_source=peak_src,
                 results=results, mfu_pct=mfu)

    for who in mine:
        if not a.gpu and who in CPU_SKIP:
            results[who] = {"skipped": CPU_SKIP[who]}
        else:
            args.timeout = max(a.left(), 1.0)
            results[who] = run_one(model, who, args, a.gpu)
        record()
    if not any("tokens_per_s" in results[w] for w in mine):
        return  # nothing of this step's own to tabulate
    table = gt.report(model, {w: r for w, r in results.items() if "skipped" not in r}, args)
    with open(os.path.join(a.out, f"{a.step}.md"), "w") as f:
        f.write(f"{gpu_env.header() if a.gpu else 'CPU twin (tiny GPT-2)'}; MFU peak {args.peak} ({peak_src})\n\n"
                f"{table}\n")


if __name__ == "__main__":
    main(step_args())
