"""``auto`` by measurement (megatron/kernels/measure.py) with fake backends of known cost: a fake timer
charges each backend a fixed number of milliseconds, so nothing here depends on real time."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from megatron.kernels import attention, measure, norms, select

CPU = torch.device("cpu")


class FakeTimer:
    """Charges ``costs[name]`` ms; runs each thunk once so the thunks are proved runnable."""

    def __init__(self, costs: dict[str, float]) -> None:
        self.costs, self.calls, self.results = costs, [], {}

    def __call__(self, name, thunk):
        self.calls.append(name)
        self.results[name] = thunk()
        return self.costs[name]


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    monkeypatch.delenv("MEGATRON_KERNEL_CACHE_DIR", raising=False)
    measure.reset()
    select._said.clear()
    yield
    measure.set_timer(None)
    measure.reset()
    select._said.clear()


def _thunks(names):
    return lambda: {n: (lambda n=n: n) for n in names}


def test_fastest_takes_the_cheapest_logs_once_and_remembers(caplog):
    timer = FakeTimer({"torch": 3.0, "triton": 1.0, "hip": 2.0})
    measure.set_timer(timer)
    with caplog.at_level(logging.INFO, logger="megatron.kernels.measure"):
        for _ in range(3):
            assert measure.fastest("k1", _thunks(["hip", "triton", "torch"]), CPU) == "triton"
    assert sorted(timer.calls) == ["hip", "torch", "triton"]  # measured once, each backend once
    logged = [r.message for r in caplog.records if "k1" in r.message]
    assert len(logged) == 1 and "'triton'" in logged[0] and "torch 3.000 ms" in logged[0]


def test_torch_wins_ties_and_slow_kernels():
    measure.set_timer(FakeTimer({"torch": 1.0, "triton": 1.0}))
    assert measure.fastest("tie", _thunks(["triton", "torch"]), CPU) == "torch"
    measure.set_timer(FakeTimer({"torch": 1.0, "triton": 1.5, "hip": 9.0}))
    assert measure.fastest("slow", _thunks(["hip", "triton", "torch"]), CPU) == "torch"
    with pytest.raises(ValueError, match="torch must always"):
        measure.fastest("no-torch", _thunks(["triton"]), CPU)


def test_cache_file_is_read_back_and_keyed_by_versions(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_KERNEL_CACHE_DIR", str(tmp_path))
    measure.set_timer(FakeTimer({"torch": 2.0, "triton": 1.0}))
    assert measure.fastest("k", _thunks(["triton", "torch"]), CPU) == "triton"
    data = json.loads((tmp_path / measure.CACHE_FILE).read_text())
    (section,) = data
    assert "torch " + torch.__version__ in section and data[section]["k"]["ms"] == {"torch": 2.0, "triton": 1.0}

    measure.reset()  # a new run: the cache answers, the timer is never called
    untouched = FakeTimer({})
    measure.set_timer(untouched)
    assert measure.fastest("k", _thunks(["triton", "torch"]), CPU) == "triton"
    assert untouched.calls == []

    measure.reset()  # other versions (another section) are never read
    monkeypatch.setattr(measure, "_versions", lambda device: "another device | torch 0")
    measure.set_timer(FakeTimer({"torch": 1.0, "triton": 2.0}))
    assert measure.fastest("k", _thunks(["triton", "torch"]), CPU) == "torch"


def test_fwd_bwd_runs_backward_without_touching_grads_or_rng():
    w = torch.randn(4, 3, requires_grad=True)
    x = torch.randn(2, 4)
    thunk = measure.fwd_bwd(lambda a, b: a @ b, x, w)
    state = torch.get_rng_state()
    (gw,) = thunk()  # only w needs a gradient
    assert torch.equal(torch.get_rng_state(), state) and w.grad is None
    torch.testing.assert_close(gw, x.t() @ torch.ones(2, 3), rtol=0, atol=0)
    with torch.no_grad():
        assert isinstance(measure.fwd_bwd(lambda a, b: a @ b, x, w)(), torch.Tensor)  # forward only


def _qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 2, 19, 16, generator=g).requires_grad_() for _ in range(3)]


@pytest.mark.parametrize("costs,expect", [({"torch": 2.0, "triton": 1.0}, "triton"),
                                          ({"torch": 1.0, "triton": 2.0}, "torch")])
def test_attention_seam_runs_the_measured_choice(monkeypatch, costs, expect):
    monkeypatch.setattr(measure, "enabled", lambda device: True)
    timer = FakeTimer(costs)
    measure.set_timer(timer)
    used = []
    real_run = attention._run
    monkeypatch.setattr(attention, "_run", lambda b, *a, **kw: used.append(b) or real_run(b, *a, **kw))
    q, k, v = _qkv()
    out = attention.dot_product_attention(q, k, v, causal=True)
    ref = attention.dot_product_attention(q, k, v, causal=True, backend="torch")
    assert used[-2] == expect and sorted(timer.calls) == ["torch", "triton"]
    assert len(timer.results["triton"]) == 3  # the timed thunk ran the backward: dq, dk, dv
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_norm_seam_measures_layer_and_rms_norm_separately(monkeypatch):
    monkeypatch.setattr(measure, "enabled", lambda device: True)
    timer = FakeTimer({"torch": 1.0, "triton": 0.5})
    measure.set_timer(timer)
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(5, 40, generator=g), torch.randn(40, generator=g), torch.randn(40, generator=g)
    torch.testing.assert_close(norms.layer_norm(x, w, b, 1e-5), norms.layer_norm(x, w, b, 1e-5, backend="torch"),
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(norms.rms_norm(x, w, 1e-5), norms.rms_norm(x, w, 1e-5, backend="torch"),
                               rtol=1e-5, atol=1e-6)
    assert sorted(timer.calls) == ["torch", "torch", "triton", "triton"]
    assert any(k.startswith("layernorm|") for k in measure._choices)
    assert any(k.startswith("rmsnorm|") for k in measure._choices)


def test_explicit_backend_is_never_measured(monkeypatch):
    monkeypatch.setattr(measure, "enabled", lambda device: True)
    timer = FakeTimer({})
    measure.set_timer(timer)
    q, k, v = _qkv()
    attention.dot_product_attention(q, k, v, backend="triton")
    attention.dot_product_attention(q, k, v, backend="torch")
    assert timer.calls == []


def test_cpu_run_never_measures_nor_imports_triton():
    assert not measure.enabled(CPU)
    code = ("import sys, torch; from megatron.kernels import attention, norms; "
            "q = torch.randn(1, 2, 8, 16); attention.dot_product_attention(q, q, q); "
            "norms.layer_norm(q, torch.ones(16), None, 1e-5); assert 'triton' not in sys.modules, 'imported'")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120, cwd=repo)


def test_env_forces_torch_or_static(monkeypatch):
    monkeypatch.setenv("MEGATRON_KERNEL_SELECT", "torch")
    assert measure.resolve("auto") == "torch" and measure.resolve("triton") == "triton"
    q, k, v = _qkv()
    used = []
    real_run = attention._run
    monkeypatch.setattr(attention, "_run", lambda b, *a, **kw: used.append(b) or real_run(b, *a, **kw))
    attention.dot_product_attention(q, k, v)
    assert used == ["torch"]
    monkeypatch.setenv("MEGATRON_KERNEL_SELECT", "static")
    assert not measure.enabled(torch.device("meta"))
    monkeypatch.delenv("MEGATRON_KERNEL_SELECT")
    assert measure.enabled(torch.device("meta"))
