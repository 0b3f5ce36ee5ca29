"""Triton flash attention under TRITON_INTERPRET=1 vs a float64 reference: forward, LSE and gradients."""

from __future__ import annotations

import importlib
import math
import random

import pytest
import torch

from tests.unit.kernels.reference import (attention_inputs, attention_ref, check_attention, dtype_id, nan_alloc,
                                          record_errors, rel_err)


@pytest.fixture
def ta(monkeypatch):
    mod = importlib.import_module("megatron.kernels.triton_attention")
    monkeypatch.setattr(mod, "_alloc", nan_alloc)
    assert mod._blocks() == (16, 16), "the interpreter tests assume 16x16 tiles"
    return mod


def _random_cases(n: int, seed: int) -> list[tuple]:
    """(b, nq, nkv, s, d, causal, dtype): s mostly not a multiple of the 16-row tile, GQA and MHA."""
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        nkv = rng.choice([1, 2])
        cases.append((rng.choice([1, 2]), nkv * rng.choice([1, 2]), nkv, rng.choice([1, 7, 16, 23, 33, 40]),
                      rng.choice([8, 16, 24, 32]), i % 2 == 0, torch.float32 if i < n // 2 else torch.bfloat16))
    return cases


CASES = [
    (1, 4, 1, 45, 64, True, torch.float32),  # head dim 64, 3 partial-ish tiles, 4:1 GQA
    (1, 2, 2, 17, 64, False, torch.bfloat16),
    (2, 3, 3, 19, 16, True, torch.float16),
    *_random_cases(12, seed=6),
]


def _inputs(b, nq, nkv, s, d, dtype, seed):
    return attention_inputs(b, nq, nkv, s, d, dtype, seed)


@pytest.mark.parametrize("b,nq,nkv,s,d,causal,dtype", CASES, ids=dtype_id)
def test_forward_backward_match_float64(ta, b, nq, nkv, s, d, causal, dtype, record_property):
    errors = check_attention(ta, b, nq, nkv, s, d, causal, dtype, seed=s * 131 + d)  # shared with tests/gpu
    record_errors(record_property, errors)


@pytest.mark.parametrize("causal", [False, True])
def test_autograd_function_with_strided_inputs(ta, causal):
    """Through autograd with q/k/v as transposed views of [b, s, h, d] (what a model produces)."""
    b, s, nq, nkv, d = 2, 21, 4, 2, 16
    g = torch.Generator().manual_seed(1)
    q = torch.randn(b, s, nq, d, generator=g).transpose(1, 2).requires_grad_()
    k = torch.randn(b, s, nkv, d, generator=g).transpose(1, 2).requires_grad_()
    v = torch.randn(b, s, nkv, d, generator=g).transpose(1, 2).requires_grad_()
    do = torch.randn(b, nq, s, d, generator=g)
    o = ta.flash_attention(q, k, v, causal)
    o.backward(do)

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    o_ref, _ = attention_ref(q64, k64, v64, causal, 1.0 / math.sqrt(d))
    o_ref.backward(do.double())
    assert rel_err(o, o_ref) <= 1e-5
    for got, ref in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        assert got.shape == ref.shape and rel_err(got, ref) <= 1e-5


def test_unsupported_inputs_are_named(ta):
    q = torch.randn(1, 2, 8, 16)
    assert ta.unsupported_reason(q, q, q, dropout_p=0.1) is not None
    assert ta.unsupported_reason(q.double(), q.double(), q.double(), 0.0) is not None
    assert ta.unsupported_reason(q, torch.randn(1, 3, 8, 16), torch.randn(1, 3, 8, 16), 0.0) is not None
    assert ta.unsupported_reason(q, q, q, 0.0) is None


def test_backward_reads_strided_grad_output_in_place(ta):
    """dO as a transposed view of [b, s, h, d] (what autograd hands back after the model's permute) gives
    bit-identical gradients to a contiguous dO: the kernels take its strides, no copy is needed."""
    b, nq, s, d = 1, 2, 21, 16
    q, k, v, do = _inputs(b, nq, nq, s, d, torch.float32, seed=5)
    o, lse = ta.attention_forward(q, k, v, True, 0.25)
    strided = do.transpose(1, 2).contiguous().transpose(1, 2)
    assert not strided.is_contiguous()
    for got, want in zip(ta.attention_backward(strided, q, k, v, o, lse, True, 0.25),
                         ta.attention_backward(do, q, k, v, o, lse, True, 0.25), strict=True):
        assert torch.equal(got, want)


def test_autotune_configs_one_small_under_interpreter_amd_knobs_only_on_hip(ta, monkeypatch):
    assert [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for c in ta._fwd_kernel.configs] == [(16, 16)]
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(torch.version, "hip", None)
    nvidia = ta._configs()
    assert len(nvidia) > 1 and not any("waves_per_eu" in c.kwargs for c in nvidia)
    monkeypatch.setattr(torch.version, "hip", "6.2")
    amd = ta._configs()
    assert all("waves_per_eu" in c.kwargs and "matrix_instr_nonkdim" in c.kwargs for c in amd)
    assert all(c.kwargs["BLOCK_N"] <= 64 for c in amd)
    wide = ta._prune(nvidia, {}, BLOCK_D=256)
    assert wide and all(c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 64 * 64 for c in wide)
