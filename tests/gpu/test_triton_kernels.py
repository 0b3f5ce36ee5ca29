"""The Triton kernels compiled for the GPU (real tile sizes, autotuned) vs the float64 reference.

Same checks as the interpreter tests in tests/unit/kernels (tests/unit/kernels/reference.py: check_attention and
check_norm run there on CPU under TRITON_INTERPRET=1), here on the device: the interpreter tests' shapes plus
sequences up to 4096, head dim 64/128, fp32/bf16/fp16, forward and backward.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from tests.unit.kernels.reference import check_attention, check_norm, dtype_id, nan_alloc, record_errors
from tests.unit.kernels.test_triton_attention import CASES as INTERPRETER_ATTENTION_CASES
from tests.unit.kernels.test_triton_norms import CASES as INTERPRETER_NORM_CASES
from tests.unit.kernels.test_triton_norms import EPS

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _device() -> str:
    return torch.device("cuda", torch.cuda.current_device()).type


@pytest.fixture(scope="module")
def compiled():
    """The kernel modules compiled for the device: TRITON_INTERPRET must be off when they are imported."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.fail("TRITON_INTERPRET=1 is set: the GPU suite must compile the kernels for the device")
    return (importlib.import_module("megatron.kernels.triton_attention"),
            importlib.import_module("megatron.kernels.triton_norms"))


@pytest.fixture
def ta(compiled, monkeypatch):
    monkeypatch.setattr(compiled[0], "_alloc", nan_alloc)
    return compiled[0]


@pytest.fixture
def tn(compiled, monkeypatch):
    monkeypatch.setattr(compiled[1], "_alloc", nan_alloc)
    return compiled[1]


def _gpu_attention_cases() -> list[tuple]:
    """(b, nq, nkv, s, d, causal, dtype): GPU tile sizes are 64-128 rows, so lengths around and across them."""
    cases = []
    for s in (127, 1000, 2048, 4096):
        for d in (64, 128):
            for dtype in DTYPES:
                b, nq, nkv = (1, 2, 1) if s >= 2048 else (2, 4, 2)  # GQA 2:1 / 4:2; float64 scores stay small
                cases += [(b, nq, nkv, s, d, True, dtype), (b, nq, nkv, s, d, False, dtype)]
    return cases


@pytest.mark.parametrize("b,nq,nkv,s,d,causal,dtype", INTERPRETER_ATTENTION_CASES + _gpu_attention_cases(),
                         ids=dtype_id)
def test_attention_matches_float64(ta, b, nq, nkv, s, d, causal, dtype, record_property):
    errors = check_attention(ta, b, nq, nkv, s, d, causal, dtype, seed=s * 131 + d, device=_device())
    record_errors(record_property, errors)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape,rms,bias", INTERPRETER_NORM_CASES + [
    ((4096, 2048), False, True),   # GPT-2-like rows
    ((2, 2048, 4096), True, False),  # Llama-7B hidden
    ((1024, 6144), False, True),   # GPT-22B hidden: wide row path on some devices
    ((257, 12288), True, False),   # GPT-175B hidden: the column-split backward
])
def test_norms_match_float64(tn, shape, rms, bias, dtype, record_property):
    reason = tn.unsupported_reason(torch.empty(0, shape[-1], dtype=dtype), torch.empty(shape[-1], dtype=dtype),
                                   torch.empty(shape[-1], dtype=dtype) if bias else None)
    if reason is not None:
        pytest.skip(f"the Triton norm does not take these inputs ({reason}); the torch path runs them")
    record_errors(record_property, check_norm(tn, shape, rms, bias, dtype, EPS, device=_device()))


def test_seam_runs_triton_and_matches_torch():
    """Through the kernel seam as the model calls it: the triton backend (which must be available on a GPU, or
    the comparison would be torch against torch) equals the torch path within bf16 tolerance, forward and
    backward, causal GQA."""
    from megatron.kernels import select
    from megatron.kernels.attention import dot_product_attention

    dev = torch.device(_device(), torch.cuda.current_device())
    ok, why = select.available("triton", "attention", dev)
    assert ok, f"the Triton attention is not available on this GPU: {why}"
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(shape, generator=g).to(torch.bfloat16).to(dev)
                   for shape in ((2, 8, 512, 64), (2, 4, 512, 64), (2, 4, 512, 64), (2, 8, 512, 64)))
    outs = {}
    for backend in ("triton", "torch"):
        q_, k_, v_ = (t.clone().requires_grad_() for t in (q, k, v))
        o = dot_product_attention(q_, k_, v_, causal=True, backend=backend)
        o.backward(do)
        outs[backend] = [o.detach().double(), q_.grad.double(), k_.grad.double(), v_.grad.double()]
    for got, ref in zip(outs["triton"], outs["torch"], strict=True):
        assert ((got - ref).norm() / ref.norm()).item() < 2e-2


@pytest.mark.parametrize("backend", ["triton", "hip"])
def test_seam_norm_variants_run_the_kernel(compiled, monkeypatch, backend):
    """The model's Norm with --apply-layernorm-1p and an fp32 residual stream (--fp32-residual-connection: fp32 input,
    bf16 weights) through the seam at a real width: the kernel runs it (no fallback) and equals torch's path."""
    from megatron.kernels import norms as norm_ops
    from megatron.kernels import select
    from megatron.model.norms import Norm
    from tests.unit.kernels.reference import rel_err

    dev = torch.device(_device(), torch.cuda.current_device())
    ok, why = select.available(backend, "norm", dev)
    if not ok:
        pytest.skip(f"{backend} norm not available here: {why}")
    picked = []
    run = norm_ops._run
    monkeypatch.setattr(norm_ops, "_run", lambda b, *a, **k: (picked.append(b), run(b, *a, **k))[1])
    g = torch.Generator().manual_seed(5)
    x, dy = torch.randn(2048, 2, 4096, generator=g).to(dev), torch.randn(2048, 2, 4096, generator=g).to(dev)
    results = {}
    for b in (backend, "torch"):
        norm = Norm(4096, "layernorm", EPS, backend=b, one_plus=True)
        with torch.no_grad():
            norm.weight.copy_(0.1 * torch.randn(4096, generator=torch.Generator().manual_seed(1)))
            norm.bias.copy_(0.1 * torch.randn(4096, generator=torch.Generator().manual_seed(2)))
        norm = norm.to(dev, torch.bfloat16)
        x_ = x.clone().requires_grad_()
        y = norm(x_)
        y.backward(dy.to(torch.bfloat16))
        results[b] = [t.detach().double() for t in (y, x_.grad, norm.weight.grad, norm.bias.grad)]
    assert picked == [backend, "torch"]
    for got, ref in zip(results[backend], results["torch"], strict=True):
        assert rel_err(got, ref) <= 2e-2
