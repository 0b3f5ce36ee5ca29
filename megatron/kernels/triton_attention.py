"""Flash attention (forward + backward, causal or not, GQA) in Triton, wrapped as an autograd Function.

Same algorithm as csrc/flash_attention: online softmax over key tiles, the log-sum-exp saved for the
backward pass, which recomputes probabilities tile by tile (dK/dV per key tile, dQ per query tile; no
atomics). Runs on GPUs through Triton's ROCm/CUDA backends and on CPU under TRITON_INTERPRET=1, where it
is checked against a float64 reference (tests/unit/kernels).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HEAD_DIM = 256
_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every output buffer comes from here, so tests can poison it (NaN) and prove it is fully written."""
    return torch.empty(shape, dtype=dtype, device=device)


def _blocks() -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) under the interpreter: its cost grows with tile area and the tests use short
    sequences, so small tiles there also exercise many partial/masked tiles. On a GPU, autotune picks."""
    return (16, 16)


def _is_hip() -> bool:
    return torch.version.hip is not None


def _configs() -> list[triton.Config]:
    """Autotune candidates for every attention kernel (block sizes, warps, stages).

    Under the interpreter: one small config, so nothing is benchmarked and the tests stay fast.
    NVIDIA (H100): 128x64 / 128x128 / 64x64 tiles with 4-8 warps and 2-4 pipeline stages, the
    FlashAttention-2 Triton tutorial's search space.
    ROCm (MI250X, gfx90a), UNMEASURED, chosen from published facts: 64-lane wavefronts and 64 KiB of LDS
    per CU favour 64-wide key tiles (BLOCK_N 64 keeps a K and a V tile of head dim 128 in bf16 at 32 KiB);
    the Triton AMD backend's fused-attention tutorial uses BLOCK_M 128, BLOCK_N 64, waves_per_eu 2,
    num_warps 4, num_stages 1; matrix_instr_nonkdim 16 picks the 16x16 MFMA, 32 the 32x32 one. Only
    the HIP backend understands these knobs, so they appear only there.
    """
    if os.environ.get("TRITON_INTERPRET") == "1":
        bm, bn = _blocks()
        return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=1, num_stages=1)]
    if _is_hip():
        # Six, not the full product: every config is one more compile per kernel at the first call.
        return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "waves_per_eu": wpe, "matrix_instr_nonkdim": k},
                              num_warps=4, num_stages=1)
                for bm, bn, wpe, k in ((128, 64, 2, 16), (128, 64, 3, 16), (128, 64, 2, 32), (64, 64, 2, 16),
                                       (64, 64, 3, 32), (128, 32, 2, 16))]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
            for bm, bn, w, st in ((128, 128, 8, 2), (128, 64, 8, 3), (128, 64, 4, 3), (128, 32, 4, 4),
                                  (64, 64, 4, 3), (64, 64, 4, 4), (64, 32, 4, 4), (32, 64, 4, 4))]


def _prune(configs: list[triton.Config], nargs: dict, **kwargs) -> list[triton.Config]:
    # Wide heads (d > 128) overflow registers/LDS with large tiles: keep the small ones.
    if kwargs.get("BLOCK_D", nargs.get("BLOCK_D", 0)) > 128:
        small = [c for c in configs if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 64 * 64]
        return small or configs[-1:]
    return configs


_AUTOTUNE = dict(configs=_configs(), key=["seqlen", "HEAD_DIM", "heads_q", "group", "CAUSAL"],
                 prune_configs_by={"early_config_prune": _prune})


@triton.autotune(**_AUTOTUNE)
@triton.jit
def _fwd_kernel(Q, K, V, Out, LSE, sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sob, soh, sos,
                heads_q, group, seqlen, scale_log2,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                CAUSAL: tl.constexpr, DOT: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // heads_q
    h = bh % heads_q
    hk = h // group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < seqlen
    mask_d = offs_d < HEAD_DIM

    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqs + offs_d[None, :],
                mask=mask_m[:, None] & mask_d[None, :], other=0.0).to(DOT)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = seqlen
    if CAUSAL:
        hi = tl.minimum((pid_m + 1) * BLOCK_M, seqlen)  # later key tiles are all above the diagonal
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        mask_n = cols < seqlen
        kt = tl.load(k_base + cols[None, :] * sks + offs_d[:, None], mask=mask_n[None, :] & mask_d[:, None],
                     other=0.0).to(DOT)  # (d, n)
        s = tl.dot(q, kt, input_precision="ieee") * scale_log2  # (m, n), log2 units
        visible = mask_n[None, :]
        if CAUSAL:
            visible = visible & (cols[None, :] <= offs_m[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Padding rows past seqlen see no key in a tile; a finite reference keeps exp2 away from -inf - -inf.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_ref[:, None])
        alpha = tl.math.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + cols[:, None] * svs + offs_d[None, :], mask=mask_n[:, None] & mask_d[None, :],
                    other=0.0).to(DOT)  # (n, d)
        # P is rounded to the input dtype for the tensor-core/MFMA product, as FlashAttention-2 does.
        acc = acc * alpha[:, None] + tl.dot(p.to(V.dtype.element_ty).to(DOT), v, input_precision="ieee")
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    tl.store(Out + b * sob + h * soh + offs_m[:, None] * sos + offs_d[None, :], out.to(Out.dtype.element_ty),
             mask=mask_m[:, None] & mask_d[None, :])
    tl.store(LSE + bh * seqlen + offs_m, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, mask=mask_m)


@triton.jit
def _bwd_delta_kernel(OUT, DO, DELTA, sob, soh, sos, sdb, sdh, sds, heads_q, seqlen,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    # delta = rowsum(dO * O) in fp32, read straight from the (strided) inputs: no fp32 copies of O, dO.
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // heads_q
    h = bh % heads_q
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < seqlen
    mask = mask_m[:, None] & (offs_d < HEAD_DIM)[None, :]
    o = tl.load(OUT + b * sob + h * soh + offs_m[:, None] * sos + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sds + offs_d[None, :], mask=mask, other=0.0)
    tl.store(DELTA + bh * seqlen + offs_m, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=mask_m)


@triton.autotune(**_AUTOTUNE)
@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, sqb, sqh, sqs, skb, skh, sks, svb, svh, svs,
                     sdb, sdh, sds, sdkb, sdkh, sdks, sdvb, sdvh, sdvs, heads_q, group, seqlen, scale, scale_log2,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     CAUSAL: tl.constexpr, DOT: tl.constexpr):
    # Every tensor has its own strides (sq* q, sk* k, sv* v, sd* dO, sdk* dK, sdv* dV): strided views are
    # read in place, so the backward makes no .contiguous() copies. The head dim must be unit-stride.
    pid_n = tl.program_id(0)
    bhk = tl.program_id(1)
    heads_kv = heads_q // group
    b = bhk // heads_kv
    hk = bhk % heads_kv
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_n = offs_n < seqlen
    mask_d = offs_d < HEAD_DIM
    mask_nd = mask_n[:, None] & mask_d[None, :]
    k = tl.load(K + b * skb + hk * skh + offs_n[:, None] * sks + offs_d[None, :], mask=mask_nd, other=0.0).to(DOT)
    v = tl.load(V + b * svb + hk * svh + offs_n[:, None] * svs + offs_d[None, :], mask=mask_nd, other=0.0).to(DOT)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)

    lo = 0
    if CAUSAL:
        lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M  # earlier query tiles cannot see these keys
    for g in range(group):  # every query head of this kv head's GQA group: dK/dV summed in registers
        h = hk * group + g
        q_base = Q + b * sqb + h * sqh
        do_base = DO + b * sdb + h * sdh
        row_base = (b * heads_q + h) * seqlen
        for start_m in range(lo, seqlen, BLOCK_M):
            offs_m = start_m + offs_m0
            mask_m = offs_m < seqlen
            mask_md = mask_m[:, None] & mask_d[None, :]
            q = tl.load(q_base + offs_m[:, None] * sqs + offs_d[None, :], mask=mask_md, other=0.0).to(DOT)
            do = tl.load(do_base + offs_m[:, None] * sds + offs_d[None, :], mask=mask_md, other=0.0).to(DOT)
            lse = tl.load(LSE + row_base + offs_m, mask=mask_m, other=0.0) * 1.4426950408889634
            delta = tl.load(DELTA + row_base + offs_m, mask=mask_m, other=0.0)
            st = tl.dot(k, tl.trans(q), input_precision="ieee") * scale_log2  # (n, m): transposed scores
            visible = mask_n[:, None] & mask_m[None, :]
            if CAUSAL:
                visible = visible & (offs_n[:, None] <= offs_m[None, :])
            pt = tl.where(visible, tl.math.exp2(st - lse[None, :]), 0.0)
            dv += tl.dot(pt.to(DO.dtype.element_ty).to(DOT), do, input_precision="ieee")
            dpt = tl.dot(v, tl.trans(do), input_precision="ieee")
            dst = pt * (dpt - delta[None, :])
            dk += tl.dot(dst.to(Q.dtype.element_ty).to(DOT), q, input_precision="ieee")

    tl.store(DK + b * sdkb + hk * sdkh + offs_n[:, None] * sdks + offs_d[None, :],
             (dk * scale).to(DK.dtype.element_ty), mask=mask_nd)
    tl.store(DV + b * sdvb + hk * sdvh + offs_n[:, None] * sdvs + offs_d[None, :], dv.to(DV.dtype.element_ty),
             mask=mask_nd)


@triton.autotune(**_AUTOTUNE)
@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, sqb, sqh, sqs, skb, skh, sks, svb, svh, svs,
                   sdb, sdh, sds, sdqb, sdqh, sdqs, heads_q, group, seqlen, scale, scale_log2,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   CAUSAL: tl.constexpr, DOT: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // heads_q
    h = bh % heads_q
    hk = h // group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < seqlen
    mask_d = offs_d < HEAD_DIM
    mask_md = mask_m[:, None] & mask_d[None, :]
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqs + offs_d[None, :], mask=mask_md, other=0.0).to(DOT)
    do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sds + offs_d[None, :], mask=mask_md, other=0.0).to(DOT)
    lse = tl.load(LSE + bh * seqlen + offs_m, mask=mask_m, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + bh * seqlen + offs_m, mask=mask_m, other=0.0)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    hi = seqlen
    if CAUSAL:
        hi = tl.minimum((pid_m + 1) * BLOCK_M, seqlen)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        mask_n = offs_n < seqlen
        mask_nd = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_base + offs_n[:, None] * sks + offs_d[None, :], mask=mask_nd, other=0.0).to(DOT)
        v = tl.load(v_base + offs_n[:, None] * svs + offs_d[None, :], mask=mask_nd, other=0.0).to(DOT)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
        visible = mask_m[:, None] & mask_n[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None])
        p = tl.where(visible, tl.math.exp2(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision="ieee")
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(K.dtype.element_ty).to(DOT), k, input_precision="ieee")

    tl.store(DQ + b * sdqb + h * sdqh + offs_m[:, None] * sdqs + offs_d[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=mask_md)


def unsupported_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> str | None:
    """Why this kernel cannot run these inputs (the seam then falls back to torch), or None."""
    if dropout_p > 0.0:
        return "attention dropout > 0"
    if q.dtype not in _SUPPORTED_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtypes q={q.dtype}, k={k.dtype}, v={v.dtype}"
    if q.dim() != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        return f"shapes q={tuple(q.shape)}, k={tuple(k.shape)}, v={tuple(v.shape)} (need equal b, s, d)"
    if q.shape[-1] > _MAX_HEAD_DIM:
        return f"head dim {q.shape[-1]} > {_MAX_HEAD_DIM}"
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        return f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads"
    return None


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    # Kernels take batch/head/seq strides but assume the head dim is contiguous.
    return t if t.stride(-1) == 1 else t.contiguous()


def _meta(q: torch.Tensor) -> dict:
    # Operand dtype of every tl.dot: the input dtype (the cast is then a no-op), except that Triton's
    # interpreter multiplies bf16 bit patterns in tl.dot (a documented limitation); bf16 values are exact
    # in fp32, so there fp32 operands compute what the GPU's bf16 x bf16 -> fp32 dot computes.
    upcast = _interpreting() and q.dtype == torch.bfloat16
    return {"HEAD_DIM": q.shape[-1], "BLOCK_D": max(16, triton.next_power_of_2(q.shape[-1])),
            "DOT": tl.float32 if upcast else _TL_DTYPES[q.dtype]}


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (o [b, nq, s, d] in q's dtype, lse [b, nq, s] fp32, natural log)."""
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    b, nq, s, _ = q.shape
    o = _alloc(tuple(q.shape), q.dtype, q.device)
    lse = _alloc((b, nq, s), torch.float32, q.device)
    _fwd_kernel[lambda meta: (triton.cdiv(s, meta["BLOCK_M"]), b * nq)](
        q, k, v, o, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3],
        nq, nq // k.shape[1], s, scale * math.log2(math.e), CAUSAL=causal, **_meta(q))
    return o, lse


def attention_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                       lse: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, ...]:
    """Returns (dq, dk, dv) in the input dtypes. Strided inputs are read in place (only a head dim that
    is not unit-stride is copied)."""
    q, k, v, do, o = (_unit_last(t) for t in (q, k, v, do, o))
    b, nq, s, _ = q.shape
    nkv = k.shape[1]
    meta = _meta(q)
    delta = _alloc((b, nq, s), torch.float32, q.device)
    bm = _blocks()[0] if _interpreting() else 64
    _bwd_delta_kernel[(triton.cdiv(s, bm), b * nq)](o, do, delta, *o.stride()[:3], *do.stride()[:3], nq, s,
                                                     HEAD_DIM=meta["HEAD_DIM"], BLOCK_D=meta["BLOCK_D"], BLOCK_M=bm)
    dq = _alloc(tuple(q.shape), q.dtype, q.device)
    dk = _alloc(tuple(k.shape), k.dtype, k.device)
    dv = _alloc(tuple(v.shape), v.dtype, v.device)
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3])
    tail = (nq, nq // nkv, s, scale, scale * math.log2(math.e))
    _bwd_dkdv_kernel[lambda m: (triton.cdiv(s, m["BLOCK_N"]), b * nkv)](
        q, k, v, do, lse, delta, dk, dv, *strides, *dk.stride()[:3], *dv.stride()[:3], *tail, CAUSAL=causal, **meta)
    _bwd_dq_kernel[lambda m: (triton.cdiv(s, m["BLOCK_M"]), b * nq)](
        q, k, v, do, lse, delta, dq, *strides, *dq.stride()[:3], *tail, CAUSAL=causal, **meta)
    return dq, dk, dv


class TritonFlashAttention(torch.autograd.Function):
    """o = softmax(q k^T * scale [+ causal mask]) v, with GQA; saves (q, k, v, o, lse) for backward."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
        o, lse = attention_forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale = causal, scale
        return o

    @staticmethod
    def backward(ctx, do: torch.Tensor):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = attention_backward(do, q, k, v, o, lse, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                    softmax_scale: float | None = None) -> torch.Tensor:
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return TritonFlashAttention.apply(q, k, v, causal, scale)
