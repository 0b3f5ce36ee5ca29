"""The csrc HIP kernels executed on a GPU vs float64 references: forward, saved statistics and gradients.

On NVIDIA the kernels run through csrc/common/wave64.h (a 64-lane wave made of two warps); on AMD natively.
Same matrix and bounds as the Triton tests in tests/unit/kernels (reference.py: norm-wise relative error,
fp32 <= 1e-5, bf16 <= 1e-2, fp16 <= 2e-3, fp32 statistics <= 1e-5), at the HIP kernels' shapes: head dim
64/128, sequences that are not a multiple of the 64-key tile, GQA, fp16/bf16; norms up to hidden 25600.

Outputs are NaN-poisoned: the extension allocates its outputs itself, so each call is preceded by NaN-filled
blocks of exactly the sizes it will ask the caching allocator for, in the same order; the test checks that
the outputs got those very blocks (else the poison proved nothing) and that no NaN is left.
"""

from __future__ import annotations

import logging
import math
import random

import pytest
import torch
from deepspeed.accelerator import get_accelerator

from megatron.kernels import hip_ops, select
from tests.unit.kernels.reference import (TOL, attention_inputs, attention_ref, dtype_id, layer_norm_ref,
                                          record_errors, rel_err, within)

EPS = 1e-5


def _ext(op: str):
    if not hip_ops.built(op):
        pytest.skip(f"{hip_ops._MODULES[op]} is not built: install with a CUDA or ROCm torch and nvcc/hipcc "
                    "(pip install --no-build-isolation -e .); see the build log for its warning")
    return hip_ops._ext(op)


@pytest.fixture
def device() -> torch.device:
    acc = get_accelerator()
    return torch.device(acc.device_name(), acc.current_device())


def _poison(device: torch.device, specs: list[tuple[tuple[int, ...], torch.dtype]]) -> list[int]:
    """Free NaN-filled blocks of these (shape, dtype), in the order the binding allocates; their addresses.

    After empty_cache these are the only cached blocks, and the caching allocator serves same-size requests
    on the same stream best-fit from them, so the binding's outputs land on the poison.
    """
    acc = get_accelerator()
    acc.synchronize()
    acc.empty_cache()
    blocks = [torch.full(shape, float("nan"), dtype=dtype, device=device) for shape, dtype in specs]
    ptrs = [b.data_ptr() for b in blocks]
    del blocks
    return ptrs


def _assert_overwritten(named: dict[str, torch.Tensor], ptrs: list[int]) -> None:
    for (name, t), ptr in zip(named.items(), ptrs, strict=True):
        assert t.data_ptr() == ptr, (f"{name} did not get the NaN-poisoned block (allocator policy changed?), "
                                     "so the overwrite check would prove nothing")
        assert not t.isnan().any(), f"{name}: an element was never written (still NaN poison)"


# ---- flash attention ------------------------------------------------------------------------------------

def _random_cases(n: int, seed: int) -> list[tuple]:
    """(b, nq, nkv, s, d, causal, dtype): s around and between multiples of the 64-key tile, GQA and MHA."""
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        nkv = rng.choice([1, 2])
        cases.append((rng.choice([1, 2]), nkv * rng.choice([1, 2, 4]), nkv, rng.choice([17, 63, 64, 65, 127, 200, 513]),
                      rng.choice([64, 128]), i % 2 == 0, torch.float16 if i % 4 < 2 else torch.bfloat16))
    return cases


ATTN_CASES = [
    (1, 4, 1, 45, 64, True, torch.bfloat16),  # one partial tile, 4:1 GQA
    (2, 2, 2, 100, 64, False, torch.float16),
    (1, 8, 2, 130, 128, True, torch.bfloat16),  # three key tiles, the last with 2 keys
    (2, 4, 2, 257, 128, False, torch.float16),
    (1, 2, 1, 1, 64, True, torch.float16),  # a single token
    (1, 6, 3, 192, 128, True, torch.float16),  # whole tiles
    (2, 4, 4, 333, 64, True, torch.bfloat16),
    *_random_cases(8, seed=16),
]


@pytest.mark.parametrize("b,nq,nkv,s,d,causal,dtype", ATTN_CASES, ids=dtype_id)
def test_attention_forward_backward_match_float64(device, b, nq, nkv, s, d, causal, dtype, record_property):
    ext = _ext("attention")
    q, k, v, do = attention_inputs(b, nq, nkv, s, d, dtype, seed=s * 131 + d, device=device)
    scale = 1.0 / math.sqrt(d)

    ptrs = _poison(device, [(q.shape, dtype), ((b, nq, s), torch.float32)])
    o, lse = ext.fwd(q, k, v, causal, scale)
    _assert_overwritten({"o": o, "lse": lse}, ptrs)
    # The binding allocates dq, dk, dv, then its delta workspace.
    ptrs = _poison(device, [(q.shape, dtype), (k.shape, dtype), (v.shape, dtype), ((b, nq, s), torch.float32)])
    dq, dk, dv = ext.bwd(do, q, k, v, o, lse, causal, scale)
    _assert_overwritten({"dq": dq, "dk": dk, "dv": dv}, ptrs[:3])
    assert o.dtype == dq.dtype == dk.dtype == dv.dtype == dtype and lse.dtype == torch.float32

    q64, k64, v64 = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    o_ref, lse_ref = attention_ref(q64, k64, v64, causal, scale)
    o_ref.backward(do.cpu().double())
    tol = TOL[dtype]
    floor = 0.1 * do.double().pow(2).mean().sqrt().item()  # see rel_err: a tenth of dO's RMS
    record_errors(record_property, within({
        "o": (rel_err(o.cpu(), o_ref), tol),
        "lse": (rel_err(lse.cpu(), lse_ref), 1e-5),  # fp32 statistics whatever the input dtype
        "dq": (rel_err(dq.cpu(), q64.grad, floor), tol),
        "dk": (rel_err(dk.cpu(), k64.grad, floor), tol),
        "dv": (rel_err(dv.cpu(), v64.grad, floor), tol)}))


@pytest.mark.parametrize("causal", [False, True])
def test_attention_autograd_with_strided_inputs(device, causal):
    """Through autograd with q/k/v as transposed views of [b, s, h, d] (what the model produces)."""
    _ext("attention")
    b, s, nq, nkv, d = 2, 77, 8, 2, 128
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(b, s, n, d, generator=g).to(torch.bfloat16) for n in (nq, nkv, nkv))
    do = torch.randn(b, nq, s, d, generator=g).to(torch.bfloat16)
    qg, kg, vg = (t.to(device).transpose(1, 2).requires_grad_() for t in (q, k, v))
    o = hip_ops.flash_attention(qg, kg, vg, causal)
    o.backward(do.to(device))

    q64, k64, v64 = (t.transpose(1, 2).double().requires_grad_() for t in (q, k, v))
    o_ref, _ = attention_ref(q64, k64, v64, causal, 1.0 / math.sqrt(d))
    o_ref.backward(do.double())
    tol = TOL[torch.bfloat16]
    assert rel_err(o.cpu(), o_ref) <= tol
    for got, ref in ((qg.grad, q64.grad), (kg.grad, k64.grad), (vg.grad, v64.grad)):
        assert got.shape == ref.shape and rel_err(got.cpu(), ref) <= tol


# ---- LayerNorm / RMSNorm --------------------------------------------------------------------------------

# (shape, rms, bias): hidden sizes not a power of two or multiple of 64, a single row, more rows than the
# 256 first-stage chunks of the dgamma reduction, and Megatron widths up to GPT-1T's 25600.
NORM_CASES = [
    ((1, 8), False, True),
    ((5, 33), False, True),
    ((3, 7, 100), False, False),
    ((9, 257), True, False),
    ((64, 1024), False, True),
    ((300, 1000), False, True),
    ((37, 4096), True, False),
    ((8, 12288), False, True),
    ((4, 25600), False, True),
    ((3, 25600), True, False),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("shape,rms,bias", NORM_CASES)
def test_norm_forward_backward_match_float64(device, shape, rms, bias, dtype, record_property):
    ext = _ext("norm")
    g = torch.Generator().manual_seed(sum(shape))
    cols = shape[-1]
    rows = math.prod(shape[:-1])
    # An offset mean (5) next to unit spread: catches a variance computed as E[x^2] - E[x]^2.
    x = (torch.randn(shape, generator=g) * 2 + 5).to(dtype)
    w = (1 + 0.5 * torch.randn(cols, generator=g)).to(dtype)
    b = torch.randn(cols, generator=g).to(dtype) if bias else None
    dy = torch.randn(shape, generator=g).to(dtype)
    x2, dy2 = x.reshape(rows, cols).to(device), dy.reshape(rows, cols).to(device)
    wd, bd = w.to(device), (b.to(device) if bias else None)

    # Forward allocates y, mean (empty for RMSNorm: no block), rstd.
    specs = [((rows, cols), dtype)] + ([] if rms else [((rows,), torch.float32)]) + [((rows,), torch.float32)]
    ptrs = _poison(device, specs)
    y, mean, rstd = ext.fwd(x2, wd, bd, EPS, rms)
    _assert_overwritten({"y": y, **({} if rms else {"mean": mean}), "rstd": rstd}, ptrs)
    # Backward allocates dx, dw, db (only with a bias), then its fp32 [1 or 2, chunks, cols] workspace.
    chunks = min(rows, 256)
    specs = [((rows, cols), dtype), ((cols,), dtype)] + ([((cols,), dtype)] if bias else [])
    specs.append(((2 if bias else 1, chunks, cols), torch.float32))
    ptrs = _poison(device, specs)
    dx, dw, db = ext.bwd(dy2, x2, wd, mean, rstd, bias, rms)
    _assert_overwritten({"dx": dx, "dw": dw, **({"db": db} if bias else {})}, ptrs[:-1])
    assert y.dtype == dx.dtype == dw.dtype == dtype

    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    b64 = b.double().requires_grad_() if bias else None
    y_ref, mean_ref, rstd_ref = layer_norm_ref(x64, w64, b64, EPS, rms)
    y_ref.backward(dy.double())
    tol = TOL[dtype]
    errors = {"y": (rel_err(y.cpu().reshape(shape), y_ref), tol),
              "rstd": (rel_err(rstd.cpu(), rstd_ref.detach().reshape(-1)), 1e-5)}  # fp32 statistics for every dtype
    if not rms:
        errors["mean"] = (rel_err(mean.cpu(), mean_ref.detach().reshape(-1)), 1e-5)
    errors["dx"] = (rel_err(dx.cpu().reshape(shape), x64.grad), tol)
    errors["dw"] = (rel_err(dw.cpu(), w64.grad), tol)
    if bias:
        errors["db"] = (rel_err(db.cpu(), b64.grad), tol)
    record_errors(record_property, within(errors))


# ---- a GPT trained with the HIP kernels ----------------------------------------------------------------

@pytest.mark.parametrize("name", ["debug", "debug-llama"])  # LayerNorm + MHA; RMSNorm + GQA + RoPE
def test_gpt_trains_with_hip_kernels_like_torch(name, device, monkeypatch, caplog):
    """5 bf16 AdamW steps with backend 'hip' give torch's losses within bf16 tolerance."""
    _ext("attention")
    _ext("norm")
    from tests.unit.kernels.test_gpt_end_to_end import _train

    calls = {"attention": 0, "norm": 0}

    def counting(fn, key):
        def wrapper(*args):
            calls[key] += 1
            return fn(*args)
        return wrapper

    monkeypatch.setattr(hip_ops.HipFlashAttention, "apply", counting(hip_ops.HipFlashAttention.apply, "attention"))
    monkeypatch.setattr(hip_ops.HipNorm, "apply", counting(hip_ops.HipNorm.apply, "norm"))
    # hidden 256 over 4 heads: head dim 64, which the HIP attention takes; seq 100: a ragged second key tile.
    sizes = dict(hidden_size=256, seq_length=100)
    select._said.clear()
    with caplog.at_level(logging.INFO, logger="megatron.kernels.select"):
        hip_losses = _train(name, "hip", device=device, dtype=torch.bfloat16, **sizes)
    assert not any("falling back" in r.message or "unavailable" in r.message for r in caplog.records)
    assert calls["attention"] > 0 and calls["norm"] > 0, calls

    select._said.clear()
    torch_losses = _train(name, "torch", device=device, dtype=torch.bfloat16, **sizes)

    assert hip_losses[-1] < hip_losses[0]  # it trains
    for got, ref in zip(hip_losses, torch_losses, strict=True):
        assert abs(got - ref) <= TOL[torch.bfloat16] * abs(ref), (hip_losses, torch_losses)
