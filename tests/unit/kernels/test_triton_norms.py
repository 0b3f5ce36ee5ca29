"""Triton LayerNorm / RMSNorm under TRITON_INTERPRET=1 vs a float64 reference: y, mean, rstd and gradients."""

from __future__ import annotations

import importlib

import pytest
import torch

from tests.unit.kernels.reference import check_norm, dtype_id, layer_norm_ref, nan_alloc, record_errors, rel_err

EPS = 1e-5


@pytest.fixture
def tn(monkeypatch):
    mod = importlib.import_module("megatron.kernels.triton_norms")
    monkeypatch.setattr(mod, "_alloc", nan_alloc)
    return mod


# (shape, rms, bias): cols not a power of two, a single row, rows not a multiple of the program count.
CASES = [
    ((1, 8), False, True),
    ((5, 33), False, True),
    ((3, 7, 100), False, False),
    ((9, 257), True, False),
    ((2, 3, 64), True, False),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("shape,rms,bias", CASES)
def test_forward_backward_match_float64(tn, shape, rms, bias, dtype, record_property):
    record_errors(record_property, check_norm(tn, shape, rms, bias, dtype, EPS))  # shared with tests/gpu


def test_autograd_functions(tn):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 6, 48, generator=g).requires_grad_()
    w = torch.randn(48, generator=g).requires_grad_()
    b = torch.randn(48, generator=g).requires_grad_()
    dy = torch.randn(4, 6, 48, generator=g)
    tn.layer_norm(x, w, b, EPS).backward(dy)
    got = (x.grad, w.grad, b.grad)
    x.grad = w.grad = b.grad = None
    torch.nn.functional.layer_norm(x, (48,), w, b, EPS).backward(dy)
    for a, r in zip(got, (x.grad, w.grad, b.grad), strict=True):
        assert rel_err(a, r) <= 1e-5

    x.grad = w.grad = None
    tn.rms_norm(x, w, EPS).backward(dy)
    got = (x.grad, w.grad)
    x.grad = w.grad = None
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    layer_norm_ref(x64, w64, None, EPS, rms=True)[0].backward(dy.double())
    for a, r in zip(got, (x64.grad, w64.grad), strict=True):
        assert rel_err(a, r) <= 1e-5


@pytest.mark.parametrize("shape,rms,bias",
                         [((37, 100), False, True), ((5, 3, 129), True, False), ((1, 64), False, True)])
def test_wide_row_split_backward_matches_fused(tn, monkeypatch, shape, rms, bias):
    """The wide-row backward (dx kernel + column-tiled dgamma/dbeta pass) against the fused kernel and
    float64; SPLIT_BLOCK is lowered so small rows take the path 12288-wide rows take on a GPU."""
    g = torch.Generator().manual_seed(11)
    cols = shape[-1]
    x = torch.randn(shape, generator=g) * 2 + 5
    w = 1 + 0.5 * torch.randn(cols, generator=g)
    b = torch.randn(cols, generator=g) if bias else None
    dy = torch.randn(shape, generator=g)
    y, mean, rstd = tn.norm_forward(x, w, b, EPS, rms)
    fused = tn.norm_backward(dy, x, w, mean, rstd, bias, rms)
    monkeypatch.setattr(tn, "SPLIT_BLOCK", 64)
    split = tn.norm_backward(dy, x, w, mean, rstd, bias, rms)
    assert torch.equal(split[0], fused[0])  # dx: the same arithmetic, only dgamma/dbeta moved
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    b64 = b.double().requires_grad_() if bias else None
    layer_norm_ref(x64, w64, b64, EPS, rms)[0].backward(dy.double())
    assert not split[1].isnan().any() and rel_err(split[1], w64.grad) <= 1e-5
    if bias:
        assert rel_err(split[2], b64.grad) <= 1e-5


def test_norm_autotune_one_config_under_interpreter_pruned_on_gpu(tn, monkeypatch):
    assert [c.kwargs["ROWS"] for c in tn._norm_fwd_kernel.configs] == [16]
    monkeypatch.delenv("TRITON_INTERPRET")
    gpu = tn._configs()
    wide = tn._prune(gpu, {}, BLOCK=16384)
    assert wide and all(c.kwargs["ROWS"] == 1 for c in wide)
    narrow = tn._prune(gpu, {}, BLOCK=128)
    assert narrow and all(c.num_warps * 128 <= max(128, c.kwargs["ROWS"] * 128) for c in narrow)
    assert all(c.kwargs["ROWS"] * 128 >= 1024 for c in narrow if c.kwargs["ROWS"] > 1)


@pytest.mark.parametrize("one_plus,x_dtype,w_dtype", [(True, torch.float32, torch.float32),
                                                      (True, torch.bfloat16, torch.bfloat16),
                                                      (False, torch.float32, torch.bfloat16),
                                                      (True, torch.float32, torch.bfloat16)],
                         ids=["1p", "1p-bf16", "fp32-residual", "1p-fp32-residual"])
def test_model_norm_variants_run_the_triton_kernel(tn, monkeypatch, one_plus, x_dtype, w_dtype):
    """--apply-layernorm-1p (1 + weight) and --fp32-residual-connection (an fp32 input, 16-bit weights) reach the
    kernel seam as inputs of one dtype, so the Triton kernel runs them (no fallback) and equals torch's path."""
    from megatron.kernels import norms as norm_ops
    from megatron.model.norms import Norm

    picked = []
    run = norm_ops._run
    monkeypatch.setattr(norm_ops, "_run", lambda backend, *a, **k: (picked.append(backend), run(backend, *a, **k))[1])
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 2, 40, generator=g).to(x_dtype)
    dy = torch.randn(3, 2, 40, generator=g).to(w_dtype)
    results = {}
    for backend in ("triton", "torch"):
        norm = Norm(40, "layernorm", EPS, backend=backend, one_plus=one_plus)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(40, generator=torch.Generator().manual_seed(1)))
            norm.bias.copy_(torch.randn(40, generator=torch.Generator().manual_seed(2)))
        norm = norm.to(w_dtype)
        x_ = x.clone().requires_grad_()
        y = norm(x_)
        assert y.dtype == w_dtype
        y.backward(dy)
        results[backend] = [t.detach().double() for t in (y, x_.grad, norm.weight.grad, norm.bias.grad)]
    assert picked == ["triton", "torch"]
    tol = 1e-5 if w_dtype == torch.float32 else 2e-2
    for got, ref in zip(results["triton"], results["torch"], strict=True):
        assert rel_err(got, ref) <= tol
