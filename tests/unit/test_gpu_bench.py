"""bench/gpu_kernels.py and bench/gpu_throughput.py without a GPU: one line and exit status 2; and the
parts that need no GPU (our pretrain_gpt.py flags parse to the issue's shapes, the report's MFU uses
megatron/perf/flops.py, the kernel table's 'auto keeps' and ratios)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "bench"))


@pytest.fixture
def no_gpu():
    """Asked when the test runs, not at import: no test module probes the machine while being collected."""
    if torch.accelerator.is_available():
        pytest.skip("a GPU is present: the benches would run")


@pytest.mark.usefixtures("no_gpu")
@pytest.mark.parametrize("script", ["gpu_kernels.py", "gpu_throughput.py"])
def test_without_a_gpu_one_line_and_status_2(script):
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", script)], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert proc.returncode == 2
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(lines) == 1 and "a GPU is needed" in lines[0]


def test_our_flags_give_the_issue_shapes_and_one_flop_formula():
    import gpu_throughput as gt

    from megatron.arguments import model_config_from_args, parse_args
    from megatron.perf.flops import iteration_flops

    args = gt.build_parser().parse_args(["--peak-tflops", "989"])
    args.peak = 989.0
    for name, want in (("gpt2-1.3b", dict(num_layers=24, hidden_size=2048, num_key_value_heads=16, swiglu=False)),
                       ("llama-1b", dict(num_layers=16, hidden_size=2048, num_key_value_heads=4, swiglu=True,
                                         ffn_hidden_size=5504, normalization="rmsnorm"))):
        flags = gt.ours_flags(name, args, ["--compile"])
        cfg = model_config_from_args(parse_args(flags), vocab_size=int(flags[flags.index("--vocab-size") + 1]))
        assert all(getattr(cfg, k) == v for k, v in want.items()), name
        assert cfg.seq_length == 2048 and cfg.torch_compile and cfg.hidden_dropout == 0.0
        bench_cfg = gt.model_config(name, 2048)
        assert gt.flops_per_token(bench_cfg) == iteration_flops(cfg, 1).model / 2048
    text = gt.report("gpt2-1.3b", {"ours auto": {"tokens_per_s": 60000.0, "peak_mem_gb": 40.0},
                                   "HF + torch.compile": {"tokens_per_s": 50000.0, "peak_mem_gb": 50.0},
                                   "HF eager": {"error": "exit 1"}}, args)
    mfu = 100 * 60000 * gt.flops_per_token(gt.model_config("gpt2-1.3b", 2048)) / 989e12
    assert f"| ours auto | 60,000 | {mfu:.1f}% | 40.0 | 1.20x |" in text and "failed: exit 1" in text


def test_kernel_table_ratios_and_auto_choice():
    import gpu_kernels as gk

    rows = [{"op": "attention", "shape": "s", "backend": b, "fwd_ms": 1.0, "fwd_bwd_ms": ms, "rate": "x",
             "max_diff": 0.0} for b, ms in (("torch", 2.0), ("triton", 3.0), ("sdpa:flash", 1.0))]
    text = gk.table(rows)
    assert "| triton | 1.000 | 3.000 | x | 1.50x | 0.00e+00 | torch |" in text  # sdpa:* is no candidate


def test_kernel_rows_run_every_registry_backend_on_tiny_cpu_shapes(monkeypatch):
    """The measuring loops on CPU with a stand-in timer (one call each): every registry backend usable
    here (torch on a plain CPU run) and the SDPA variants that can take the inputs, no crash otherwise."""
    import gpu_env
    import gpu_kernels as gk

    calls = []
    monkeypatch.setattr(gpu_env, "time_ms", lambda fn, warmup=0, reps=0: calls.append(fn()) or 1.0)
    rows = gk.attention_rows(torch.float32, True, [(1, 4, 2, 16, 8)], reps=1)
    rows += gk.norm_rows(torch.float32, [(4, 32)], reps=1)
    backends = {(r["op"], r["backend"]) for r in rows}
    assert {("attention", "torch"), ("layernorm", "torch"), ("rmsnorm", "torch")} <= backends
    assert all(r["max_diff"] < 1e-5 for r in rows) and "| attention | b1 h4/2 s16 d8 causal | torch |" in gk.table(rows)
