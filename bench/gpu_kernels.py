"""Per-op kernel benchmark on one GPU: every backend of the kernel registry (megatron/kernels/select.py:
torch, Triton, HIP when built) plus torch SDPA's own sub-backends, forward and forward + backward.

    python bench/gpu_kernels.py [--quick] [--dtype bf16] [--out build/gpu_kernels.md]

Backends come from ``select.PREFERENCE`` filtered by ``select.available`` and each kernel's own
unsupported-input check, so a backend added to the registry (e.g. the csrc HIP kernels) shows up here
without edits. The ``hip`` rows need the csrc extension built (ROCm or CUDA torch); on NVIDIA they run the
gfx90a kernels with 64-lane waves emulated by two warps (csrc/common/wave64.h): a sanity figure that the
code ran and matched torch, not a prediction of MI250X speed.
Reports median ms (accelerator events), TFLOP/s for attention (FlashAttention-2's
convention: forward 4 b h s^2 d, halved when causal; forward + backward = 3.5x forward), GB/s for the
norms (forward reads x and writes y; backward reads x and dy and writes dx: 5 x rows x hidden x bytes),
each backend's ratio to torch, the largest difference from torch's output, and the backend ``auto``
would keep (megatron/kernels/measure.py keeps the fastest forward + backward).
Without a GPU it prints one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_env  # noqa: E402

# (batch, q heads, kv heads, seq, head dim): the three shapes, then seq 8192 at d 64 and 128.
ATTENTION = [(4, 16, 16, 2048, 128), (8, 16, 16, 2048, 64), (2, 32, 8, 4096, 128), (1, 16, 16, 8192, 128),
             (2, 16, 16, 8192, 64)]
# (rows, hidden): the two LayerNorm shapes, then every hidden size the goal names (1024..25600).
NORMS = [(16384, 2048), (8192, 12288)] + [(8192, h) for h in (1024, 4096, 8192, 16384, 25600)]
SDPA_VARIANTS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")


def _backends(op: str, usable) -> list[str]:
    from megatron.kernels import select

    names = []
    for b in reversed(select.PREFERENCE):  # torch first: every ratio is against it
        if b == "torch" or (select.available(b, op, gpu_env.device())[0] and usable(b)):
            names.append(b)
    return names


def _fwd_bwd(fn, inputs, grad_out):
    def run():
        out = fn(*inputs)
        out.backward(grad_out)
    return run


def attention_rows(dtype, causal: bool, cases, reps: int) -> list[dict]:
    import torch

    from megatron.kernels import attention

    dev = gpu_env.device()
    rows = []
    for b, hq, hkv, s, d in cases:
        g = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(b, hq, s, d, device=dev, dtype=dtype, generator=g).requires_grad_()
        k = torch.randn(b, hkv, s, d, device=dev, dtype=dtype, generator=g).requires_grad_()
        v = torch.randn(b, hkv, s, d, device=dev, dtype=dtype, generator=g).requires_grad_()
        do = torch.randn(b, hq, s, d, device=dev, dtype=dtype, generator=g)
        fwd_flops = 4 * b * hq * s * s * d * (0.5 if causal else 1.0)
        takes = lambda n, q=q, k=k, v=v: attention._unsupported(n, q, k, v, 0.0) is None  # noqa: E731
        impls = {name: (lambda q, k, v, name=name: attention.dot_product_attention(q, k, v, causal=causal,
                                                                                     backend=name))
                 for name in _backends("attention", takes)}
        for variant in SDPA_VARIANTS:
            impls[f"sdpa:{variant.split('_')[0].lower()}"] = _sdpa(variant, causal)
        ref = impls["torch"](q, k, v).detach()
        shape = f"b{b} h{hq}" + (f"/{hkv}" if hkv != hq else "") + f" s{s} d{d}" + (" causal" if causal else "")
        for name, fn in impls.items():
            try:
                with torch.no_grad():
                    diff = (fn(q, k, v).float() - ref.float()).abs().max().item()
                fwd = gpu_env.time_ms(lambda fn=fn, q=q, k=k, v=v: fn(q, k, v), reps=reps)
                both = gpu_env.time_ms(_fwd_bwd(fn, (q, k, v), do), reps=reps)
            except RuntimeError as e:  # an SDPA sub-backend that cannot take these inputs
                print(f"  {shape} {name}: skipped ({str(e).splitlines()[0][:100]})", file=sys.stderr)
                continue
            q.grad = k.grad = v.grad = None
            rows.append({"op": "attention", "shape": shape, "backend": name, "fwd_ms": fwd, "fwd_bwd_ms": both,
                         "rate": f"{3.5 * fwd_flops / both / 1e9:.1f} TFLOP/s", "max_diff": diff})
    return rows


def _sdpa(variant: str, causal: bool):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def fn(q, k, v):
        if k.shape[1] != q.shape[1]:  # GQA as the torch backend does it
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        with sdpa_kernel(getattr(SDPBackend, variant)):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return fn


def norm_rows(dtype, cases, reps: int) -> list[dict]:
    import torch

    from megatron.kernels import norms

    dev = gpu_env.device()
    rows = []
    for kind in ("layernorm", "rmsnorm"):
        for n, h in cases:
            g = torch.Generator(device=dev).manual_seed(0)
            x = torch.randn(n, h, device=dev, dtype=dtype, generator=g).requires_grad_()
            w = torch.randn(h, device=dev, dtype=dtype, generator=g).requires_grad_()
            bias = torch.randn(h, device=dev, dtype=dtype, generator=g).requires_grad_() if kind == "layernorm" \
                else None
            dy = torch.randn(n, h, device=dev, dtype=dtype, generator=g)

            def call(name, x=x, w=w, bias=bias, kind=kind):
                if kind == "layernorm":
                    return norms.layer_norm(x, w, bias, 1e-5, backend=name)
                return norms.rms_norm(x, w, 1e-5, backend=name)

            names = _backends("norm", lambda b, x=x, w=w, bias=bias: norms._why_not(b, x, w, bias) is None)
            ref = call("torch").detach()
            nbytes = 5 * n * h * x.element_size()
            for name in names:
                with torch.no_grad():
                    diff = (call(name).float() - ref.float()).abs().max().item()
                fwd = gpu_env.time_ms(lambda name=name: call(name), reps=reps)
                both = gpu_env.time_ms(_fwd_bwd(lambda name=name: call(name), (), dy), reps=reps)
                x.grad = w.grad = None
                if bias is not None:
                    bias.grad = None
                rows.append({"op": kind, "shape": f"{n} x {h}", "backend": name, "fwd_ms": fwd, "fwd_bwd_ms": both,
                             "rate": f"{nbytes / both / 1e6:.0f} GB/s", "max_diff": diff})
    return rows


def table(rows: list[dict]) -> str:
    torch_ms = {(r["op"], r["shape"]): r["fwd_bwd_ms"] for r in rows if r["backend"] == "torch"}
    best = {}
    for r in rows:  # what auto keeps: the fastest registry backend (sdpa:* are torch internals, not candidates)
        key = (r["op"], r["shape"])
        if not r["backend"].startswith("sdpa:") and (key not in best or r["fwd_bwd_ms"] < best[key][1]):
            best[key] = (r["backend"], r["fwd_bwd_ms"])
    out = ["| op | shape | backend | fwd ms | fwd+bwd ms | fwd+bwd rate | vs torch | max diff | auto keeps |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        key = (r["op"], r["shape"])
        ratio = r["fwd_bwd_ms"] / torch_ms[key]
        out.append(f"| {r['op']} | {r['shape']} | {r['backend']} | {r['fwd_ms']:.3f} | {r['fwd_bwd_ms']:.3f} | "
                   f"{r['rate']} | {ratio:.2f}x | {r['max_diff']:.2e} | {best[key][0]} |")
    return "\n".join(out)


def main(argv=None) -> None:
    gpu_env.require_gpu("bench/gpu_kernels.py")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--quick", action="store_true", help="the issue's shapes only")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=None, help="also write the markdown here")
    args = p.parse_args(argv)
    import torch

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    attn = ATTENTION[:3] if args.quick else ATTENTION
    norm = NORMS[:2] if args.quick else NORMS
    text = [f"bench/gpu_kernels.py, {args.dtype}, median of {args.reps}: {gpu_env.header()}", "",
            table(attention_rows(dtype, True, attn, args.reps) + norm_rows(dtype, norm, args.reps))]
    print("\n".join(text))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(text) + "\n")


if __name__ == "__main__":
    main()
