"""DeepSpeed-Ulysses on CPU/gloo: activation memory per rank at SP = 1, 2, 4 for a long sequence, measured
(saved-tensor bytes and torch.profiler's allocation peak of one forward + backward), beside the memory model.

    python bench/ulysses_memory.py --seq-length 4096 --hidden-size 128 --num-layers 4
"""

from __future__ import annotations

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-length", type=int, default=4096)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=512)
    args = p.parse_args(argv)

    from megatron.config.sizes import named_model
    from megatron.perf.layout import Layout
    from megatron.perf.memory import estimate_memory
    from tests.distributed.ulysses_probe import activation_memory
    from tests.launch import run_distributed

    kw = {"num_layers": args.num_layers, "hidden_size": args.hidden_size,
          "num_attention_heads": args.num_attention_heads, "seq_length": args.seq_length,
          "vocab_size": args.vocab_size}
    res = run_distributed(activation_memory, world_size=4, timeout=1200, ulysses_sizes=[1, 2, 4], model_kw=kw)
    model = named_model("debug", hidden_dropout=0.0, attention_dropout=0.0, make_vocab_size_divisible_by=64, **kw)
    print(f"model: {args.num_layers} layers, hidden {args.hidden_size}, {args.num_attention_heads} heads, "
          f"seq {args.seq_length}, vocab {args.vocab_size}, micro-batch 1, fp32, torch SDPA on CPU, 4 gloo ranks")
    print(f"{'SP':>3} {'saved MiB/rank':>15} {'vs SP=1':>8} {'peak MiB/rank':>14} {'vs SP=1':>8} "
          f"{'model act. MiB':>15}")
    base_saved, base_peak = max(r[1][0] for r in res), max(r[1][1] for r in res)
    for u in (1, 2, 4):
        saved, peak = max(r[u][0] for r in res), max(r[u][1] for r in res)  # the worst rank
        layout = Layout.of(tp=1, pp=1, dp=1, micro_batch_size=1, global_batch_size=1, zero_stage=0, dtype="fp32",
                           ds_sequence_parallel_size=u)
        t = estimate_memory(model, layout).terms
        pred = t["activations"] + t["embedding_activations"] + t["logits"]
        print(f"{u:>3} {saved / 2**20:15.2f} {saved / base_saved:8.3f} {peak / 2**20:14.2f} {peak / base_peak:8.3f} "
              f"{pred / 2**20:15.2f}")


if __name__ == "__main__":
    main()
