"""Attention kernel benchmark: HBM bytes of fused vs unfused attention (computed from the algorithms) and the
peak CPU memory of SDPA's math path vs a tiled online-softmax attention at seq 8192 (measured).

    python bench/kernels.py [--heads 4 --seq 8192 --dim 128] [--write bench/RESULTS_kernels.md]

Memory runs each method in a fresh subprocess and reports its peak RSS (ru_maxrss) above the RSS it had once
the inputs existed: torch's CPU allocations do not go through Python's allocator, so tracemalloc cannot see them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Tile shapes of csrc/flash_attention at head dim 128 (flash_attn_tiles.h) and of the Triton kernel on GPU.
HIP_TILES = {"fwd_m": 32, "bwd_m": 16, "n": 64}
TRITON_TILES = {"fwd_m": 64, "bwd_m": 64, "n": 64}
HBM_BYTES_PER_S = 1.6e12  # one MI250X GCD (FRONTIER.md)


def _visible_fraction(s: int, tile: int, causal: bool) -> float:
    """Fraction of (query tile, key) or (key tile, query) pairs a causal kernel still streams."""
    return 0.5 + tile / (2 * s) if causal else 1.0


def unfused_bytes(s: int, d: int, e: int) -> dict[str, float]:
    """Per (batch, head). Megatron's non-flash path: QK^T -> S, fused scale/mask/softmax S -> P, P V -> O,
    each a separate kernel that round-trips its s x s operand through HBM in the input dtype (no dropout)."""
    sd, ss = s * d * e, s * s * e
    fwd = (2 * sd + ss) + (2 * ss) + (ss + 2 * sd)  # QK^T; softmax read S write P; PV
    # dV = P^T dO; dP = dO V^T; dS = softmax_bwd(P, dP); dQ = dS K; dK = dS^T Q.
    bwd = (ss + 2 * sd) + (2 * sd + ss) + (3 * ss) + (ss + 2 * sd) + (ss + 2 * sd)
    return {"fwd": fwd, "bwd": bwd, "saved": ss}


def fused_bytes(s: int, d: int, e: int, causal: bool, tiles: dict[str, int], reuse: bool) -> dict[str, float]:
    """Per (batch, head), FlashAttention-2 as in csrc/flash_attention. reuse=False: every tile load comes from
    HBM (upper bound); reuse=True: every operand crosses HBM once, i.e. perfect L2 reuse (lower bound)."""
    sd, lse = s * d * e, s * 4
    bm, bmb, bn = tiles["fwd_m"], tiles["bwd_m"], tiles["n"]
    if reuse:
        return {"fwd": 4 * sd + lse, "bwd": 2 * sd + lse + 4 * sd + 2 * lse + 3 * sd, "saved": lse}
    kv_passes_fwd = math.ceil(s / bm) * _visible_fraction(s, bm, causal)
    fwd = sd + kv_passes_fwd * 2 * sd + sd + lse  # Q once, K+V per query tile, O and LSE written
    delta = 2 * sd + lse  # read dO, O; write delta
    q_passes = math.ceil(s / bn) * _visible_fraction(s, bn, causal)
    dkdv = 2 * sd + q_passes * (2 * sd + 2 * lse) + 2 * sd  # K, V once; Q, dO, LSE, delta per key tile; dK, dV
    kv_passes_bwd = math.ceil(s / bmb) * _visible_fraction(s, bmb, causal)
    dq = 2 * sd + 2 * lse + kv_passes_bwd * 2 * sd + sd  # Q, dO, LSE, delta once; K+V per query tile; dQ
    return {"fwd": fwd, "bwd": delta + dkdv + dq, "saved": lse}


def hbm_table(batch: int, heads: int, d: int, e: int, seqs: list[int]) -> list[dict]:
    rows = []
    for s in seqs:
        n = batch * heads
        for name, fn in (
            ("unfused (S, P in HBM)", lambda s=s: unfused_bytes(s, d, e)),
            ("fused HIP, no L2 reuse", lambda s=s: fused_bytes(s, d, e, True, HIP_TILES, reuse=False)),
            ("fused Triton 64x64, no L2 reuse", lambda s=s: fused_bytes(s, d, e, True, TRITON_TILES, reuse=False)),
            ("fused, each operand once", lambda s=s: fused_bytes(s, d, e, True, HIP_TILES, reuse=True)),
        ):
            b = fn()
            rows.append({"seq": s, "path": name, "fwd_GB": n * b["fwd"] / 1e9, "bwd_GB": n * b["bwd"] / 1e9,
                         "saved_GB": n * b["saved"] / 1e9,
                         "ms_at_1.6TB/s": 1e3 * n * (b["fwd"] + b["bwd"]) / HBM_BYTES_PER_S})
    return rows


# --- measured: peak CPU memory ------------------------------------------------------------------------


def tiled_attention(q, k, v, causal: bool, block_m: int = 512, block_n: int = 512):
    """The kernels' forward at torch level: online softmax over key tiles, O(block_m x block_n) scratch."""
    import torch

    b, h, s, d = q.shape
    scale = 1.0 / math.sqrt(d)
    out = torch.empty_like(q)
    for m0 in range(0, s, block_m):
        qi = q[:, :, m0:m0 + block_m] * scale
        rows = qi.shape[2]
        m_i = torch.full((b, h, rows, 1), float("-inf"), dtype=torch.float32)
        l_i = torch.zeros((b, h, rows, 1), dtype=torch.float32)
        acc = torch.zeros((b, h, rows, d), dtype=torch.float32)
        n_end = min(s, m0 + rows) if causal else s
        for n0 in range(0, n_end, block_n):
            sc = qi @ k[:, :, n0:n0 + block_n].transpose(-1, -2)  # (b, h, rows, block_n)
            if causal and n0 + block_n > m0:
                qpos = torch.arange(m0, m0 + rows)[:, None]
                kpos = torch.arange(n0, n0 + sc.shape[-1])[None, :]
                sc.masked_fill_(kpos > qpos, float("-inf"))
            m_new = torch.maximum(m_i, sc.amax(-1, keepdim=True))
            p = torch.exp(sc - m_new)
            alpha = torch.exp(m_i - m_new)
            l_i = l_i * alpha + p.sum(-1, keepdim=True)
            acc = acc * alpha + p @ v[:, :, n0:n0 + block_n]
            m_i = m_new
        out[:, :, m0:m0 + rows] = acc / l_i
    return out


def _child(method: str, heads: int, seq: int, dim: int) -> None:
    import resource

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, seq, dim, generator=g) for _ in range(3))

    def run(q, k, v):
        if method == "sdpa_math":
            with sdpa_kernel(SDPBackend.MATH):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return tiled_attention(q, k, v, causal=True)

    with torch.no_grad():  # warm up on a tiny slice: torch's one-time allocations are not the method's
        run(q[:, :, :64], k[:, :, :64], v[:, :, :64])
    base_kb = _rss_kb()
    t0 = time.perf_counter()
    with torch.no_grad():
        o = run(q, k, v)
    secs = time.perf_counter() - t0
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Check against SDPA's flash CPU kernel, so both methods are shown to compute the same op.
    with torch.no_grad(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    err = (o - ref).abs().max().item()
    print(json.dumps({"method": method, "peak_above_inputs_MB": (peak_kb - base_kb) / 1024,
                      "inputs_MB": 3 * q.numel() * 4 / 2**20, "seconds": secs, "max_abs_err_vs_flash": err}))


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def measure(heads: int, seq: int, dim: int) -> list[dict]:
    out = []
    for method in ("sdpa_math", "tiled"):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", method, "--heads", str(heads), "--seq", str(seq),
               "--dim", str(dim)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        res = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
        out.append(json.loads(res.stdout.strip().splitlines()[-1]))
    return out


def render(hbm: list[dict], mem: list[dict], args) -> str:
    lines = [
        "# Attention kernels: HBM traffic and peak memory",
        "",
        "Written by `python bench/kernels.py --write bench/RESULTS_kernels.md`.",
        "",
        (f"## HBM bytes per attention layer (computed), causal, batch {args.batch}, {args.hbm_heads} heads, "
        f"head dim {args.dim}, bf16"),
        "",
        ("The shape of GPT-22B on Frontier (hidden 6144, 48 heads). Unfused = Megatron's non-flash path "
        "(QK^T, fused scale-mask-softmax, PV as separate kernels; S and P of s x s in bf16 through HBM; no "
        "dropout). Fused = the FlashAttention-2 split of csrc/flash_attention: the upper bound streams every "
        "K/V (forward, dQ) or Q/dO (dK/dV) tile from HBM, the lower bound reads each operand once (perfect L2 "
        "reuse; MI250X has 8 MB L2 per GCD and one head's K+V at s=8192 is 4 MB, so blocks of one head running "
        "together land near it). `saved` = what the forward keeps for backward beyond q, k, v, o."),
        "",
        "| seq | path | fwd GB | bwd GB | saved GB | ms at 1.6 TB/s (fwd+bwd) |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for r in hbm:
        lines.append(f"| {r['seq']} | {r['path']} | {r['fwd_GB']:.2f} | {r['bwd_GB']:.2f} | {r['saved_GB']:.3f} | "
                     f"{r['ms_at_1.6TB/s']:.2f} |")
    lines += [
        "",
        ("Reading: the fused paths never write S or P, so their saved state is the LSE alone (6.4 GB less per "
         "layer at s=8192). Their traffic depends on K/V tile reuse: the HIP kernel's 32-row query tile (LDS-bound "
         "at d=128 with scalar FMAs) re-reads K and V s/32 times, so without L2 hits it would move about as many "
         "bytes as the unfused path; 128-row tiles with Q held in registers (MFMA) would quarter that."),
    ]
    lines += [
        "",
        (f"## Peak CPU memory at seq {args.seq} (measured), forward, causal, batch 1, {args.heads} heads, "
        f"head dim {args.dim}, fp32"),
        "",
        ("Each method in a fresh process; peak RSS above the RSS once q, k, v existed. `tiled` is the kernels' "
        "forward algorithm at torch level (512 x 512 tiles, online softmax), `sdpa_math` is "
        "`F.scaled_dot_product_attention` forced to SDPBackend.MATH. Error is against SDPA's flash CPU kernel."),
        "",
        "| method | peak above inputs (MB) | inputs q,k,v (MB) | seconds | max abs err |",
        "|---|---:|---:|---:|---:|",
    ]
    for m in mem:
        lines.append(f"| {m['method']} | {m['peak_above_inputs_MB']:.0f} | {m['inputs_MB']:.0f} | {m['seconds']:.1f} | "
                     f"{m['max_abs_err_vs_flash']:.1e} |")
    s_bytes = args.heads * args.seq**2 * 4 / 2**20
    lines += ["", f"One s x s fp32 score matrix for {args.heads} heads is {s_bytes:.0f} MB.", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=4, help="heads of the measured run")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1, help="batch of the computed HBM table")
    ap.add_argument("--hbm-heads", type=int, default=48, help="heads of the computed HBM table")
    ap.add_argument("--write", help="write the markdown report here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args.child, args.heads, args.seq, args.dim)
        return
    hbm = hbm_table(args.batch, args.hbm_heads, args.dim, 2, [2048, 8192])
    mem = measure(args.heads, args.seq, args.dim)
    report = render(hbm, mem, args)
    print(report)
    if args.write:
        with open(args.write, "w") as f:
            f.write(report)


if __name__ == "__main__":
    main()
