"""Data-pipeline benchmark: preprocess_data throughput (docs/s per worker), sample-index build time for 1e8
tokens of synthetic documents (C++ helper vs the numpy reference), and the whole GPT index build (doc_idx,
sample_idx, shuffle_idx) in upstream's order against the former per-epoch order, side by side in one run.

    python bench/data_pipeline.py [--docs 20000] [--workers 1 2] [--tokens 1e8] [--only-index]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import numpy as np  # noqa: E402

from megatron.data import helpers, index_build  # noqa: E402
from megatron.data.reference import build_sample_idx_numpy  # noqa: E402
from megatron.data.upstream_cache import check_upstream_arrays  # noqa: E402


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(f"tools_{name}", os.path.join(REPO, "tools", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def synthetic_corpus(path: str, docs: int, seed: int = 0) -> int:
    """English-like documents of 50-400 words from a Zipf-ish vocabulary; returns the file size in bytes."""
    rng = random.Random(seed)
    words = ["".join(rng.choice("etaoinshrdlucmfwypvbgkqjxz") for _ in range(rng.randint(2, 9))) for _ in range(5000)]
    weights = [1.0 / (i + 1) for i in range(len(words))]
    with open(path, "w") as f:
        for _ in range(docs):
            text = " ".join(rng.choices(words, weights, k=rng.randint(50, 400)))
            f.write(json.dumps({"text": text.capitalize() + "."}) + "\n")
    return os.path.getsize(path)


def bench_preprocess(docs: int, workers: list[int], tmp: str) -> list[str]:
    corpus = os.path.join(tmp, "corpus.jsonl")
    size = synthetic_corpus(corpus, docs)
    tok_dir = os.path.join(tmp, "tok")
    _tool("train_tokenizer").main(["--input", corpus, "--vocab-size", "8192", "--output-dir", tok_dir])
    pre = _tool("preprocess_data")
    lines = [f"corpus: {docs} docs, {size / 1e6:.1f} MB; GPT2BPETokenizer (8192 tokens trained locally), --append-eod"]
    for w in workers:
        argv = ["--input", corpus, "--output-prefix", os.path.join(tmp, f"w{w}"), "--append-eod", "--workers", str(w)]
        argv += ["--tokenizer-type", "GPT2BPETokenizer", "--log-interval", str(10**9)]
        argv += [
            "--vocab-file",
            os.path.join(tok_dir, "vocab.json"),
            "--merge-file",
            os.path.join(tok_dir, "merges.txt"),
        ]
        stats = pre.preprocess(pre.get_args(argv))
        lines.append(
            f"preprocess --workers {w}: {stats.docs_per_second:,.0f} docs/s total, "
            f"{stats.docs_per_second / w:,.0f} docs/s per worker, {stats.bytes_read / 1e6 / stats.seconds:.2f} MB/s, "
            f"{stats.tokens / stats.seconds / 1e6:.2f} M tokens/s"
        )
    return lines


def _best_of(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_sample_idx(total_tokens: int, seq_lengths: list[int], repeats: int = 3) -> list[str]:
    rng = np.random.default_rng(0)
    # Document lengths spread like web text: many short, a long tail (mean ~1,000 tokens).
    sizes = np.clip(rng.lognormal(6.4, 0.9, size=int(total_tokens / 900)), 1, 200_000).astype(np.int32)
    sizes = sizes[: np.searchsorted(np.cumsum(sizes, dtype=np.int64), total_tokens) + 1]
    doc_idx = rng.permutation(len(sizes)).astype(np.int64)
    tokens = int(sizes.astype(np.int64).sum())
    lines = [f"sample index: {tokens:.3g} tokens in {len(sizes):,} synthetic documents (best of {repeats})"]
    for seq in seq_lengths:
        n = (tokens - 1) // seq
        got = helpers.build_sample_idx(sizes, doc_idx, seq, n)
        if not np.array_equal(got, build_sample_idx_numpy(sizes, doc_idx, seq, n)):
            raise SystemExit("C++ and numpy sample indices differ")
        t_cpp = _best_of(lambda seq=seq, n=n: helpers.build_sample_idx(sizes, doc_idx, seq, n), repeats)
        t_np = _best_of(lambda seq=seq, n=n: build_sample_idx_numpy(sizes, doc_idx, seq, n), repeats)
        lines.append(
            f"seq_length {seq:>5}: {n:>9,} samples  C++ {t_cpp * 1e3:8.2f} ms  numpy {t_np * 1e3:8.2f} ms  "
            f"numpy/C++ = {t_np / t_cpp:.2f}x"
        )
    return lines


def bench_index_build(total_tokens: int, seq_lengths: list[int], epochs: list[float], repeats: int = 9) -> list[str]:
    """Upstream's order (the default now) vs the per-epoch order (the default before, --per-epoch-doc-shuffle):
    the same build function the GPTDataset calls, alternated so both see the same machine load; best of repeats."""
    rng = np.random.default_rng(0)
    sizes = np.clip(rng.lognormal(6.4, 0.9, size=int(total_tokens / 900)), 1, 200_000).astype(np.int32)
    sizes = sizes[: np.searchsorted(np.cumsum(sizes, dtype=np.int64), total_tokens) + 1]
    documents = np.arange(len(sizes), dtype=np.int64)
    tokens = int(sizes.astype(np.int64).sum())
    lines = [f"index build: {tokens:.3g} tokens in {len(sizes):,} documents, doc_idx + sample_idx + shuffle_idx "
             f"(process CPU time, best of {repeats}, alternated)"]
    for seq in seq_lengths:
        for ep in epochs:
            n = int(ep * ((tokens - 1) // seq))
            best = {"upstream": float("inf"), "per-epoch": float("inf")}
            for _ in range(repeats):
                for name, fn in (("upstream", index_build.build_upstream_order),
                                 ("per-epoch", index_build.build_per_epoch_order)):
                    # CPU time of this process: the build is single-threaded, and on a shared machine wall time
                    # mostly measures the other jobs.
                    t0 = time.process_time()
                    fn(documents, sizes, n, seq, 1234)
                    best[name] = min(best[name], time.process_time() - t0)
            arrays = index_build.build_upstream_order(documents, sizes, n, seq, 1234)
            epochs_n = index_build.num_epochs(tokens, seq, n)
            check = float("inf")
            for _ in range(3):
                t0 = time.process_time()
                check_upstream_arrays(arrays, documents, sizes, n, seq, epochs_n)
                check = min(check, time.process_time() - t0)
            lines.append(f"seq_length {seq:>5}, {ep:>4} epochs ({n:>10,} samples): upstream order "
                         f"{best['upstream'] * 1e3:8.1f} ms  per-epoch order {best['per-epoch'] * 1e3:8.1f} ms  "
                         f"ratio {best['upstream'] / best['per-epoch']:.2f}x  (checking an upstream cache "
                         f"{check * 1e3:.1f} ms)")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--docs", type=int, default=20000)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--tokens", type=float, default=1e8)
    p.add_argument("--seq-lengths", type=int, nargs="+", default=[2048, 128])
    p.add_argument("--epochs", type=float, nargs="+", default=[1.0, 2.5])
    p.add_argument("--only-index", action="store_true", help="only the index-build comparison")
    args = p.parse_args()
    lines = []
    if not args.only_index:
        with tempfile.TemporaryDirectory() as tmp:
            lines = bench_preprocess(args.docs, args.workers, tmp)
        lines += bench_sample_idx(int(args.tokens), args.seq_lengths)
    lines += bench_index_build(int(args.tokens), args.seq_lengths, args.epochs)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
