"""Single-process training throughput: our GPT (through the DeepSpeed engine, as pretrain_gpt.py runs it, and
as a bare module) against HF transformers' GPT2LMHeadModel with the same shape, batch and optimiser.

    python bench/throughput.py [--layers 4 --hidden 256 --heads 8 --seq 256 --vocab 8192 --batch 4 --steps 20]

Runs are interleaved round by round and the median step time is reported, so load from other processes on a
shared machine hits all contenders alike. Prints tokens/s, the ratio ours/HF, and MFU against a matmul peak
measured in this process.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def _ours(args):
    from megatron.core.parallel_state import single_process_state
    from megatron.model.gpt_model import GPTModel
    from megatron.config.sizes import named_model

    cfg = named_model("debug", num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                      seq_length=args.seq, vocab_size=args.vocab, make_vocab_size_divisible_by=128,
                      hidden_dropout=0.0, attention_dropout=0.0)
    return cfg, GPTModel(cfg, tp=single_process_state().tp, init_seed=1)


def _hf(args, padded_vocab):
    from transformers import GPT2Config, GPT2LMHeadModel

    conf = GPT2Config(vocab_size=padded_vocab, n_positions=args.seq, n_embd=args.hidden, n_layer=args.layers,
                      n_head=args.heads, activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0,
                      attn_pdrop=0.0, tie_word_embeddings=True, bos_token_id=None,
                      eos_token_id=None)
    return GPT2LMHeadModel(conf)


def _engine(model, cfg, args):
    import deepspeed

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29561")
    from megatron.config import OptimizerConfig, RunConfig, TrainingConfig
    from megatron.core.parallel_state import ParallelState
    from megatron.engine import build_ds_config, initialize_engine
    from megatron.initialize import initialize_distributed

    initialize_distributed("gloo")
    run = RunConfig(model=cfg, optimizer=OptimizerConfig(lr=1e-4, clip_grad=1.0),
                    training=TrainingConfig(micro_batch_size=args.batch, global_batch_size=args.batch,
                                            train_iters=10**6))
    deepspeed.utils.logger.setLevel("WARNING")
    return initialize_engine(model, run, ParallelState.build(1), build_ds_config(run))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    from megatron.perf.flops import iteration_flops
    from megatron.training.peak import measure_cpu_matmul_tflops
    from megatron.training.step import gpt_forward_step

    cfg, ours_raw = _ours(args)
    vocab = cfg.padded_vocab_size()
    hf = _hf(args, vocab)
    _, ours_ds_model = _ours(args)
    engine = _engine(ours_ds_model, cfg, args)
    opt_raw = torch.optim.AdamW(ours_raw.parameters(), lr=1e-4)
    opt_hf = torch.optim.AdamW(hf.parameters(), lr=1e-4)
    data = torch.randint(0, args.vocab, (args.batch, args.seq + 1))

    def step_engine():
        loss = gpt_forward_step(engine, {"text": data})
        engine.backward(loss)
        engine.step()

    def step_raw():
        opt_raw.zero_grad(set_to_none=True)
        gpt_forward_step(ours_raw, {"text": data}).backward()
        torch.nn.utils.clip_grad_norm_(ours_raw.parameters(), 1.0)
        opt_raw.step()

    def step_hf():
        opt_hf.zero_grad(set_to_none=True)
        hf(input_ids=data[:, :-1], labels=data[:, :-1]).loss.backward()  # HF shifts labels itself
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt_hf.step()

    contenders = {"ours (DeepSpeed engine)": step_engine, "ours (bare module)": step_raw, "HF GPT2LMHeadModel": step_hf}
    times = {k: [] for k in contenders}
    for _ in range(2):  # warm-up
        for fn in contenders.values():
            fn()
    for _ in range(args.steps):
        for name, fn in contenders.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)

    tokens = args.batch * args.seq
    flops = iteration_flops(cfg, args.batch, vocab).model
    peak = measure_cpu_matmul_tflops()
    print(f"shape: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, seq {args.seq}, vocab {vocab}, "
          f"batch {args.batch}, fp32, AdamW, clip 1.0, {args.threads} thread(s), median of {args.steps} steps")
    print(f"measured matmul peak of this process: {peak:.3f} TFLOP/s")
    print(f"{'contender':28s} {'ms/step':>9s} {'tokens/s':>10s} {'MFU':>7s}")
    rate = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        rate[name] = tokens / med
        print(f"{name:28s} {1000 * med:9.1f} {rate[name]:10.0f} {100 * flops / med / 1e12 / peak:6.1f}%")
    hf_rate = rate["HF GPT2LMHeadModel"]
    for name in ("ours (DeepSpeed engine)", "ours (bare module)"):
        print(f"ratio {name} / HF: {rate[name] / hf_rate:.3f}")
    from megatron.initialize import shutdown

    shutdown()


if __name__ == "__main__":
    main()
