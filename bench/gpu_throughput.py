"""Training throughput on one GPU, side by side in one run: ours through the real ``pretrain_gpt.py`` path
against HF transformers eager and HF + torch.compile, same shape, batch and optimizer.

    python bench/gpu_throughput.py [--models gpt2-1.3b llama-1b] [--steps 30] [--out build/gpu_throughput.md]
                                   [--log-dir DIR]   (each contender's full output: DIR/<model>_<contender>.log)

Contenders (each in its own process, so peak memory is its own):
- ours auto: ``pretrain_gpt.py`` as a user runs it (bf16, ZeRO-1, mock data), kernels chosen by measurement;
- ours torch kernels: the same with MEGATRON_KERNEL_SELECT=torch (the baseline ``auto`` must not lose to);
- ours --compile: the same as ours auto plus ``--compile``;
- HF eager / HF + torch.compile: ``GPT2LMHeadModel`` / ``LlamaForCausalLM``, bf16 autocast over fp32 weights,
  SDPA attention, torch AdamW(fused=True), clip 1.0 — the issue's baseline.
Defaults follow the issue: seq 2048, micro-batch 4, global batch 8 (2 accumulation steps), dropout 0 on
both sides (dropout would force our attention onto torch). MFU uses one FLOP formula for everyone
(megatron/perf/flops.py, with the padded vocab both sides use) against the device's datasheet bf16 peak.
tokens/s is the median over log windows after the warm-up (which includes autotuning, the kernel
measurement and compilation). Without a GPU it prints one line and exits with status 2.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_env  # noqa: E402

MODELS = {
    # name -> (our pretrain_gpt.py shape flags, ModelConfig fields for the FLOP formula and HF)
    "gpt2-1.3b": (["--model-size", "gpt-1.3b", "--vocab-size", "50257"],
                  dict(kind="gpt2", num_layers=24, hidden_size=2048, num_attention_heads=16, vocab_size=50257)),
    "llama-1b": (["--model-size", "llama-7b", "--num-layers", "16", "--hidden-size", "2048", "--num-attention-heads",
                  "16", "--num-key-value-heads", "4", "--ffn-hidden-size", "5504", "--vocab-size", "32000"],
                 dict(kind="llama", num_layers=16, hidden_size=2048, num_attention_heads=16, num_key_value_heads=4,
                      ffn_hidden_size=5504, vocab_size=32000)),
    # Not a default: the CPU twin of tests/gpu/quick.sh's speed step (and a smoke test of this file's paths).
    "gpt2-tiny": (["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--vocab-size", "500"],
                  dict(kind="gpt2", num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=500)),
}
DEFAULT_MODELS = ["gpt2-1.3b", "llama-1b"]
_TOKENS = re.compile(r"tokens per second: ([0-9.]+)")
_MEM = re.compile(r"mem \(GB\): ([0-9.]+)")


def model_config(name: str, seq: int):
    from megatron.config.sizes import named_model

    f = dict(MODELS[name][1])
    kind = f.pop("kind")
    base = "gpt-1.3b" if kind == "gpt2" else "llama-7b"
    return named_model(base, seq_length=seq, max_position_embeddings=seq, **f)


def flops_per_token(cfg) -> float:
    from megatron.perf.flops import iteration_flops

    return iteration_flops(cfg, 1).model / cfg.seq_length


# --- ours: pretrain_gpt.py ------------------------------------------------------------------------------


def ours_flags(name: str, args, extra_flags: list[str]) -> list[str]:
    """pretrain_gpt.py's arguments for one contender (tests parse them with megatron.arguments)."""
    return [*MODELS[name][0],
           "--seq-length", str(args.seq), "--max-position-embeddings", str(args.seq),
           "--micro-batch-size", str(args.micro_batch), "--global-batch-size", str(args.global_batch),
           "--bf16", "--zero-stage", "1", "--mock-data", "--lr", "1e-4", "--clip-grad", "1.0",
           "--weight-decay", "0.01", "--hidden-dropout", str(args.dropout), "--attention-dropout", str(args.dropout),
           "--train-iters", str(args.steps), "--log-interval", str(args.log_interval), "--eval-iters", "0",
           "--eval-interval", str(10**6), "--peak-tflops", str(args.peak), *extra_flags]


def save_log(args, name: str, who: str, proc: subprocess.CompletedProcess) -> None:
    """A contender's whole output into --log-dir (when set), for what its one-line error leaves out."""
    if args.log_dir:
        slug = "".join(c if c.isalnum() else "-" for c in who).strip("-")
        with open(os.path.join(args.log_dir, f"{name}_{slug}.log"), "w") as f:
            f.write(f"$ {' '.join(proc.args)}\n{proc.stdout}\n{proc.stderr}")


def run_ours(name: str, args, env_extra: dict, extra_flags: list[str], who: str = "ours") -> dict:
    cmd = [sys.executable, os.path.join(gpu_env.REPO, "pretrain_gpt.py"), *ours_flags(name, args, extra_flags)]
    env = dict(os.environ, **env_extra)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=gpu_env.REPO, timeout=args.timeout)
    save_log(args, name, who, proc)
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}"}
    text = proc.stdout + proc.stderr
    windows = [float(x) for x in _TOKENS.findall(text)][args.skip_windows:]
    mems = [float(x) for x in _MEM.findall(text)]
    if not windows:
        return {"error": "no log windows after the warm-up: raise --steps"}
    return {"tokens_per_s": statistics.median(windows), "peak_mem_gb": max(mems) if mems else float("nan")}


# --- HF: a worker process ---------------------------------------------------------------------------------


def hf_worker(name: str, compiled: bool, args) -> dict:
    import torch
    from deepspeed.accelerator import get_accelerator

    cfg = model_config(name, args.seq)
    vocab = cfg.padded_vocab_size()  # the same padded vocab (and FLOPs) as ours
    dev = gpu_env.device()
    if MODELS[name][1]["kind"] == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        conf = GPT2Config(vocab_size=vocab, n_positions=args.seq, n_embd=cfg.hidden_size, n_layer=cfg.num_layers,
                          n_head=cfg.num_attention_heads, activation_function="gelu", resid_pdrop=args.dropout,
                          embd_pdrop=args.dropout, attn_pdrop=args.dropout, tie_word_embeddings=True)
        model = GPT2LMHeadModel._from_config(conf, attn_implementation="sdpa")
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        conf = LlamaConfig(vocab_size=vocab, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
                           num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
                           num_key_value_heads=cfg.num_key_value_heads, max_position_embeddings=args.seq,
                           rms_norm_eps=1e-5, tie_word_embeddings=False, attention_dropout=args.dropout)
        model = LlamaForCausalLM._from_config(conf, attn_implementation="sdpa")
    model.to(dev).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    step_model = torch.compile(model) if compiled else model
    gas = args.global_batch // args.micro_batch
    g = torch.Generator(device=dev).manual_seed(0)
    batches = [torch.randint(0, cfg.vocab_size, (args.micro_batch, args.seq), device=dev, generator=g)
               for _ in range(gas)]
    acc = get_accelerator()

    def step() -> None:
        for x in batches:
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                loss = step_model(input_ids=x, labels=x).loss / gas
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    warm = args.skip_windows * args.log_interval
    for _ in range(warm):
        step()
    acc.synchronize()
    acc.reset_peak_memory_stats()
    windows = []
    for _ in range(max(1, (args.steps - warm) // args.log_interval)):
        t0 = time.perf_counter()
        for _ in range(args.log_interval):
            step()
        acc.synchronize()
        windows.append(args.global_batch * args.seq * args.log_interval / (time.perf_counter() - t0))
    return {"tokens_per_s": statistics.median(windows), "peak_mem_gb": acc.max_memory_allocated() / 1e9}


def run_hf(name: str, compiled: bool, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--hf-worker", name, *(["--hf-compile"] if compiled else []),
           "--seq", str(args.seq), "--micro-batch", str(args.micro_batch), "--global-batch", str(args.global_batch),
           "--steps", str(args.steps), "--log-interval", str(args.log_interval), "--skip-windows",
           str(args.skip_windows), "--dropout", str(args.dropout), "--peak-tflops", str(args.peak)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=gpu_env.REPO, timeout=args.timeout)
    save_log(args, name, "HF + torch.compile" if compiled else "HF eager", proc)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}"}
    return json.loads(lines[-1])


CONTENDERS = {
    "ours auto": lambda n, a: run_ours(n, a, {}, [], "ours auto"),
    "ours torch kernels": lambda n, a: run_ours(n, a, {"MEGATRON_KERNEL_SELECT": "torch"}, [], "ours torch kernels"),
    "ours --compile": lambda n, a: run_ours(n, a, {}, ["--compile"], "ours --compile"),
    "HF eager": lambda n, a: run_hf(n, False, a),
    "HF + torch.compile": lambda n, a: run_hf(n, True, a),
}


def report(name: str, results: dict[str, dict], args) -> str:
    fpt = flops_per_token(model_config(name, args.seq))
    ref = results.get("HF + torch.compile", {}).get("tokens_per_s")
    out = [f"### {name}: seq {args.seq}, micro-batch {args.micro_batch}, global batch {args.global_batch}, bf16, "
           f"dropout {args.dropout}", "",
           "| contender | tokens/s | MFU | peak mem (GB) | vs HF + compile |", "|---|---|---|---|---|"]
    for who, r in results.items():
        if "error" in r:
            out.append(f"| {who} | failed: {r['error']} | | | |")
            continue
        tps = r["tokens_per_s"]
        ratio = f"{tps / ref:.2f}x" if ref else "n/a"
        out.append(f"| {who} | {tps:,.0f} | {100 * tps * fpt / (args.peak * 1e12):.1f}% | {r['peak_mem_gb']:.1f} | "
                   f"{ratio} |")
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=DEFAULT_MODELS)
    p.add_argument("--contenders", nargs="+", choices=list(CONTENDERS), default=list(CONTENDERS))
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--log-interval", type=int, default=5)
    p.add_argument("--skip-windows", type=int, default=2, help="log windows dropped as warm-up")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--peak-tflops", dest="peak", type=float, default=None)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", default=None)
    p.add_argument("--log-dir", default=None, help="write each contender's whole output here")
    p.add_argument("--hf-worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--hf-compile", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv=None) -> None:
    gpu_env.require_gpu("bench/gpu_throughput.py")
    args = build_parser().parse_args(argv)
    args.peak, peak_src = gpu_env.peak_tflops(args.peak)
    if args.hf_worker:
        print(json.dumps(hf_worker(args.hf_worker, args.hf_compile, args)))
        return
    text = [f"bench/gpu_throughput.py: {gpu_env.header()}; MFU peak {args.peak} TFLOP/s ({peak_src})", ""]
    for name in args.models:
        results = {}
        for who in args.contenders:
            print(f"running {name}: {who}", file=sys.stderr, flush=True)
            results[who] = CONTENDERS[who](name, args)
        text += [report(name, results, args), ""]
    print("\n".join(text))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(text))


if __name__ == "__main__":
    main()
