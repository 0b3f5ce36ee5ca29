"""Ours against upstream Megatron-DeepSpeed on this CPU, side by side in one run: time per iteration of
pretrain_gpt.py from each tree with the same data, flags and DeepSpeed JSON, at TP=1 and TP=2.

    python bench/peer.py --upstream build/upstream [--tp 1 2 --layers 4 --hidden 256 --heads 8 --seq 256
                         --batch 4 --iters 10 --rounds 1 --results bench/RESULTS.md]

``--upstream`` (or $MEGATRON_DEEPSPEED_DIR): a Megatron-DeepSpeed checkout prepared for CPU by
../shared/upstream/setup.sh (its pydeps/ and C++ helpers built). Without one the script says so and exits 0.
Data: the demo corpus (1 MB), a byte-level BPE of --vocab tokens and our preprocess_data.py, built once under
--work. Each run logs every iteration; the median "elapsed time per iteration" after --skip warm-up iterations is
reported (both trees print that line). Runs alternate ours/upstream per round, so load from other processes hits
both alike; the load average before and after goes into the report.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ITER = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+)"
                   r".*?lm loss: ([0-9.E+-]+)")


def _data(work: str, vocab: int, py: str) -> tuple[str, list[str]]:
    prefix, tok = os.path.join(work, "peer"), os.path.join(work, "tokenizer")
    corpus = os.path.join(work, "corpus.jsonl")
    steps = [
        ([py, "tools/make_demo_corpus.py", "--output", corpus, "--max-bytes", "1000000"], corpus),
        ([py, "tools/train_tokenizer.py", "--input", corpus, "--vocab-size", str(vocab), "--output-dir", tok],
         os.path.join(tok, "merges.txt")),
        ([py, "tools/preprocess_data.py", "--input", corpus, "--json-keys", "text", "--append-eod", "--workers", "1",
          "--output-prefix", prefix, "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
          os.path.join(tok, "vocab.json"), "--merge-file", os.path.join(tok, "merges.txt")],
         prefix + "_text_document.idx"),
    ]
    for cmd, made in steps:
        if not os.path.exists(made):
            subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
    flags = ["--data-path", prefix + "_text_document", "--split", "100,0,0", "--tokenizer-type", "GPT2BPETokenizer",
             "--vocab-file", os.path.join(tok, "vocab.json"), "--merge-file", os.path.join(tok, "merges.txt")]
    return work, flags


def _flags(a, data: list[str], tp: int, ds_json: str, cache: str) -> list[str]:
    iters = a.iters
    return ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden), "--num-attention-heads", str(a.heads),
            "--seq-length", str(a.seq), "--max-position-embeddings", str(a.seq), "--micro-batch-size", str(a.batch),
            "--global-batch-size", str(a.batch), "--train-iters", str(iters), "--lr", "1e-4", "--min-lr", "1e-5",
            "--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--weight-decay", "0.01", "--clip-grad", "1.0",
            "--hidden-dropout", "0", "--attention-dropout", "0", *data, "--make-vocab-size-divisible-by", "128",
            "--log-interval", "1", "--eval-iters", "0", "--eval-interval", str(iters + 1), "--seed", "1234",
            "--tensor-model-parallel-size", str(tp), "--zero-stage", "1", "--deepspeed", "--deepspeed_config", ds_json,
            "--distributed-backend", "gloo", "--data-cache-path", cache]


def _run(tree: str, script: str, flags: list[str], nproc: int, env: dict, port: int, timeout: int) -> dict[int, tuple]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(port),
           script, *flags]
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    got = {int(m.group(1)): (float(m.group(2)), float(m.group(3))) for m in _ITER.finditer(out)}
    if proc.returncode != 0 or not got:
        tail = "\n".join(out.splitlines()[-15:])
        raise SystemExit(f"error: {script} in {tree} failed (exit {proc.returncode}):\n{tail}")
    return got


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--upstream", default=os.environ.get("MEGATRON_DEEPSPEED_DIR"),
                   help="Megatron-DeepSpeed prepared by setup.sh (default $MEGATRON_DEEPSPEED_DIR)")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--skip", type=int, default=2, help="warm-up iterations left out of the median")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--work", default=os.path.join(REPO, "build", "peer"))
    p.add_argument("--timeout", type=int, default=1200)
    p.add_argument("--results", default=None, help="append the report to this markdown file")
    a = p.parse_args(argv)
    if not a.upstream:
        print("bench/peer.py: no upstream checkout given (--upstream or $MEGATRON_DEEPSPEED_DIR): nothing to compare")
        return 0
    up = os.path.abspath(a.upstream)
    if not os.path.isfile(os.path.join(up, "pretrain_gpt.py")) or not os.path.isdir(os.path.join(up, "pydeps")):
        raise SystemExit(f"error: --upstream {up} is not a Megatron-DeepSpeed tree prepared by setup.sh "
                         "(pretrain_gpt.py and pydeps/ expected)")
    if a.iters <= a.skip:
        raise SystemExit(f"error: --iters {a.iters} must exceed --skip {a.skip}")
    os.makedirs(a.work, exist_ok=True)
    _, data = _data(a.work, a.vocab, sys.executable)
    ds_json = os.path.join(a.work, "ds_zero1.json")
    with open(ds_json, "w") as f:
        json.dump({"train_batch_size": a.batch, "train_micro_batch_size_per_gpu": a.batch, "gradient_clipping": 1.0,
                   "zero_optimization": {"stage": 1}, "steps_per_print": 10**6, "wall_clock_breakdown": False}, f)
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    base["OMP_NUM_THREADS"] = base.get("OMP_NUM_THREADS", "1")
    commit = open(os.path.join(up, "UPSTREAM_COMMIT")).read().strip() if os.path.isfile(
        os.path.join(up, "UPSTREAM_COMMIT")) else "unknown"
    ours_commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                 text=True).stdout.strip() or "unknown"
    load0 = os.getloadavg()
    times: dict[tuple[str, int], list[float]] = {}
    final_loss: dict[tuple[str, int], float] = {}
    port = 29700
    for _ in range(a.rounds):
        for tp in a.tp:
            for who in ("ours", "upstream"):
                port += 1
                cache = os.path.join(a.work, f"cache-{who}")
                flags = _flags(a, data, tp, ds_json, cache)
                if who == "ours":
                    got = _run(REPO, "pretrain_gpt.py", flags, tp, base, port, a.timeout)
                else:  # upstream's CPU needs (see ../shared/upstream/README.md)
                    env = {**base, "DS_ACCELERATOR": "cpu", "PYTHONPATH": os.path.join(up, "pydeps"),
                           "LOCAL_SIZE": str(tp)}
                    got = _run(up, "pretrain_gpt.py", flags + ["--no-gradient-accumulation-fusion",
                                                               "--no-masked-softmax-fusion"], tp, env, port, a.timeout)
                times.setdefault((who, tp), []).extend(t for i, (t, _) in sorted(got.items()) if i > a.skip)
                final_loss[(who, tp)] = got[max(got)][1]
    load1 = os.getloadavg()
    lines = [f"shape: {a.layers} layers, hidden {a.hidden}, {a.heads} heads, seq {a.seq}, vocab {a.vocab} (padded to "
             f"a multiple of 128 x TP), micro = global batch {a.batch}, fp32, ZeRO-1, Adam, clip 1.0, "
             f"OMP_NUM_THREADS={base['OMP_NUM_THREADS']}, median over iterations {a.skip + 1}-{a.iters} "
             f"x {a.rounds} round(s)",
             f"ours {ours_commit}; upstream Megatron-DeepSpeed {commit}; {os.cpu_count()} CPUs; load average "
             f"{load0[0]:.1f} before, {load1[0]:.1f} after",
             "TP | ours ms/iter | upstream ms/iter | ours / upstream | last loss ours / upstream",
             "---|---|---|---|---"]
    for tp in a.tp:
        o, u = statistics.median(times[("ours", tp)]), statistics.median(times[("upstream", tp)])
        lines.append(f"{tp} | {o:.1f} | {u:.1f} | {o / u:.3f} | {final_loss[('ours', tp)]:.4f} / "
                     f"{final_loss[('upstream', tp)]:.4f}")
    report = "\n\n".join(lines[:2]) + "\n\n" + "\n".join(lines[2:])  # two paragraphs, then the table
    print(report)
    if a.results:
        with open(a.results, "a") as f:
            f.write(f"\n## Peer run: ours vs upstream Megatron-DeepSpeed on CPU ({time.strftime('%Y-%m-%d')}, "
                    "bench/peer.py)\n\n" + report + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
