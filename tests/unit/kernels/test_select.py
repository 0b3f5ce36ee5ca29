"""Backend selection in the attention and norm seams: choice, logging once, fallback without wrong results."""

from __future__ import annotations

import logging

import pytest
import torch

from megatron.errors import ConfigError
from megatron.kernels import attention, norms, select


@pytest.fixture(autouse=True)
def fresh_log_state():
    select._said.clear()
    yield
    select._said.clear()


def _qkv(dtype=torch.float32, nq=4, nkv=2, s=19, d=16):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(2, nq, s, d, generator=g, dtype=dtype), torch.randn(2, nkv, s, d, generator=g, dtype=dtype),
            torch.randn(2, nkv, s, d, generator=g, dtype=dtype))


def test_auto_prefers_triton_under_interpreter_and_logs_once(caplog):
    cpu = torch.device("cpu")
    with caplog.at_level(logging.INFO, logger="megatron.kernels.select"):
        assert select.choose("attention", "auto", cpu) == "triton"
        assert select.choose("attention", "auto", cpu) == "triton"
    assert sum("'auto' uses 'triton'" in r.message for r in caplog.records) == 1


def test_cpu_without_interpreter_uses_torch(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    cpu = torch.device("cpu")
    assert select.choose("attention", "auto", cpu) == "torch"
    assert select.choose("norm", "triton", cpu) == "torch"


def test_hip_request_without_extension_falls_back_with_one_warning(caplog):
    assert not select.available("hip", "attention", torch.device("cpu"))[0]
    with caplog.at_level(logging.WARNING, logger="megatron.kernels.select"):
        for _ in range(3):
            assert select.choose("attention", "hip", torch.device("cpu")) == "triton"
    assert sum("'hip' unavailable" in r.message for r in caplog.records) == 1


def test_unknown_backend_is_a_config_error():
    with pytest.raises(ConfigError, match="kernel backend 'cudnn'"):
        select.choose("attention", "cudnn", torch.device("cpu"))


@pytest.mark.parametrize("causal", [False, True])
def test_seam_triton_equals_torch(causal):
    q, k, v = _qkv()
    got = attention.dot_product_attention(q, k, v, causal=causal, backend="triton")
    ref = attention.dot_product_attention(q, k, v, causal=causal, backend="torch")
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_unsupported_inputs_fall_back_to_torch_exactly(caplog):
    q, k, v = _qkv(dtype=torch.float64)
    with caplog.at_level(logging.WARNING, logger="megatron.kernels.select"):
        got = attention.dot_product_attention(q, k, v, causal=True, backend="triton")
        attention.dot_product_attention(q, k, v, causal=True, backend="triton")
    ref = attention.dot_product_attention(q, k, v, causal=True, backend="torch")
    assert torch.equal(got, ref)
    assert sum("cannot take" in r.message for r in caplog.records) == 1

    torch.manual_seed(0)
    q, k, v = _qkv()
    torch.manual_seed(1)
    dropped = attention.dot_product_attention(q, k, v, dropout_p=0.5, backend="triton")
    torch.manual_seed(1)
    assert torch.equal(dropped, attention.dot_product_attention(q, k, v, dropout_p=0.5, backend="torch"))


def test_norm_seam_triton_equals_torch_and_mixed_dtype_falls_back():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 5, 40, generator=g)
    w, b = torch.randn(40, generator=g), torch.randn(40, generator=g)
    torch.testing.assert_close(norms.layer_norm(x, w, b, 1e-5, backend="triton"),
                               norms.layer_norm(x, w, b, 1e-5, backend="torch"), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(norms.rms_norm(x, w, 1e-5, backend="triton"),
                               norms.rms_norm(x, w, 1e-5, backend="torch"), rtol=1e-5, atol=1e-6)
    xb = x.bfloat16()  # bf16 activations with fp32 weights: torch's dtype promotion is kept via fallback
    assert torch.equal(norms.rms_norm(xb, w, 1e-5, backend="triton"), norms.rms_norm(xb, w, 1e-5, backend="torch"))
